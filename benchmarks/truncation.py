"""vLLM's importance-sampling correction under truncated sampling, on a real engine: `python -m benchmarks truncation`.

Each side trains the demo model (`trl_grpo_ext/recipes/tiny/base_model`, full fine-tuning, the demo's learning rate
and temperature) for a few steps per sampling setting, generating with vLLM in colocate mode with
`vllm_importance_sampling_correction` on. Run it from the vLLM environment (`make test-vllm` builds `.venv-vllm`):

    .venv-vllm/bin/python -m benchmarks truncation [--truncation-settings "top_p=1.0;top_p=0.8;top_k=3"]
        [--truncation-sides trl,ext] [--truncation-steps 8] [--truncation-mode sequence_mask]

On a machine without GPUs it calls `trl_grpo_ext.testing.enable_vllm_on_cpu()`; all runs share one engine
(`reuse_vllm_engine`: a colocated engine is built once per process), with the sampling settings per request.

vLLM reports log-probs of the distribution it sampled from, after truncation and renormalisation
(`logprobs_mode="processed_logprobs"`), while the trainer's cover the whole vocabulary; with `top_p < 1` or
`top_k > 0` every ratio `exp(trainer_logp - sampler_logp)` then carries the kept probability mass (TRL issue #6789).
Reported per side and setting, over the steps (median, with min and max):

- `sampling/importance_sampling_ratio/mean`, as the trainer logs it (after the mode's truncation or masking; per
  sequence in the `sequence_*` modes);
- from each generated batch, the ratio entering the correction per completion token, before truncation or masking
  (`exp(old_per_token_logps - sampling_per_token_logps)`): its mean and the share of tokens outside [0.9, 1.1].

Sides (`SIDES`): stock `trl.GRPOTrainer` with `trl.GRPOConfig`, and `GRPOTrainerExt` with `GRPOConfigExt`; a side's
extra options go in `OPTIONS`.
"""

from __future__ import annotations

import os
import statistics
import tempfile

from .common import CHECKOUT, format_table

DEMO_MODEL = os.path.join(CHECKOUT, "trl_grpo_ext", "recipes", "tiny", "base_model")
DEMO_TRAIN = os.path.join(CHECKOUT, "trl_grpo_ext", "recipes", "tiny", "data", "train.jsonl")
SIDES = {
    "trl": "stock trl.GRPOTrainer, trl.GRPOConfig",
    "ext": "GRPOTrainerExt, GRPOConfigExt",
}
OPTIONS: dict[str, dict] = {"trl": {}, "ext": {}}
DEFAULT_SETTINGS = "top_p=1.0;top_p=0.8;top_k=3"
BAND = (0.9, 1.1)


def parse_settings(text: str) -> list[dict]:
    """`"top_p=0.8;top_k=3,top_p=0.9"` -> `[{"top_p": 0.8}, {"top_k": 3, "top_p": 0.9}]` (`;` between settings)."""
    settings = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        setting = {}
        for pair in item.split(","):
            name, value = (part.strip() for part in pair.split("="))
            if name not in ("top_p", "top_k", "min_p"):
                raise ValueError(f"unknown sampling setting {name!r} (top_p, top_k or min_p)")
            setting[name] = int(value) if name == "top_k" else float(value)
        settings.append(setting)
    return settings


def _label(setting: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in setting.items())


def _reward(completions, solution, **kwargs) -> list[float]:
    return [float(completion == answer) for completion, answer in zip(completions, solution, strict=True)]


def train(side: str, setting: dict, steps: int, mode: str, output_dir: str) -> dict:
    """One side at one sampling setting: the logged ratio mean and the raw token ratios, per step."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    trainer_class, config_class = {"trl": (GRPOTrainer, GRPOConfig), "ext": (GRPOTrainerExt, GRPOConfigExt)}[side]
    on_cpu = not torch.cuda.is_available()

    class Measured(trainer_class):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            mask = output["completion_mask"].bool()
            log_ratio = output["old_per_token_logps"] - output["sampling_per_token_logps"]
            ratio = log_ratio[mask].double().exp()
            self.token_ratios.append(
                {
                    "mean": ratio.mean().item(),
                    "outside": ((ratio < BAND[0]) | (ratio > BAND[1])).double().mean().item(),
                }
            )
            return output

    args = config_class(
        output_dir=output_dir,
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=10,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_cpu=on_cpu,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        **setting,
        **OPTIONS[side],
    )
    trainer = Measured(
        model=DEMO_MODEL,
        reward_funcs=_reward,
        args=args,
        train_dataset=load_dataset("json", data_files=DEMO_TRAIN, split="train"),
        processing_class=AutoTokenizer.from_pretrained(DEMO_MODEL),
    )
    trainer.token_ratios = []
    trainer.train()
    logged = [
        entry["sampling/importance_sampling_ratio/mean"]
        for entry in trainer.state.log_history
        if "sampling/importance_sampling_ratio/mean" in entry
    ]
    return {
        "side": side,
        "setting": setting,
        "logged_mean": logged,
        "token_mean": [step["mean"] for step in trainer.token_ratios],
        "token_outside": [step["outside"] for step in trainer.token_ratios],
    }


def run(settings: list[dict], sides: tuple[str, ...], steps: int, mode: str) -> dict:
    import torch

    from trl_grpo_ext.testing import enable_vllm_on_cpu, reuse_vllm_engine

    if not torch.cuda.is_available():
        enable_vllm_on_cpu()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = []
    with reuse_vllm_engine(), tempfile.TemporaryDirectory() as folder:
        for setting in settings:
            for side in sides:
                runs.append(train(side, setting, steps, mode, os.path.join(folder, f"{side}-{len(runs)}")))
    return {"mode": mode, "steps": steps, "band": list(BAND), "sides": {s: SIDES[s] for s in sides}, "runs": runs}


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(results: dict) -> str:
    low, high = results["band"]
    headers = [
        "side",
        "sampling",
        f"sampling/importance_sampling_ratio/mean ({results['mode']})",
        "token ratio mean",
        f"tokens outside [{low}, {high}]",
    ]
    rows = [
        [
            run["side"],
            _label(run["setting"]),
            _spread(run["logged_mean"]),
            _spread(run["token_mean"]),
            _spread(run["token_outside"]),
        ]
        for run in results["runs"]
    ]
    return format_table(headers, rows)
