"""vLLM engines of their own, for tests/real_vllm/test_shim.py (each run starts one engine: 15-130 s).

    python tests/real_vllm/engine_run.py trl-without-shim <output_dir>
    python tests/real_vllm/engine_run.py spawned <output_json>

`trl-without-shim`: stock `trl.GRPOTrainer` in colocate mode for one step, without `enable_vllm_on_cpu`; it is
expected to fail at the first weight sync.

`spawned`: a plain `vllm.LLM`, whose engine vLLM spawns in processes of its own, with `enable_vllm_on_cpu()` called
only here, under the `__main__` guard (the spawned processes never run it themselves: only a vLLM plugin, the tests'
own in tests/vllm_plugin/, can carry the shim there). Writes to `<output_json>` what the engine's worker holds (the
element count of each weight); then loads perturbed weights (Gaussian noise of each tensor's spread added) into the
engine, and writes the log-probs of its greedy completion as the engine gives them and as transformers (float32) gives
them with the perturbed and with the original weights.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm_helpers import DEMO_MODEL  # noqa: E402

PROMPT = "abcd="


def weight_sizes(worker) -> dict[str, int]:
    """Run in the engine's worker process: the element count of each weight of the loaded model."""
    return {name: param.numel() for name, param in worker.model_runner.model.named_parameters()}


def load_weights(worker, path: str) -> None:
    """Run in the engine's worker process: what TRL's weight sync does, with the tensors of a safetensors file."""
    from safetensors.torch import load_file

    worker.model_runner.model.load_weights(weights=list(load_file(path).items()))


def completion_logps(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logps = model(ids).logits[0, len(prompt_ids) - 1 : -1].float().log_softmax(-1)
    return logps.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def trl_without_shim(output_dir: str) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from vllm_helpers import vllm_args

    args = GRPOConfig(**vllm_args(output_dir, max_steps=1, per_device_train_batch_size=4))
    trainer = GRPOTrainer(
        model=DEMO_MODEL,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "fgh="] * 8}),
        processing_class=AutoTokenizer.from_pretrained(DEMO_MODEL),
    )
    trainer.train()


def spawned(output_json: str) -> None:
    import torch
    from cpu_engines import enable_vllm_on_cpu
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    enable_vllm_on_cpu()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # functions and tensors to the worker (collective_rpc)
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    original = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    perturbed = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp(min=1e-3))

    # What TRL streams: the named parameters (the tied LM head is the embedding).
    weights = os.path.join(os.path.dirname(os.path.abspath(output_json)), "perturbed.safetensors")
    save_file({name: param.detach().contiguous() for name, param in perturbed.named_parameters()}, weights)

    llm = LLM(model=DEMO_MODEL, max_model_len=32, seed=0, enforce_eager=True)
    result = {"weight_sizes": llm.collective_rpc(weight_sizes)[0], "env": os.environ.get("TRL_GRPO_EXT_VLLM_ON_CPU")}
    llm.collective_rpc(load_weights, args=(weights,))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    completion_ids = list(output.token_ids)
    result["completion_ids"] = completion_ids
    result["engine_logps"] = [step[token].logprob for step, token in zip(output.logprobs, completion_ids, strict=True)]
    result["perturbed_logps"] = completion_logps(perturbed, prompt_ids, completion_ids)
    result["original_logps"] = completion_logps(original, prompt_ids, completion_ids)
    with open(output_json, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    mode, path = sys.argv[1:3]
    {"trl-without-shim": trl_without_shim, "spawned": spawned}[mode](path)
