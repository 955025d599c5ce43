"""`python -m benchmarks gpu [--out DIR] [--budget-s S] [--sections a,b] [--quick]`: the package on a GPU.

One unattended command, sized for one run of about 8 minutes on one H100, that measures first what decides
everything else. It writes `DIR/gpu.json` (every figure, and the full traceback of any section that failed) and
`DIR/gpu.md` (a summary) after every section, so that a run cut short still leaves the sections it finished. The
default sections, in order (`gpu_packing`, `gpu_attention`, `gpu_costs`; the forward's sections on a randomly
initialised Qwen2.5-1.5B-shaped model):

1. `environment`: versions (and where each package was imported from), the GPU, its memory, the flash kernels.
2. `engagement`: does the packed forward engage in the README's default setup (float32 weights loaded by name,
   `GRPOConfigExt`'s bf16 autocast) and with bf16 weights: one training step each, the self-check's figures, any
   fallback (a fallback fails the run).
3. `exactness`: max and p99.9 |packed - padded| log-prob on a batch packed into several rows, packed and with shared
   prompts, sdpa and flash-attention 2, against the padded forward's own noise under other left padding (a side
   outside the self-check's tolerance fails the run).
4. `attention`: which attention kernel each side runs (profiler), masked sdpa against a matrix product of its FLOPs
   at 2K and 8K tokens, and whether a dense-mask row may be longer than TRL's padded width.
5. `memory`: peak memory of each side's step, gradient checkpointing on and off; the step-1 self-check alone.
6. `speed`: forward + backward time of TRL's padded forward (sdpa, flash-attention 2), packed and shared, at 2 x 8
   completions of log-normal length up to 8,192.
7. `host`: host time before each forward's first kernel, the device's idle gap, the package's host syncs per chunk.
8. `truncation`: `match_sampler_truncation`'s cost against one forward at a 152K vocabulary.
9. `equivalence`, 10. `nonfinite` (`gpu_sections`), when time is left: `GRPOTrainerExt` against stock TRL in bf16
   on Qwen2.5-0.5B's configuration; a NaN loss skipped (and fp16's gradient scaler).

Only with `--sections`: `syncs` (host syncs of whole training steps), `kernels` (the loss kernels, `gpu_kernels`),
`e2e` (training step time against stock TRL), `forward` (`benchmarks/forward.py`'s micro-batch on a small model),
`sharded` (FSDP2, and ZeRO where deepspeed is installed).

Each section plans with a share of the time left (`--budget-s`, counted from the start of the process), shrinks or
skips its later parts when that runs short (saying so), and is interrupted at the end of the budget (`interrupted`:
what it finished is kept). A section that raises is recorded with its traceback and the next one runs. Exit status:
1 if a section raised or one of its checks failed (a wrong result: a fallback, a difference beyond tolerance),
else 0; performance targets are reported, not enforced, and a section skipped or interrupted for time does not fail.

Without a CUDA device (or with `--quick`) every section runs at tiny sizes in a minute or two, and what only a GPU
can measure is skipped with its reason; on a CPU, flash-attention's rows run transformers' flash path with exact
stand-ins (`benchmarks/emulation.py`). On a GPU machine without trl or datasets and without network access, see
`make gpu-wheels` and docs/performance.md ("On a GPU").
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

__all__ = ["DEFAULT_SECTIONS", "SECTION_NAMES", "exit_status", "main", "render_summary", "run"]

GRACE_S = 15.0  # how far past its budget the last section may run before it is interrupted


def _sections() -> dict:
    """name -> (function, share of the time left that it plans with, fewest seconds worth starting it: (GPU, CPU))."""
    from . import gpu_attention, gpu_costs, gpu_forward, gpu_kernels, gpu_packing, gpu_sections

    return {
        "environment": (gpu_sections.section_environment, 0.02, (5, 5)),
        "engagement": (gpu_packing.section_engagement, 0.12, (45, 5)),
        "exactness": (gpu_packing.section_exactness, 0.06, (15, 3)),
        "attention": (gpu_attention.section_attention, 0.06, (15, 3)),
        "memory": (gpu_costs.section_memory, 0.14, (30, 3)),
        "speed": (gpu_costs.section_speed, 0.22, (40, 3)),
        "host": (gpu_costs.section_host, 0.05, (10, 2)),
        "truncation": (gpu_costs.section_truncation, 0.04, (10, 2)),
        "equivalence": (gpu_sections.section_equivalence, 0.22, (60, 20)),
        "nonfinite": (gpu_sections.section_nonfinite, 0.07, (15, 5)),
        "syncs": (gpu_sections.section_syncs, 0.10, (25, 10)),
        "kernels": (gpu_kernels.section_kernels, 0.20, (40, 10)),
        "e2e": (gpu_sections.section_e2e, 0.33, (60, 20)),
        "forward": (gpu_forward.section_forward, 0.12, (30, 10)),
        "sharded": (gpu_sections.section_sharded, 1.0, (60, 60)),
    }


DEFAULT_SECTIONS = (
    "environment",
    "engagement",
    "exactness",
    "attention",
    "memory",
    "speed",
    "host",
    "truncation",
    "equivalence",
    "nonfinite",
)
#: Every section, in running order; those after `nonfinite` only when asked for.
SECTION_NAMES = (*DEFAULT_SECTIONS, "syncs", "kernels", "e2e", "forward", "sharded")
#: The sections that share the log-prob forward's trainer (`gpu_packing.bench`); it is let go after the last of them.
FORWARD_SECTIONS = ("exactness", "attention", "memory", "speed", "host", "truncation")
#: Statuses that make the exit status 1.
FAILING = ("error", "checks_failed")


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
        layers (`int`, *optional*): fewer layers than the models' (reported in the summary).
        command (`str`): the command line, for the report.
        started (`float`, *optional*): `time.time()` from which the budget counts (default: the process's start).
        grace_s (`float`): how long past the budget a section may run before it is interrupted.

    Returns:
        `dict`: what `gpu.json` holds: per section its `status` (`passed`, `checks_failed`, `error`, `interrupted`,
        `skipped`), `seconds`, and its `result`, `reason` or `error` and `traceback`.
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
        "sizes": sizes.label + (f"; {layers} layers in each model" if layers else ""),
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
        if name not in FORWARD_SECTIONS and "bench" in ctx.state:  # the forward's trainer is not needed any more
            del ctx.state["bench"]
            gpu_setup.free_memory()
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
            entry["status"] = "passed"
        except SectionTimeout as error:  # out of time, not a wrong result: what it finished is kept
            entry.update(status="interrupted", reason=str(error))
        except Exception as error:  # noqa: BLE001 - recorded; the next section still runs
            entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        finally:
            entry["seconds"] = round(time.time() - begin, 1)
            gpu_setup.free_memory()
        # A check that failed before a section raised or ran out of time is still a wrong result.
        failed = sorted(check for check, ok in result.get("checks", {}).items() if not ok)
        if failed:
            entry["failed_checks"] = failed
            if entry["status"] != "error":
                entry["status"] = "checks_failed"
        save()
        log(
            f"{name}: {entry['status']} in {entry['seconds']:.0f} s"
            + (f" ({entry.get('error') or entry.get('reason')})" if "error" in entry or "reason" in entry else "")
        )
    return results


def exit_status(results: dict) -> int:
    """1 where a section raised or a check failed (a wrong result), else 0: performance targets, and sections skipped
    or interrupted for time, do not fail a run."""
    return 1 if any(entry["status"] in FAILING for entry in results["sections"].values()) else 0


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
    parser.add_argument("--layers", type=int, default=None, help="fewer layers in each model (a faster try)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The memory section runs sides out of memory on purpose: segments that grow keep the next ones from failing on
    # a fragmented cache (read when CUDA first allocates, after this).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
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
    failed = {
        name: entry.get("failed_checks") or entry.get("error")
        for name, entry in results["sections"].items()
        if entry["status"] in FAILING
    }
    if failed:
        print(f"Wrong results or errors: {json.dumps(failed)}", flush=True)
    print(f"Results written to {os.path.join(args.out, 'gpu.json')} and gpu.md", flush=True)
    return exit_status(results)
