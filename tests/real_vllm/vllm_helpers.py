"""Helpers of the real-vLLM tests (importable as `vllm_helpers`: pytest puts tests/real_vllm/ on sys.path, and tests/
too)."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if os.path.join(REPO, "tests") not in sys.path:  # the scripts of this folder import `cpu_engines` from tests/
    sys.path.append(os.path.join(REPO, "tests"))
DEMO_MODEL = os.path.join(REPO, "trl_grpo_ext", "tools", "recipes", "tiny", "base_model")
DEMO_TRAIN = os.path.join(REPO, "trl_grpo_ext", "tools", "recipes", "tiny", "data", "train.jsonl")
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def reversal_reward(completions, solution, **kwargs) -> list[float]:
    """1 for the reversed string, plus 0.1 per letter in place: completions of one prompt score differently."""
    return [
        float(completion == answer) + 0.1 * sum(a == b for a, b in zip(completion, answer, strict=False))
        for completion, answer in zip(completions, solution, strict=True)
    ]


def vllm_args(output_dir, **overrides) -> dict:
    """Keyword arguments of a few-step colocate run on the demo model (16 prompts x 4 completions)."""
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=10,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
    )
    args.update(overrides)
    return args


def training_logs(log_history) -> list[dict]:
    return [entry for entry in log_history if "loss" in entry]


def run_script(
    script: str, *args, unset=(), timeout: int = 900, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    """A script of this folder (or at an absolute path) in its own process (its own engine), from the repository root,
    with the test environment less `unset`, plus `extra_env`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", **(extra_env or {}))
    for name in unset:
        env.pop(name, None)
    # TRL's colocate mode sets these in this process for the shared engine's process group: a child that inherited
    # them would take itself for a rank of that group and wait on its port.
    for name in DISTRIBUTED_VARIABLES:
        env.pop(name, None)
    command = [sys.executable, os.path.join(HERE, script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def read_jsonl(path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


TRL_SAMPLING = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
BATCH_KEYS = ("prompt_ids", "completion_ids", "completion_mask", "sampling_per_token_logps", "advantages")


def recording(trainer_class):
    """`trainer_class` keeping each generated batch (`batches`) and each generation's vLLM outputs (`outputs`)."""

    class Recording(trainer_class):
        def _generate_and_score_completions(self, inputs):
            if not hasattr(self, "batches"):
                self.batches, self.outputs = [], []
                llm = self.vllm_generation.llm  # the shared engine: record this trainer's calls only
                generate = llm.generate

                def recorded_generate(*args, **kwargs):
                    outputs = generate(*args, **kwargs)
                    if getattr(self, "_recording", False):
                        self.outputs.append(outputs)
                    return outputs

                llm.generate = recorded_generate
            self._recording = True
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self._recording = False
            batch = {k: v.detach().clone() for k, v in output.items() if torch.is_tensor(v)}
            batch["own_logps"] = own_logps(self.model, batch, self.temperature)
            self.batches.append(batch)
            return output

    return Recording


def own_logps(model, batch, temperature) -> torch.Tensor:
    """The trainer's log-probs `(N, T)` of the sampled tokens, from a plain transformers forward at generation."""
    prompt_length = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_length - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]


#: How far the engine's log-probs of the same tokens may differ between two runs whose weights differ by float
#: rounding: on a CPU without AVX-512, vLLM's CPU kernels turned rounding-level weight differences into log-prob
#: differences up to 3.9e-4 by the third step (the same run twice is bitwise equal).
ENGINE_LOGP_ATOL = 1e-3

#: How far a loss that carries the engine's log-probs (vLLM's importance-sampling weights, `exp(logp - sampler_logp)`)
#: may differ between two such runs: a weight off by up to `ENGINE_LOGP_ATOL` in log moves the loss by about that
#: much of its terms (advantages of order 1, 1e-3 in mean) while the loss itself, their difference, can be 100 times
#: smaller (a relative difference of 5e-4 seen at 2.7e-3 of loss, 1.4e-6 in absolute); 1e-5 absolute.
ENGINE_LOSS_ATOL = 1e-5


def assert_same_batches(first, second):
    """The same tokens and masks, bitwise; the engine's log-probs of them to `ENGINE_LOGP_ATOL`."""
    assert len(first.batches) == len(second.batches)
    for step, (a, b) in enumerate(zip(first.batches, second.batches, strict=True)):
        for key in BATCH_KEYS:
            if key == "sampling_per_token_logps":
                difference = (a[key].double() - b[key].double()).abs().max().item()
                assert difference <= ENGINE_LOGP_ATOL, (step, key, difference)
            else:
                assert torch.equal(a[key], b[key]), (step, key)


def assert_same_logs(first, second, keys, rel=1e-5, abs=1e-7):
    ours, theirs = training_logs(first.state.log_history), training_logs(second.state.log_history)
    assert len(ours) == len(theirs) > 0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in keys:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=rel, abs=abs), (step, key)


def vllm_rows(outputs) -> list[list[float]]:
    """Each completion's sampled-token log-probs as vLLM reported them (colocate: one completion per request, in the
    batch's row order)."""
    rows = []
    for request in outputs:
        for completion in request.outputs:
            steps = zip(completion.logprobs, completion.token_ids, strict=True)
            rows.append([step[token].logprob for step, token in steps])
    return rows
