"""End-to-end: `GRPOTrainerExt` (diagnostics on, and off) against stock `trl.GRPOTrainer` on identical work.

Each run is a fresh process (so that peak RSS is its own), on the same locally built model, data and seed. Sides
alternate inside every repeat, and the order flips from one repeat to the next, so that drifts of the machine hit
every side alike. A run reports the median of its per-step wall times after the warm-up steps, and its peak memory
(RSS on CPU, `torch.cuda.max_memory_allocated` on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from .common import environment, format_table, pin_threads, summarize

SIDES = {
    "trl": "stock trl.GRPOTrainer(loss_type='grpo', beta=0.04, use_bias_correction_kl=False)",
    "ext": "GRPOTrainerExt, all diagnostics on",
    "ext_nodiag": "GRPOTrainerExt, log_diagnostics=False",
}


def _prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))) + "=" for _ in range(count)]


def _reward(completions, prompts, **kwargs) -> list[float]:
    """Share of the prompt's letters found, in reverse order, at the start of the completion (spread in a group)."""
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        target = prompt[:-1][::-1]
        scores.append(sum(a == b for a, b in zip(target, completion, strict=False)) / len(target))
    return scores


def run_worker(side: str, lora: bool, steps: int, warmup: int, model_path: str, batch: int, out: str) -> None:
    """One training run in this process; writes its measurements as JSON to `out`."""
    import psutil
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    cuda = torch.cuda.is_available()
    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.start)

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench-e2e-"),
        per_device_train_batch_size=batch,
        num_generations=8,
        max_completion_length=10,
        learning_rate=1e-3 if lora else 2e-4,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    if side == "trl":
        trainer_class = GRPOTrainer
        args = GRPOConfig(**common, loss_type="grpo", beta=0.04, epsilon=0.2, use_bias_correction_kl=False)
    else:
        trainer_class = GRPOTrainerExt
        args = GRPOConfigExt(**common, log_diagnostics=side == "ext")
    rss_before = psutil.Process().memory_info().rss
    trainer = trainer_class(
        model=model_path,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": _prompts(batch * steps, seed=1)}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None,
        callbacks=[StepTimer()],
    )
    trainer.train()
    measured = step_times[warmup:]
    result = {
        "side": side,
        "lora": lora,
        "step_time_median": summarize(measured)["median"],
        "step_times": measured,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_trainer_bytes": rss_before,
        "final_loss": trainer.state.log_history[-2].get("loss"),
    }
    if cuda:
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    with open(out, "w") as handle:
        json.dump(result, handle)


def _launch(side, lora, steps, warmup, model_path, batch, threads, workdir, index) -> dict:
    out = os.path.join(workdir, f"{index:03d}-{side}-{'lora' if lora else 'full'}.json")
    command = [sys.executable, "-m", "trl_grpo_ext.bench.e2e", "--worker", side, "--out", out]
    command += ["--model", model_path, "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch)]
    command += ["--threads", str(threads)] + (["--lora"] if lora else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"benchmark worker {side} failed:\n{completed.stderr[-3000:]}")
    with open(out) as handle:
        return json.load(handle)


def run(
    repeats: int = 5,
    steps: int = 12,
    warmup: int = 2,
    batch: int = 64,
    threads: int = 1,
    modes: tuple[str, ...] = ("full", "lora"),
    sides: tuple[str, ...] = ("trl", "ext", "ext_nodiag"),
    hidden_size: int = 128,
) -> dict:
    """Run the comparison and return its results (what `--json` writes)."""
    from ..tiny import save_tiny

    pin_threads(threads)
    workdir = tempfile.mkdtemp(prefix="bench-e2e-")
    model_path = save_tiny(os.path.join(workdir, "model"), alphabet="abcdefghij=", hidden_size=hidden_size)
    results: dict = {"environment": environment(), "config": locals().copy(), "modes": {}}
    results["config"].pop("save_tiny", None)
    index = 0
    for mode in modes:
        runs = {side: [] for side in sides}
        for repeat in range(repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                runs[side].append(
                    _launch(side, mode == "lora", steps, warmup, model_path, batch, threads, workdir, index)
                )
                index += 1
        mode_result = {"sides": {}, "ratios": {}}
        for side in sides:
            key = "cuda_max_memory_allocated_bytes" if "cuda_max_memory_allocated_bytes" in runs[side][0] else None
            mode_result["sides"][side] = {
                "step_time_s": summarize([run["step_time_median"] for run in runs[side]]),
                "peak_memory_bytes": summarize([run[key or "peak_rss_bytes"] for run in runs[side]]),
                "memory_kind": "cuda_max_memory_allocated" if key else "peak_rss",
            }
        if "trl" in sides:
            for side in sides:
                if side == "trl":
                    continue
                time_ratios = [
                    ours["step_time_median"] / stock["step_time_median"]
                    for ours, stock in zip(runs[side], runs["trl"], strict=True)
                ]
                memory_key = mode_result["sides"][side]["memory_kind"]
                memory_key = "peak_rss_bytes" if memory_key == "peak_rss" else "cuda_max_memory_allocated_bytes"
                memory_ratios = [
                    ours[memory_key] / stock[memory_key] for ours, stock in zip(runs[side], runs["trl"], strict=True)
                ]
                mode_result["ratios"][side] = {
                    "step_time": summarize(time_ratios),
                    "peak_memory": summarize(memory_ratios),
                }
        results["modes"][mode] = mode_result
    return results


def table(results: dict) -> str:
    rows = []
    for mode, mode_result in results["modes"].items():
        for side, stats in mode_result["sides"].items():
            time_stats, memory = stats["step_time_s"], stats["peak_memory_bytes"]
            ratio = mode_result["ratios"].get(side)
            rows.append(
                [
                    mode,
                    side,
                    f"{time_stats['median'] * 1e3:.1f} [{time_stats['min'] * 1e3:.1f}, {time_stats['max'] * 1e3:.1f}]",
                    f"{ratio['step_time']['median']:.3f} [{ratio['step_time']['min']:.3f}, "
                    f"{ratio['step_time']['max']:.3f}]"
                    if ratio
                    else "1 (baseline)",
                    f"{memory['median'] / 2**20:.0f}",
                    f"{ratio['peak_memory']['median']:.3f} [{ratio['peak_memory']['min']:.3f}, "
                    f"{ratio['peak_memory']['max']:.3f}]"
                    if ratio
                    else "1 (baseline)",
                ]
            )
    memory_kind = next(iter(next(iter(results["modes"].values()))["sides"].values()))["memory_kind"]
    headers = ["mode", "side", "step ms, median [min, max]", "time / trl", f"{memory_kind} MiB", "memory / trl"]
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=sorted(SIDES))
    parser.add_argument("--out")
    parser.add_argument("--model")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.worker:
        pin_threads(args.threads)
        run_worker(args.worker, args.lora, args.steps, args.warmup, args.model, args.batch, args.out)
    else:
        print(table(run(steps=args.steps, warmup=args.warmup, batch=args.batch, threads=args.threads)))


if __name__ == "__main__":
    main()
