"""End-to-end: `GRPOTrainerExt` (diagnostics on, and off) against stock `trl.GRPOTrainer` on identical work.

Each side trains in its own process, on the same locally built model, data and seed, so all sides do the same work
step for step. The processes take turns one training iteration at a time (the step, the logging after it, the
fetching of the next batch), the others waiting on a pipe, the order of the sides flipping from one step to the
next: the machine's speed drifts over seconds, and at this granularity every side meets the same drift. Each
step's time is divided by the same step's time of the stock trainer; the ratios are pooled over steps and repeats
(median, min, max). Peak memory is each process's own high-water mark: RSS on a CPU, both for the whole process
and for what training added to it (peak minus the RSS before the trainer was built); on a GPU,
`torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
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
        from trl_grpo_ext.diagnostics import DiagnosticsAccumulator

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


def train_once(
    side: str,
    lora: bool,
    steps: int,
    warmup: int,
    model_path: str,
    batch: int,
    callbacks=(),
    tokenizer_path: str | None = None,
    config_overrides: dict | None = None,
) -> dict:
    """One training run of `side`; returns the median step time after warm-up and the diagnostics' host time.

    `tokenizer_path` defaults to `model_path`; `config_overrides` replace the common training arguments (e.g.
    `bf16`, `max_completion_length` on a GPU)."""
    import psutil
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    cuda = torch.cuda.is_available()
    step_times: list[float] = []
    clock = _DiagnosticsClock()
    rss_before = psutil.Process().memory_info().rss

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
    common.update(config_overrides or {})
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
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path or model_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None,
        callbacks=[StepTimer(), *callbacks],
    )
    try:
        trainer.train()
    finally:  # nothing is saved there (`save_strategy="no"`), but the folder itself would be left behind
        shutil.rmtree(common["output_dir"], ignore_errors=True)
    return {
        "step_time_median": summarize(step_times[warmup:])["median"],
        "diagnostics_s_per_step": clock.seconds / max(len(step_times), 1),
        "rss_before_trainer_bytes": rss_before,
        "final_loss": next(entry["loss"] for entry in reversed(trainer.state.log_history) if "loss" in entry),
    }


def _side_worker(side, lora, steps, model_path, batch, threads, connection, options=None) -> None:
    """Train `side` in this process, one step per "go" received, sending back each step's time, then its memory."""
    import torch
    from transformers import TrainerCallback

    pin_threads(threads)

    class Gate(TrainerCallback):
        """Holds each iteration until its turn; times it from its start to the start of the next one (the step,
        the logging after it and the fetching of the next batch), while every other process waits."""

        start = None

        def report(self):
            if self.start is None:
                connection.send("ready")
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            connection.send(time.perf_counter() - self.start)

        def on_step_begin(self, args, state, control, **kwargs):
            self.report()
            connection.recv()  # this side's turn
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.report()

    result = train_once(side, lora, steps, 0, model_path, batch, callbacks=[Gate()], **(options or {}))
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["training_rss_bytes"] = result["peak_rss_bytes"] - result["rss_before_trainer_bytes"]
    if torch.cuda.is_available():
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    connection.send(result)


def _interleaved_repeat(sides, lora, steps, model_path, batch, threads, options=None) -> dict:
    """One repeat: a process per side, taking turns a step at a time. Returns, per side, step times and results.

    `options`: keyword arguments of `train_once` (`tokenizer_path`, `config_overrides`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    pipes, processes = {}, {}
    for side in sides:
        parent, child = context.Pipe()
        process = context.Process(
            target=_side_worker, args=(side, lora, steps, model_path, batch, threads, child, options)
        )
        process.start()
        pipes[side], processes[side] = parent, process
    times = {side: [] for side in sides}
    finished = False
    try:
        for side in sides:  # every process built its trainer and waits before its first step
            assert pipes[side].recv() == "ready"
        for step in range(steps):
            for side in sides if step % 2 == 0 else sides[::-1]:
                pipes[side].send("go")
                times[side].append(pipes[side].recv())
        results = {side: pipes[side].recv() for side in sides}
        finished = True
    finally:
        for process in processes.values():
            # Interrupted (an error, a time limit): the others wait for a turn that will not come.
            process.join(timeout=120 if finished else 1)
            if process.is_alive():
                process.kill()
    for side, process in processes.items():
        if process.exitcode != 0:
            raise RuntimeError(f"the benchmark process of {side} failed (exit code {process.exitcode})")
    return {side: {"step_times": times[side], **results[side]} for side in sides}


def run(
    repeats: int = 5,
    steps: int = 16,
    warmup: int = 2,
    batch: int = 64,
    threads: int = 1,
    modes: tuple[str, ...] = ("full", "lora"),
    sides: tuple[str, ...] = ("trl", "ext", "ext_nodiag"),
    hidden_size: int = 128,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
    config_overrides: dict | None = None,
) -> dict:
    """Run the comparison and return its results (what `--json` writes).

    By default every side trains the demo-sized model (`hidden_size`) on the CPU or GPU found; `model_path` (with
    `tokenizer_path` when the tokenizer is saved elsewhere) trains a given local model instead, and
    `config_overrides` replace training arguments of every side (e.g. `bf16=True`)."""
    import torch

    from trl_grpo_ext.testing import save_tiny

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as workdir:  # the model built, when none is given
        config = dict(repeats=repeats, steps=steps, warmup=warmup, batch=batch, threads=threads)
        if model_path is None:
            model_path = save_tiny(os.path.join(workdir, "model"), alphabet="abcdefghij=", hidden_size=hidden_size)
            config["hidden_size"] = hidden_size
        else:
            config["model_path"] = model_path
        if config_overrides:
            config["config_overrides"] = dict(config_overrides)
        options = {"tokenizer_path": tokenizer_path, "config_overrides": config_overrides}
        results: dict = {"config": config, "modes": {}}
        memory_key = "cuda_max_memory_allocated_bytes" if torch.cuda.is_available() else "peak_rss_bytes"
        for mode in modes:
            runs = [
                _interleaved_repeat(sides, mode == "lora", steps, model_path, batch, threads, options)
                for _ in range(repeats)
            ]

            def measured(repeat, side):
                return repeat[side]["step_times"][warmup:]

            mode_result = {"sides": {}, "ratios": {}}
            for side in sides:
                mode_result["sides"][side] = {
                    "step_time_s": summarize([t for repeat in runs for t in measured(repeat, side)]),
                    "peak_memory_bytes": summarize([repeat[side][memory_key] for repeat in runs]),
                    "training_rss_bytes": summarize([repeat[side]["training_rss_bytes"] for repeat in runs]),
                    "memory_kind": memory_key.replace("_bytes", ""),
                }
            if "ext" in sides:
                mode_result["diagnostics_s_per_step"] = summarize(
                    [repeat["ext"]["diagnostics_s_per_step"] for repeat in runs]
                )
            for side, baseline in (("ext", "trl"), ("ext_nodiag", "trl"), ("ext", "ext_nodiag")):
                if side not in sides or baseline not in sides:
                    continue
                pairs = []
                for repeat in runs:
                    pairs += zip(measured(repeat, side), measured(repeat, baseline), strict=True)
                mode_result["ratios"][f"{side}/{baseline}"] = {
                    "step_time": summarize([ours / base for ours, base in pairs]),
                    "total_time": sum(ours for ours, _ in pairs) / sum(base for _, base in pairs),
                    "peak_memory": summarize(
                        [repeat[side][memory_key] / repeat[baseline][memory_key] for repeat in runs]
                    ),
                    "training_rss": summarize(
                        [
                            repeat[side]["training_rss_bytes"] / repeat[baseline]["training_rss_bytes"]
                            for repeat in runs
                        ]
                    ),
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
                    f"{ratio['total_time']:.3f}" if ratio else "1",
                    f"{stats['peak_memory_bytes']['median'] / 2**20:.0f}",
                    _span(ratio["peak_memory"]) if ratio else "1 (baseline)",
                    f"{stats['training_rss_bytes']['median'] / 2**20:.1f}",
                    _span(ratio["training_rss"]) if ratio else "1 (baseline)",
                ]
            )
    memory_kind = next(iter(next(iter(results["modes"].values()))["sides"].values()))["memory_kind"]
    headers = ["mode", "side", "step ms, median [min, max]", "step time / trl, per step", "total time / trl",
               f"{memory_kind} MiB", "memory / trl", "training RSS MiB", "training RSS / trl"]  # fmt: skip
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
                note += f" (total time {on_off['total_time']:.3f})"
            notes.append(note)
    return format_table(headers, rows) + ("\n" + "\n".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(table(run(steps=args.steps, batch=args.batch, threads=args.threads)))


if __name__ == "__main__":
    main()
