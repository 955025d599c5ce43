"""Shared pieces of the benchmarks: interleaved repeats, robust summaries, tables, JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from types import ModuleType

import torch

__all__ = ["environment", "summarize", "format_table", "write_json", "pin_threads", "child_env", "cpu_engines"]

#: The folder that holds `benchmarks/`: the root of the checkout these benchmarks run from.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pin_threads(threads: int) -> None:
    """Pin intra-op (and inter-op, when still allowed) CPU threads, and the env of child processes."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or parallel work has started
        pass
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)


def child_env(**variables: str) -> dict[str, str]:
    """The environment for a Python process that runs `-m benchmarks.<module>`: this one's, with `variables` set and
    `CHECKOUT` at the end of `PYTHONPATH`, so that the module is found whatever the working folder (`benchmarks` is
    not installed; `python -m benchmarks` finds it in the working folder)."""
    path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if CHECKOUT not in path:
        path.append(CHECKOUT)
    return dict(os.environ, **variables, PYTHONPATH=os.pathsep.join(path))


def cpu_engines() -> ModuleType:
    """The CPU engine shims of the tests (`tests/cpu_engines.py`: sharded engines and vLLM's engine on CPU processes,
    not in the wheel), loaded from this checkout, as `cpu_engines` (the name the tests import it by)."""
    if "cpu_engines" not in sys.modules:
        spec = importlib.util.spec_from_file_location("cpu_engines", os.path.join(CHECKOUT, "tests", "cpu_engines.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["cpu_engines"] = module
        spec.loader.exec_module(module)
    return sys.modules["cpu_engines"]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a sample (`n` too)."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def git_commit(checkout: str = CHECKOUT) -> str | None:
    """The checkout's commit, abbreviated, with `+changes` where tracked files differ from it; `None` outside git."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, timeout=30)

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if commit.returncode != 0:
            return None
        changed = git("diff", "--quiet", "HEAD", "--").returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+changes" if changed else "")


def environment() -> dict:
    """What the figures were measured on, and the commit of the code that measured them."""
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # The instruction set torch's CPU kernels were chosen for: another one rounds differently, and a run that
        # gives the same result every time on one machine may end elsewhere on another.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        import trl

        info["trl"], info["transformers"] = trl.__version__, transformers.__version__
    except ImportError:
        pass
    return info


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable in a terminal)."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(str(header)), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
