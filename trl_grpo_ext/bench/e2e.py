"""End-to-end: `GRPOTrainerExt` (diagnostics on, and off) against stock `trl.GRPOTrainer` on identical work.

Every run builds a fresh trainer on the same locally built model, data and seed, so all sides do the same work step
for step. Step times are measured in this process: the sides alternate inside every repeat, and the order flips
from one repeat to the next, so that drifts of the machine hit every side alike; a run reports the median of its
per-step wall times after the warm-up steps. Peak memory (RSS on CPU, `torch.cuda.max_memory_allocated` on GPU) is
a process-wide high-water mark, so it is measured in a fresh process per run.
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

from .common import format_table, pin_threads, summarize

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


class _DiagnosticsClock:
    """Host time spent in the diagnostics (accumulating per micro-batch, summarising per log step)."""

    def __init__(self):
        from ..diagnostics import DiagnosticsAccumulator

        self.seconds = 0.0
        for name in ("add_loss_step", "add_rewards", "summarize"):
            original = getattr(DiagnosticsAccumulator, name)
            if getattr(original, "_clocked", False):
                continue

            def timed(accumulator, *args, _original=original, **kwargs):
                begin = time.perf_counter()
                try:
                    return _original(accumulator, *args, **kwargs)
                finally:
                    _DiagnosticsClock.current.seconds += time.perf_counter() - begin

            timed._clocked = True
            setattr(DiagnosticsAccumulator, name, timed)
        _DiagnosticsClock.current = self


def train_once(side: str, lora: bool, steps: int, warmup: int, model_path: str, batch: int) -> dict:
    """One training run of `side`; returns the median step time after warm-up and the diagnostics' host time."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    cuda = torch.cuda.is_available()
    step_times: list[float] = []
    clock = _DiagnosticsClock()

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
    return {
        "step_time_median": summarize(step_times[warmup:])["median"],
        "diagnostics_s_per_step": clock.seconds / max(len(step_times), 1),
        "final_loss": next(entry["loss"] for entry in reversed(trainer.state.log_history) if "loss" in entry),
    }


def run_memory_worker(side: str, lora: bool, steps: int, model_path: str, batch: int, out: str) -> None:
    """One training run in this (fresh) process; writes its peak memory as JSON to `out`."""
    import torch

    train_once(side, lora, steps, 0, model_path, batch)
    result = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    with open(out, "w") as handle:
        json.dump(result, handle)


def _peak_memory(side, lora, steps, model_path, batch, threads, workdir, index) -> dict:
    out = os.path.join(workdir, f"memory-{index:03d}-{side}-{'lora' if lora else 'full'}.json")
    command = [sys.executable, "-m", "trl_grpo_ext.bench.e2e", "--memory-worker", side, "--out", out]
    command += ["--model", model_path, "--steps", str(steps), "--batch", str(batch)] + (["--lora"] if lora else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"memory worker {side} failed:\n{completed.stderr[-3000:]}")
    with open(out) as handle:
        return json.load(handle)


def run(
    repeats: int = 10,
    memory_repeats: int = 2,
    steps: int = 14,
    warmup: int = 2,
    batch: int = 64,
    threads: int = 1,
    modes: tuple[str, ...] = ("full", "lora"),
    sides: tuple[str, ...] = ("trl", "ext", "ext_nodiag"),
    hidden_size: int = 128,
) -> dict:
    """Run the comparison and return its results (what `--json` writes)."""
    import torch

    from ..tiny import save_tiny

    pin_threads(threads)
    workdir = tempfile.mkdtemp(prefix="bench-e2e-")
    model_path = save_tiny(os.path.join(workdir, "model"), alphabet="abcdefghij=", hidden_size=hidden_size)
    config = dict(repeats=repeats, memory_repeats=memory_repeats, steps=steps, warmup=warmup, batch=batch,
                  threads=threads, hidden_size=hidden_size)  # fmt: skip
    results: dict = {"config": config, "modes": {}}
    memory_key = "cuda_max_memory_allocated_bytes" if torch.cuda.is_available() else "peak_rss_bytes"
    index = 0
    for mode in modes:
        lora = mode == "lora"
        runs = {side: [] for side in sides}
        train_once(sides[0], lora, steps, warmup, model_path, batch)  # warm this process up, untimed
        for repeat in range(repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                runs[side].append(train_once(side, lora, steps, warmup, model_path, batch))
        memory = {side: [] for side in sides}
        for repeat in range(memory_repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                memory[side].append(_peak_memory(side, lora, steps, model_path, batch, threads, workdir, index))
                index += 1
        mode_result = {"sides": {}, "ratios": {}}
        for side in sides:
            mode_result["sides"][side] = {
                "step_time_s": summarize([run["step_time_median"] for run in runs[side]]),
                "peak_memory_bytes": summarize([entry[memory_key] for entry in memory[side]]),
                "memory_kind": memory_key.replace("_bytes", ""),
            }
        if "ext" in sides:
            mode_result["diagnostics_s_per_step"] = summarize([run["diagnostics_s_per_step"] for run in runs["ext"]])
        for side, baseline in (("ext", "trl"), ("ext_nodiag", "trl"), ("ext", "ext_nodiag")):
            if side in sides and baseline in sides:
                times = [ours["step_time_median"] / base["step_time_median"]
                         for ours, base in zip(runs[side], runs[baseline], strict=True)]  # fmt: skip
                memories = [ours[memory_key] / base[memory_key]
                            for ours, base in zip(memory[side], memory[baseline], strict=True)]  # fmt: skip
                mode_result["ratios"][f"{side}/{baseline}"] = {
                    "step_time": summarize(times),
                    "peak_memory": summarize(memories),
                }
        results["modes"][mode] = mode_result
    return results


def _span(stats: dict, scale: float = 1.0, digits: int = 3) -> str:
    return (f"{stats['median'] * scale:.{digits}f} [{stats['min'] * scale:.{digits}f}, "
            f"{stats['max'] * scale:.{digits}f}]")  # fmt: skip


def table(results: dict) -> str:
    rows = []
    for mode, mode_result in results["modes"].items():
        for side, stats in mode_result["sides"].items():
            ratio = mode_result["ratios"].get(f"{side}/trl")
            rows.append(
                [
                    mode,
                    side,
                    _span(stats["step_time_s"], 1e3, 1),
                    _span(ratio["step_time"]) if ratio else "1 (baseline)",
                    f"{stats['peak_memory_bytes']['median'] / 2**20:.0f}",
                    _span(ratio["peak_memory"]) if ratio else "1 (baseline)",
                ]
            )
    memory_kind = next(iter(next(iter(results["modes"].values()))["sides"].values()))["memory_kind"]
    headers = ["mode", "side", "step ms, median [min, max]", "time / trl", f"{memory_kind} MiB", "memory / trl"]
    notes = []
    for mode, mode_result in results["modes"].items():
        if "diagnostics_s_per_step" in mode_result:
            note = (
                f"{mode}: the diagnostics take {_span(mode_result['diagnostics_s_per_step'], 1e3, 2)} ms of host time"
            )
            note += " per step"
            on_off = mode_result["ratios"].get("ext/ext_nodiag")
            if on_off:
                note += f"; step time with / without them {_span(on_off['step_time'])}"
            notes.append(note)
    return format_table(headers, rows) + ("\n" + "\n".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory-worker", choices=sorted(SIDES))
    parser.add_argument("--out")
    parser.add_argument("--model")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    if args.memory_worker:
        run_memory_worker(args.memory_worker, args.lora, args.steps, args.model, args.batch, args.out)
    else:
        print(table(run(steps=args.steps, batch=args.batch, threads=args.threads)))


if __name__ == "__main__":
    main()
