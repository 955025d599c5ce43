"""The console (`console="compact"`): the progress bar, and per log step one line of the key signals,

    step 20/400 | reward 0.412 | spread 0.231 | kl 0.00312 | clip 0.0125 | ratio p95 1.08 | entropy 1.93 | len 7.4

with the alarms that start at that step at its end (`| ALARM truncation, no_spread`), in place of transformers' raw
dict lines; at the end of training, `report`'s `sampling:` line where the sampling options would pay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from transformers import PrinterCallback, ProgressCallback

from ..choices import CONSOLE_MODES
from ..metrics import (
    ALARMS_PREFIX,
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    KL,
    LOSS,
    LOSS_PREFIX,
    RATIO_P95,
    REWARD,
    REWARD_STD_GROUP_MEAN,
)

__all__ = ["CONSOLE_MODES", "CONSOLE_SIGNALS", "ConsoleCallback", "format_log_line"]

#: (logged metric, its label on the line), in the order of the line.
CONSOLE_SIGNALS = (
    (REWARD, "reward"),
    (REWARD_STD_GROUP_MEAN, "spread"),
    (KL, "kl"),
    (CLIP_RATIO_REGION_MEAN, "clip"),
    (RATIO_P95, "ratio p95"),
    (ENTROPY, "entropy"),
    (COMPLETIONS_MEAN_LENGTH, "len"),
)
MISSING = "-"  # a signal not logged at this step (rewards are logged only at the steps that generate)


def _format(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return MISSING if value is None else str(value)
    if math.isnan(value):
        return MISSING
    return f"{value:.3g}"


def _nonfinite_loss(key: str, value) -> bool:
    is_loss = key in (LOSS, "eval_loss") or key.startswith((LOSS_PREFIX, "eval_loss/"))
    return is_loss and isinstance(value, float) and not math.isfinite(value)


def _repeats_heldout(logs: Mapping, key: str) -> bool:
    """Whether a held-out value repeats the line: its sample size (`.../scored@<n>`), or `pass@1` equal to `mean@1`."""
    if "/scored@" in key:
        return True
    return key.endswith("/pass@1") and logs.get(key[: -len("pass@1")] + "mean@1") == logs[key]


def format_log_line(
    logs: Mapping, step: int, max_steps: int | None = None, alarms: list[str] | tuple[str, ...] = ()
) -> str:
    """The console line of one log entry (as `on_log` gets it) at `step` of `max_steps`, with the `alarms` that start.

    A training entry gives the `CONSOLE_SIGNALS` (`-` for those not logged), an evaluation entry the same with TRL's
    `eval_` prefix, any other entry its numbers; a non-finite `loss` or `loss/*` value is appended.
    """
    where = f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"
    if LOSS in logs:
        fields = [where] + [f"{label} {_format(logs.get(key))}" for key, label in CONSOLE_SIGNALS]
    elif "eval_loss" in logs:
        fields = [f"eval {where}"] + [f"{label} {_format(logs.get('eval_' + key))}" for key, label in CONSOLE_SIGNALS]
    else:
        fields = [where] + [
            f"{key} {_format(value)}"
            for key, value in logs.items()
            if isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not key.startswith(ALARMS_PREFIX)
            and key not in ("epoch", "total_flos", "step")
            and not _repeats_heldout(logs, key)
        ]
    nonfinite = [key for key, value in logs.items() if _nonfinite_loss(key, value)]
    if nonfinite:  # not a dash: a loss that is NaN or infinite is the line's news
        fields.append(" ".join(f"{key} {logs[key]}" for key in nonfinite))
    if alarms:
        fields.append("ALARM " + ", ".join(alarms))
    return " | ".join(fields)


class ConsoleCallback(ProgressCallback):
    """transformers' progress bar (unless `disable_tqdm`), with one `format_log_line` line per log entry above it,
    main process only; the alarms shown are those whose `alarms/<name>` count (`AnomalyMonitor`'s) went up."""

    def __init__(self):
        super().__init__()
        self._counts: dict[str, float] = {}

    @classmethod
    def install(cls, trainer) -> ConsoleCallback:
        """Replace `trainer`'s `ProgressCallback` / `PrinterCallback` (the raw dict lines) by a `ConsoleCallback`."""
        for callback in (ProgressCallback, PrinterCallback):
            trainer.remove_callback(callback)
        console = cls()
        trainer.add_callback(console)
        return console

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.disable_tqdm:
            super().on_train_begin(args, state, control, **kwargs)
        self._counts = _alarm_counts(state.log_history)  # a resumed run: the alarms given before

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not args.disable_tqdm:
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)
        if state.is_world_process_zero:
            from ..tools.report.sampling import sampling_summary  # the tools load at the end of training only

            summary = sampling_summary(state.log_history)
            if summary is not None and summary["message"]:  # only where there is something to change
                print(summary["message"], flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        counts = _alarm_counts([logs])
        started = [
            key.removeprefix(ALARMS_PREFIX) for key, value in counts.items() if value > self._counts.get(key, 0)
        ]
        self._counts.update(counts)
        line = format_log_line(logs, state.global_step, state.max_steps, started)
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)


def _alarm_counts(entries: list[Mapping]) -> dict[str, float]:
    """The highest `alarms/<name>` count of `entries`, per alarm."""
    counts: dict[str, float] = {}
    for entry in entries:
        for key, value in entry.items():
            if key.startswith(ALARMS_PREFIX) and isinstance(value, (int, float)):
                counts[key] = max(counts.get(key, value), value)
    return counts
