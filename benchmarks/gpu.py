"""`python -m benchmarks gpu [--out DIR] [--budget-s S] [--sections a,b] [--quick]`: the package on a GPU.

One unattended command that checks, in a few minutes on one GPU, what only a GPU can show, and writes
`DIR/gpu.json` (every figure, and the full traceback of any section that failed) and `DIR/gpu.md` (a summary)
after every section, so that a run cut short still leaves the sections it finished:

1. `environment`: versions (and where each package was imported from), the GPU, its memory.
2. `equivalence`: `GRPOTrainerExt` against stock `trl.GRPOTrainer` with the same objective, on a randomly
   initialised model with Qwen2.5-0.5B's configuration, bf16: 8 steps, num_iterations=2, full and LoRA; per-step
   loss, grad_norm and kl within a stated tolerance.
3. `syncs`: host synchronisations per micro-batch and per log step, trl_grpo_ext's and TRL's, counted with
   `torch.cuda.set_sync_debug_mode("warn")`.
4. `kernels`: `grpo_loss(implementation="compiled")` (Triton through `torch.compile`) against `"reference"` at
   several epsilons, then every implementation's forward + backward time at 64x4096 and 256x8192 in float32 and
   bf16 against seed 000's code and TRL's inline loss, with CUDA events, as a share of the copy-bandwidth roofline.
5. `nonfinite`: a NaN loss at one step: the update is skipped and counted, the weights stay finite.
6. `e2e`: step time and `torch.cuda.max_memory_allocated`, `GRPOTrainerExt` against stock TRL, full and LoRA,
   interleaved step by step (targets: ratios <= 1.00).
7. `forward`: TRL's padded log-prob forward against the padding-free one on long-tailed completions, with sdpa and
   (where `flash_attn` is installed) flash-attention 2: step time, activation and peak memory (targets: 0.5x time,
   0.6x memory).

Each section plans with a share of the time left (`--budget-s`, counted from the start of the process), shrinks or
skips its later parts when that runs short (saying so), and is interrupted at the end of the budget. A section
that raises is recorded with its traceback and the next one runs. Exit status: 1 if a section raised or one of its
checks failed (performance targets are reported, not enforced), else 0.

Without a CUDA device (or with `--quick`) every section runs at tiny sizes in a minute or two, and what only a GPU
can measure is skipped with its reason. On a GPU machine without trl or datasets and without network access, see
`make gpu-wheels` and the README's Performance section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone

from .common import pin_threads
from .gpu_setup import SectionTimeout

__all__ = ["DEFAULT_SECTIONS", "SECTION_NAMES", "main", "render_summary", "run"]

GRACE_S = 15.0  # how far past its budget the last section may run before it is interrupted


def _sections() -> dict:
    """name -> (function, share of the time left that it plans with, fewest seconds worth starting it: (GPU, CPU))."""
    from . import gpu_forward, gpu_kernels, gpu_sections

    return {
        "environment": (gpu_sections.section_environment, 0.02, (5, 5)),
        "equivalence": (gpu_sections.section_equivalence, 0.28, (60, 20)),
        "syncs": (gpu_sections.section_syncs, 0.10, (25, 10)),
        "kernels": (gpu_kernels.section_kernels, 0.20, (40, 10)),
        "nonfinite": (gpu_sections.section_nonfinite, 0.07, (15, 5)),
        "e2e": (gpu_sections.section_e2e, 0.33, (60, 20)),
        "forward": (gpu_forward.section_forward, 0.12, (30, 10)),
        "sharded": (gpu_sections.section_sharded, 1.0, (60, 60)),
    }


DEFAULT_SECTIONS = ("environment", "equivalence", "syncs", "kernels", "nonfinite", "e2e", "forward")
#: Every section, in running order; `sharded` (FSDP2, and ZeRO where deepspeed is installed) only when asked for.
SECTION_NAMES = (*DEFAULT_SECTIONS, "sharded")


def _process_start() -> float:
    """Wall-clock time at which this process started (the budget counts from there, imports included)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil, or no /proc: count from now
        return time.time()


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise `SectionTimeout` in the main thread after `seconds` (no-op where SIGALRM does not exist)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def interrupt(signum, frame):
        raise SectionTimeout(f"interrupted: the time budget ran out ({seconds:.0f} s after the section started)")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _jsonable(value):
    """Floats JSON cannot hold (NaN, inf) as strings; everything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


def run(
    out_dir: str,
    sections: tuple[str, ...] | None = None,
    budget_s: float = 420.0,
    quick: bool = False,
    layers: int | None = None,
    command: str = "",
    started: float | None = None,
    grace_s: float = GRACE_S,
) -> dict:
    """Run the sections, writing `out_dir/gpu.json` and `out_dir/gpu.md` after each; return the results.

    Args:
        out_dir (`str`): output folder (created).
        sections (`tuple[str, ...]`, *optional*): a subset of `SECTION_NAMES`, run in that order.
        budget_s (`float`): seconds for the whole run, counted from the start of the process.
        quick (`bool`): tiny sizes even on a GPU (always, without one).
        layers (`int`, *optional*): fewer layers than Qwen2.5-0.5B's 24 (reported in the summary).
        command (`str`): the command line, for the report.
        started (`float`, *optional*): `time.time()` from which the budget counts (default: the process's start).
        grace_s (`float`): how long past the budget a section may run before it is interrupted.

    Returns:
        `dict`: what `gpu.json` holds: per section its `status` (`passed`, `checks_failed`, `error`, `skipped`),
        `seconds`, and its `result`, `reason` or `error` and `traceback`.
    """
    import torch

    from . import gpu_setup

    started = _process_start() if started is None else started
    selected = tuple(sections or DEFAULT_SECTIONS)
    unknown = [name for name in selected if name not in SECTION_NAMES]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {list(SECTION_NAMES)}.")
    selected = tuple(name for name in SECTION_NAMES if name in selected)
    registry = _sections()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes = gpu_setup.QUICK if quick or not cuda else gpu_setup.GPU
    if not cuda:
        pin_threads(1)  # small CPU ops ran several times faster on one thread (FACTS)
    os.makedirs(out_dir, exist_ok=True)

    def remaining() -> float:
        return budget_s - (time.time() - started)

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.1f} s] {message}", flush=True)

    ctx = gpu_setup.Context(
        device=device,
        sizes=sizes,
        workdir=tempfile.mkdtemp(prefix="bench-gpu-"),
        log=log,
        remaining=remaining,
        layers=layers,
    )
    results = {
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)",
        "sizes": sizes.label + (f"; {layers} layers instead of {sizes.model['num_hidden_layers']}" if layers else ""),
        "budget_s": budget_s,
        "sections": {name: {"status": "pending"} for name in selected},
    }

    def save() -> None:
        results["elapsed_s"] = time.time() - started
        try:
            with open(os.path.join(out_dir, "gpu.json"), "w") as handle:
                json.dump(_jsonable(results), handle, indent=2, default=str)
            with open(os.path.join(out_dir, "gpu.md"), "w") as handle:
                handle.write(render_summary(results))
        except Exception:  # noqa: BLE001 - a reporting bug must not stop the remaining sections
            log(f"could not write the results:\n{traceback.format_exc()}")

    ctx.save = save
    save()
    log(f"GPU check on {results['device']}, sizes: {results['sizes']}, budget {budget_s:.0f} s")
    for index, name in enumerate(selected):
        function, share, fewest = registry[name]
        fewest_s = fewest[0] if cuda and not quick else fewest[1]
        left = remaining()
        later_shares = sum(registry[later][1] for later in selected[index:])
        allotted = max(fewest_s, left * share / later_shares)
        entry = {"status": "running", "allotted_s": round(allotted, 1)}
        results["sections"][name] = entry
        if left < fewest_s:
            entry.update(status="skipped", reason=f"time budget: {left:.0f} s left, the section needs ~{fewest_s} s")
            log(f"{name}: skipped ({entry['reason']})")
            save()
            continue
        log(f"{name}: start ({allotted:.0f} s planned, {left:.0f} s left)")
        begin = time.time()
        # The section fills `result` as it goes: what it finished is kept if it raises or runs out of time.
        result = entry["result"] = {}
        try:
            with _deadline(left + grace_s):
                function(ctx, allotted, result)
            failed = sorted(check for check, ok in result.get("checks", {}).items() if not ok)
            entry["status"] = "checks_failed" if failed else "passed"
            if failed:
                entry["failed_checks"] = failed
        except (Exception, SectionTimeout) as error:  # noqa: BLE001 - recorded; the next section still runs
            entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        finally:
            entry["seconds"] = round(time.time() - begin, 1)
            gpu_setup.free_memory()
            save()
        log(
            f"{name}: {entry['status']} in {entry['seconds']:.0f} s"
            + (f" ({entry['error']})" if "error" in entry else "")
        )
    return results


def render_summary(results: dict) -> str:
    """The markdown summary of a (possibly partial) results dict."""
    from . import gpu_summary

    return gpu_summary.render(results)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-gpu", help="output folder for gpu.json and gpu.md")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run (default 420)")
    parser.add_argument("--sections", default=None, help="comma-separated subset, e.g. equivalence,kernels")
    parser.add_argument("--quick", action="store_true", help="tiny sizes even on a GPU")
    parser.add_argument("--layers", type=int, default=None, help="fewer model layers than 24")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sections = tuple(args.sections.split(",")) if args.sections else None
    unknown = [name for name in sections or () if name not in SECTION_NAMES]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTION_NAMES)}")
    results = run(
        args.out,
        sections=sections,
        budget_s=args.budget_s,
        quick=args.quick,
        layers=args.layers,
        command=" ".join(["python -m benchmarks gpu", *argv]),
    )
    statuses = {name: entry["status"] for name, entry in results["sections"].items()}
    print(json.dumps(statuses), flush=True)
    print(f"Results written to {os.path.join(args.out, 'gpu.json')} and gpu.md", flush=True)
    return 1 if any(status in ("error", "checks_failed") for status in statuses.values()) else 0
