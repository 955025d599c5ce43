"""`trl-grpo-ext report RUN_DIR`: the training report and health summary of a GRPO run, from its trainer state.

Reads `trainer_state.json` from the run folder or its last `checkpoint-<step>` folder (whichever is further on),
of any `Trainer`-based GRPO run: `GRPOTrainerExt`'s, or stock `trl.GRPOTrainer`'s (then with the panels and
verdicts its metrics allow, saying what is missing). Rewrites `report.png`, prints one line per signal of the
"What to watch" table with its verdict and the steps concerned, then the alarms raised with what to change. Exit
status 0 when the run could be read, 1 with a one-line reason when not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["RunNotReadable", "find_trainer_state", "load_trainer_state", "run"]

STATE_NAME = "trainer_state.json"
DESCRIPTION = (
    "The training report of a GRPO run (GRPOTrainerExt or stock trl.GRPOTrainer) from its trainer_state.json: "
    "rewrites report.png and prints a health summary, one line per signal, with the steps concerned."
)


class RunNotReadable(Exception):
    """The folder holds no readable trainer state; the message is the one-line reason."""


def load_trainer_state(path: str) -> dict:
    """The JSON of a `trainer_state.json`, checked to hold a `log_history` list.

    Raises:
        RunNotReadable: the file cannot be read, is not JSON, or has no `log_history` list.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunNotReadable(f"{path} cannot be read as a trainer state: {error}") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise RunNotReadable(f"{path} has no log_history list: not a transformers Trainer state")
    return state


def find_trainer_state(run_dir: str) -> tuple[str, dict]:
    """The path and contents of the trainer state of the run in `run_dir`: its own `trainer_state.json` or its last
    checkpoint's, whichever has the higher `global_step` (a run saves its state at each checkpoint and, through
    `Trainer.save_state`, at the end).

    Raises:
        RunNotReadable: `run_dir` is not a folder, holds no trainer state, or the newest one cannot be read.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if not os.path.isdir(run_dir):
        raise RunNotReadable(f"{run_dir} is not a folder")
    candidates = [os.path.join(run_dir, STATE_NAME)]
    last = get_last_checkpoint(run_dir)
    if last is not None:
        candidates.append(os.path.join(last, STATE_NAME))
    found = [path for path in candidates if os.path.isfile(path)]
    if not found:
        raise RunNotReadable(
            f"{run_dir} holds no {STATE_NAME}, neither itself nor in a checkpoint-<step> folder: not the output "
            "folder of a Trainer run (or one that never saved; set save_strategy or call trainer.save_state())"
        )
    states = [(path, load_trainer_state(path)) for path in found]
    return max(states, key=lambda item: item[1].get("global_step") or 0)


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder (or one of its checkpoints)")
    parser.add_argument("--output", default=None, help="where to write the report image (default: RUN_DIR/report.png)")
    return parser


def run(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command with `argv` (default: the command line); returns the exit status."""
    from .health import assess

    args = _parser(prog).parse_args(argv)
    name = prog or "report"
    try:
        path, state = find_trainer_state(args.run_dir)
    except RunNotReadable as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    history = state["log_history"]
    health = assess(history)
    print(
        f"Run {args.run_dir}: {os.path.relpath(path, args.run_dir)} at global step {state.get('global_step')}, "
        f"{health.training_entries} training log entries"
    )
    print(_draw(history, args.output or os.path.join(args.run_dir, "report.png"), args.run_dir, health.episodes))
    print("\nHealth, one line per signal (what to watch: the metrics of docs/diagnostics.md):")
    for line in health.lines():
        print(f"  {line}")
    problems = health.problem_lines()
    if problems:
        alarms = f"{len(health.alarms)} alarm(s) raised" if health.alarms else "no alarm raised"
        print(f"\nProblems found ({alarms}), with what to change:")
        for line in problems:
            print(f"  {line}")
    else:
        print("\nNo alarm was raised and no health check failed.")
    return 0


def _draw(history: list[dict], output: str, run_dir: str, episodes) -> str:
    """Write the report image; one line saying what was written and which panels had nothing to draw."""
    try:
        from .figure import missing_panels, plot_training_report

        written = plot_training_report(
            history, output, title=os.path.basename(os.path.normpath(run_dir)), episodes=episodes
        )
    except ImportError:
        return "report.png: not written, matplotlib is not installed (pip install matplotlib)"
    if written is None:
        return "report.png: not written, no training step was logged"
    missing = missing_panels(history)
    line = f"report.png: {written}"
    if missing:
        line += "; panels without data: " + "; ".join(f"{title} ({', '.join(keys)})" for title, keys in missing)
    return line


if __name__ == "__main__":
    sys.exit(run())
