"""`trl-grpo-ext report RUN_DIR`: `report.png` and the health summary of a GRPO run (`GRPOTrainerExt`'s or stock
TRL's) from the trainer state or TensorBoard event files written last in its folder (docs/diagnostics.md, "The report
command")."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

from ...guardrails.anomaly import AlarmSettings
from . import figure
from .formats import FORMATS, Report, forward_summary, render, unrecognised_keys
from .health import SEVERITIES, RunHealth, assess
from .sampling import sampling_summary
from .tensorboard import event_files, read_event_files

STATE_NAME = "trainer_state.json"
DESCRIPTION = (
    "The training report of a GRPO run (GRPOTrainerExt or stock trl.GRPOTrainer) from its trainer_state.json "
    "(or its TensorBoard event files): "
    "rewrites report.png and prints a health summary, one line per signal, with the steps concerned."
)


class RunNotReadable(Exception):
    """The folder holds no readable trainer state; the message is the one-line reason."""


def load_trainer_state(path: str) -> dict:
    """The JSON of a `trainer_state.json` that holds a `log_history` list, else `RunNotReadable`."""
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunNotReadable(f"{path} cannot be read as a trainer state: {error}") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise RunNotReadable(f"{path} has no log_history list: not a transformers Trainer state")
    return state


@dataclass
class FoundRun:
    """The run `report` reads.

    Attributes:
        path (`str`): the `trainer_state.json` read, or the folder of the TensorBoard event files read.
        state (`dict`): the trainer state (rebuilt from event files: `log_history` and `global_step`).
        other_runs (`list[tuple[str, int]]`): `(path, last step)` of each state or event file of another run.
        source (`str`): `"trainer_state"` or `"tensorboard"`.
        args (`dict`, *optional*): the training arguments the event files record; `None` for a trainer state.
    """

    path: str
    state: dict
    other_runs: list[tuple[str, int]] = field(default_factory=list)
    source: str = "trainer_state"
    args: dict | None = None


_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


def find_run(run_dir: str) -> FoundRun:
    """The trainer state written last in `run_dir` or one of its `checkpoint-<step>` folders (at equal times the
    further one), else its TensorBoard event files; the other runs' beside it. Raises `RunNotReadable`."""
    if not os.path.isdir(run_dir):
        raise RunNotReadable(f"{run_dir} is not a folder")
    candidates = [os.path.join(run_dir, STATE_NAME)]
    candidates += [
        os.path.join(run_dir, name, STATE_NAME)
        for name in sorted(os.listdir(run_dir))
        if _CHECKPOINT.match(name) and os.path.isdir(os.path.join(run_dir, name))
    ]
    found = [path for path in candidates if os.path.isfile(path)]
    if not found and (events := event_files(run_dir)):
        return _tensorboard_run(run_dir, events)
    if not found:
        raise RunNotReadable(
            f"{run_dir} holds no {STATE_NAME}, neither itself nor in a checkpoint-<step> folder: not the output "
            "folder of a Trainer run (or one that never saved; set save_strategy or call trainer.save_state())"
        )
    stamped = [(os.path.getmtime(path), path) for path in found]
    newest = max(stamped, key=lambda item: (item[0], _step_of(item[1])))[1]
    state = load_trainer_state(newest)
    history = state["log_history"]
    others = []
    for path in found:
        if path == newest:
            continue
        try:
            other = load_trainer_state(path)
        except RunNotReadable:
            continue  # not a state of any run to speak of
        earlier = other["log_history"]
        if earlier != history[: len(earlier)] or (other.get("global_step") or 0) > (state.get("global_step") or 0):
            others.append((path, other.get("global_step")))
    return FoundRun(newest, state, others)


def _tensorboard_run(run_dir: str, events: list[str]) -> FoundRun:
    """The run whose only logs are the TensorBoard event files `events`, judged with the thresholds they record."""
    try:
        read = read_event_files(events)
    except ImportError as error:
        raise RunNotReadable(f"{run_dir} holds no {STATE_NAME}, only TensorBoard event files; {error}") from None
    except Exception as error:  # a truncated or foreign file: the reason, not a traceback
        raise RunNotReadable(f"{run_dir}: its TensorBoard event files cannot be read: {error}") from None
    folder = os.path.commonpath([os.path.dirname(path) for path in read.files or events])
    steps = [entry["step"] for entry in read.history]
    state = {"global_step": max(steps, default=0), "log_history": read.history}
    settings = AlarmSettings.from_arguments(read.args) if read.args is not None else None
    if settings is not None:
        state["stateful_callbacks"] = {AlarmSettings.__name__: settings.state()}
    others = [(os.path.dirname(path), step) for path, step in read.others]
    return FoundRun(folder, state, others, source="tensorboard", args=read.args)


def _step_of(path: str) -> int:
    folder = os.path.basename(os.path.dirname(path))
    return int(folder.rsplit("-", 1)[1]) if _CHECKPOINT.match(folder) else -1


#: `--fail-on`'s tiers (`health.SEVERITIES` above "ok").
FAIL_ON = ("note", "warning", "critical")
EXIT_OK, EXIT_NOT_READABLE, EXIT_FINDINGS = 0, 1, 2
EXIT_CODES = (
    "exit status: 0 the run was read (whatever its health, unless --fail-on says otherwise); 1 it could not be read "
    "(the one-line reason on stderr); 2 a finding or alarm at or above the --fail-on tier (FAIL is critical, ALARM a "
    "warning, a note a note)"
)


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EXIT_CODES)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder (or one of its checkpoints)")
    parser.add_argument("--output", default=None, help="where to write the report image (default: RUN_DIR/report.png)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default), markdown (a CI step summary) or json (findings with verdict, severity, onset step)",
    )
    parser.add_argument(
        "--auxiliary-rewards",
        nargs="*",
        metavar="NAME",
        default=None,
        help="the reward functions that score the form of a completion, not the task, as logged in "
        "rewards/<NAME>/mean (for reward_composition; default: the run's warn_auxiliary_rewards, else those with "
        "format, tag, xml, json, length, lang, style or think as a word of their name)",
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        default=None,
        help="exit with status 2 when a finding or alarm is of this severity or above (default: never)",
    )
    return parser


def run(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command with `argv` (default: the command line); the exit status (`EXIT_CODES`)."""
    args = _parser(prog).parse_args(argv)
    name = prog or "report"
    try:
        found = find_run(args.run_dir)
    except RunNotReadable as error:
        print(f"{name}: {error}", file=sys.stderr)
        return EXIT_NOT_READABLE
    state = found.state
    history = state["log_history"]
    settings = AlarmSettings.from_trainer_state(state)
    judged_with = settings if settings is not None else AlarmSettings()  # GRPOConfigExt's defaults
    if args.auxiliary_rewards is not None:
        judged_with.auxiliary_rewards = tuple(args.auxiliary_rewards)
    health = assess(history, judged_with.monitor())
    read = os.path.relpath(found.path, args.run_dir)
    what = f"TensorBoard event files in {read}" if found.source == "tensorboard" else read
    notes = [
        f"Run {args.run_dir}: {what} at global step {state.get('global_step')}, "
        f"{health.training_entries} training log entries"
    ]
    if found.other_runs:
        listed = ", ".join(f"{os.path.relpath(other, args.run_dir)} (step {step})" for other, step in found.other_runs)
        files = "TensorBoard event files" if found.source == "tensorboard" else "trainer states"
        notes.append(
            f"The folder also holds {files} of another run: {listed}. This report is of the run that wrote the "
            "folder last; give each run an output_dir of its own to keep them apart."
        )
    recorded = "the arguments its event files record" if found.source == "tensorboard" else "its trainer state"
    if settings is None:
        notes.append(
            f"Thresholds: GRPOConfigExt's defaults (no alarm settings in {recorded}: a stock TRL run, or one of an "
            "older release)."
        )
    elif not settings.enabled:
        notes.append(
            f"Thresholds: the run's alarm_thresholds (from {recorded}); it ran with warn_on_anomalies=False (no alarm "
            "was given live)."
        )
    else:
        notes.append(f"Thresholds: the run's own alarm_thresholds (from {recorded}).")
    if judged_with.auxiliary_rewards is not None:
        given = "--auxiliary-rewards" if args.auxiliary_rewards is not None else "the run's warn_auxiliary_rewards"
        names = ", ".join(judged_with.auxiliary_rewards) or "none"
        notes.append(f"Auxiliary reward functions (for reward_composition): {names}, from {given}.")
    unrecognised = unrecognised_keys(history)
    if unrecognised:
        notes.append(f"Keys not recognised (not judged): {', '.join(unrecognised)}")
    report = Report(
        run_dir=args.run_dir,
        read=read,
        source=found.source,
        global_step=state.get("global_step"),
        notes=notes,
        image=_draw(
            history,
            args.output or os.path.join(args.run_dir, "report.png"),
            args.run_dir,
            health,
            settings.thresholds if settings is not None else None,
        ),
        health=health,
        forward=forward_summary(history, _forward_options(found.args)),
        sampling=sampling_summary(history),
        unrecognised=unrecognised,
    )
    print(render(report, args.format))
    if args.fail_on is not None and SEVERITIES.index(report.worst_severity()) >= SEVERITIES.index(args.fail_on):
        return EXIT_FINDINGS
    return EXIT_OK


def _forward_options(args: dict | None) -> dict | None:
    """The run's `padding_free` and `shared_prompt_forward`, where its recorded arguments hold both."""
    names = ("padding_free", "shared_prompt_forward")
    return {name: bool(args[name]) for name in names} if args is not None and all(n in args for n in names) else None


def _draw(history: list[dict], output: str, run_dir: str, health: RunHealth, thresholds: dict | None) -> str:
    """Draw `report.png`; one line saying what was written and which panels had nothing to draw."""
    try:
        written = figure.plot_training_report(
            history,
            output,
            title=os.path.basename(os.path.normpath(run_dir)),
            episodes=health.episodes,
            thresholds=thresholds,
            verdict=health.headline(),
        )
    except ImportError:
        return "report.png: not written, matplotlib is not installed (pip install matplotlib)"
    except (ArithmeticError, ValueError, OSError) as error:  # values matplotlib cannot frame; a folder not writable
        return f"report.png: not written, {type(error).__name__}: {error}"
    if written is None:
        return "report.png: not written, no training step was logged"
    missing = figure.missing_panels(history)
    line = f"report.png: {written}"
    if missing:
        line += "; panels without data: " + "; ".join(f"{title} ({', '.join(keys)})" for title, keys in missing)
    return line


if __name__ == "__main__":
    sys.exit(run())
