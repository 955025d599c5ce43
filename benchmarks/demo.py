"""`python -m benchmarks demo`: the README's main command, measured: the demo recipe as `make demo` runs it.

`make demo` runs `recipes/grpo.py --config recipes/tiny/config_demo.yaml` in the checkout. This suite runs the same
command with the same Python (the set-up excluded: `.venv` exists), into a temporary output folder, and records
what a new user reads off it: the wall time of the run, the trainer's own `train_runtime`, the held-out scores the
recipe prints before and after GRPO, and the alarms the run raised. `python -m benchmarks tables` writes the table
in `docs/recipes.md` from `benchmarks/results/demo.json`; `tests/test_benchmarks_tables.py` checks the demo's
figures quoted in prose (its minutes in the README, the Makefile, the CLI's help and the config; its scores in the
docs) against that file.

`--quick` runs 4 steps on 16 held-out prompts: it checks that the suite runs, and its figures describe nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from .common import CHECKOUT, format_table

#: The command `make demo` runs, relative to the checkout (the Makefile's `demo` target).
DEMO_CONFIG = os.path.join("recipes", "tiny", "config_demo.yaml")
#: The recipe's held-out line: `  exact_match mean@1: 0.200 before GRPO -> 0.782 after`.
HELDOUT_LINE = re.compile(r"^\s+(?P<label>\S+ \S+): (?P<before>[\d.]+) before GRPO -> (?P<after>[\d.]+) after$")
#: Variables `pin_threads` sets for the benchmarks' own processes, which `make demo` does not: the demo sets its own
#: thread count (`num_threads` in its config), and `OMP_NUM_THREADS=1` rounds differently.
_PINNING_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def heldout_scores(stdout: str) -> dict[str, dict[str, float]]:
    """The held-out scores the recipe printed, `{"exact_match mean@1": {"before": 0.2, "after": 0.782}}`."""
    scores = {}
    for line in stdout.splitlines():
        match = HELDOUT_LINE.match(line)
        if match:
            before, after = float(match.group("before")), float(match.group("after"))
            scores[match.group("label")] = {"before": before, "after": after}
    return scores


def _trained(output_dir: str) -> dict:
    """`train_runtime`, the last step and the alarms raised (`alarms/<name>` counts) from the run's trainer state."""
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        history = json.load(handle)["log_history"]
    runtime = next((entry["train_runtime"] for entry in reversed(history) if "train_runtime" in entry), None)
    alarms: dict[str, int] = {}
    for entry in history:
        counts = {key.removeprefix("alarms/"): int(value) for key, value in entry.items() if key.startswith("alarms/")}
        alarms.update(counts)
    return {"train_runtime_s": runtime, "steps": max(entry.get("step", 0) for entry in history), "alarms": alarms}


def run(quick: bool = False) -> dict:
    """One run of the demo recipe; what `--json` writes under `demo`.

    Raises:
        `RuntimeError`: the recipe failed (its last lines of output in the message), or printed no held-out score.
    """
    options = ["--max_steps", "4", "--eval_samples", "16", "--heldout_every_steps", "0"] if quick else []
    env = {key: value for key, value in os.environ.items() if key not in _PINNING_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as output_dir:
        command = [sys.executable, "recipes/grpo.py", "--config", DEMO_CONFIG, "--output_dir", output_dir, *options]
        started = time.perf_counter()
        completed = subprocess.run(command, cwd=CHECKOUT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if completed.returncode != 0:
            raise RuntimeError(f"the demo recipe exited with {completed.returncode}:\n{completed.stderr[-3000:]}")
        scores = heldout_scores(completed.stdout)
        if not scores:
            raise RuntimeError(f"the demo recipe printed no held-out score:\n{completed.stdout[-3000:]}")
        trained = _trained(output_dir)
    return {
        "config": {"config": DEMO_CONFIG, "options": options, "quick": quick},
        "load_average": list(os.getloadavg()),  # at the end of the run
        "wall_s": wall,
        **trained,
        "heldout": scores,
    }


def minutes(seconds: float) -> str:
    """`162.4` as `2 min 42 s`."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s"


def table(results: dict) -> str:
    """The demo's figures, one row each."""
    rows = [
        ("wall time of `make demo` (set-up done)", minutes(results["wall_s"])),
        ("`train_runtime` (training with its held-out evaluations)", f"{results['train_runtime_s']:.0f} s"),
        ("steps", results["steps"]),
    ]
    rows += [
        (f"held-out {label}, before GRPO -> after", f"{score['before']:.3f} -> {score['after']:.3f}")
        for label, score in results["heldout"].items()
    ]
    alarms = ", ".join(f"{name} ({count})" for name, count in results["alarms"].items()) or "none"
    rows.append(("alarms raised", alarms))
    return format_table(("the demo", "measured"), rows)
