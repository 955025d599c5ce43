"""`AnomalyMonitor`: the alarms (`alarms`), judged live on each logged entry, each given once per episode and counted
in `alarms/<name>`; `AlarmSettings`: a run's alarm settings, kept in its trainer state for `trl-grpo-ext report`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from ..metrics import LOSS, alarm_metric
from .alarms import ALARMS, RENAMED, SEVERITIES, Rule, build_rules, threshold_problems, thresholds_of

__all__ = ["AlarmSettings", "AnomalyMonitor", "Episode"]

logger = logging.get_logger(__name__)


def _warn_apart_from_progress_bars(message: str) -> None:
    """Log `message` as a warning on a line of its own while a tqdm bar (Trainer's, on stderr) holds the end of the
    current line: on a terminal the bar is cleared and drawn again below it; in a redirected log, where the bar's
    `\r` updates never end their line, the warning starts on a new one."""
    from tqdm import tqdm

    if not any(not bar.disable for bar in list(getattr(tqdm, "_instances", ()))):
        logger.warning(message)
    elif sys.stderr.isatty():
        with tqdm.external_write_mode(file=sys.stderr):
            logger.warning(message)
    else:
        logger.warning("\n" + message)


@dataclass
class Episode:
    """One stretch of log steps during which an alarm's condition held.

    Attributes:
        name: the alarm (`alarms/<name>`).
        start: the step it was given at (`None` for an entry without a step).
        end: the last step at which the condition held so far.
        message: the warning given.
        active: whether the condition still held at the last entry that told.
        severity: its tier (of `alarms.SEVERITIES`): `"warning"` but for an alarm with tiers.
    """

    name: str
    start: int | None
    end: int | None
    message: str
    active: bool = True
    severity: str = "warning"

    def steps(self) -> str:
        """The steps as text: `"12"` or `"12-30"`."""
        if self.start is None:
            return "?"
        return str(self.start) if self.end in (None, self.start) else f"{self.start}-{self.end}"


class AnomalyMonitor(TrainerCallback):
    """Alarms about a GRPO run, from its logged metrics; each given once per episode and counted.

    An alarm fires when its condition starts and again only after the condition has cleared for a log step (or, for
    an alarm with severity tiers, when it rises to a higher tier). Each alarm given is counted in `alarms/<name>`,
    added to every training log entry from its first time on: to the `logs` the callbacks after this one see (the
    trainer puts it before the loggers) and to the entry of `state.log_history`. On `on_train_begin` it replays the
    history already in the state, so a resumed run keeps its counts and the rules their windows.

    Args:
        thresholds (`dict[str, float | None]`, *optional*): alarm name (`alarms.ALARMS`) -> threshold, as
            `GRPOConfigExt.alarm_thresholds`: `None` switches that alarm off, an alarm not named takes its default.
        patience (`int`): log steps in a row a high clip fraction must last (`warn_patience`).
        auxiliary_rewards (`list[str]`, *optional*): the reward functions that score the form of a completion rather
            than the task, as logged in `rewards/<name>/mean` (`warn_auxiliary_rewards`); `None`: told by the words of
            their names (`format`, `tag`, `xml`, ...).
    """

    def __init__(
        self,
        thresholds: Mapping[str, float | None] | None = None,
        *,
        patience: int = 3,
        auxiliary_rewards: Sequence[str] | None = None,
    ):
        problems = threshold_problems(thresholds, where="thresholds")
        if problems:
            raise ValueError(" ".join(problems))
        self.thresholds = thresholds_of(thresholds)  # alarm name -> threshold, in `ALARMS` order
        if patience < 1:
            raise ValueError(f"`patience` must be >= 1, got {patience}.")
        self.patience = patience
        self.auxiliary_rewards = auxiliary_names(auxiliary_rewards)
        self.reset()

    @classmethod
    def from_config(cls, args) -> AnomalyMonitor:
        """The monitor that `args` describes; a plain `trl.GRPOConfig` gets `GRPOConfigExt`'s defaults."""
        return AlarmSettings.from_config(args).monitor()

    def reset(self) -> None:
        """Forget every entry seen: fresh rules, no counts, no episodes."""
        self.rules: list[Rule] = build_rules(self.thresholds, self.patience, self.auxiliary_rewards)
        self.counts: dict[str, int] = {}
        self.episodes: list[Episode] = []
        self._open: dict[str, Episode] = {}
        self.judged: dict[str, tuple] = {}  # alarm name -> (first, last) step of the entries it could judge
        self.warnings: list[str] = []  # every warning given (`check(..., warn=True)`), for callers and tests

    def check(self, logs: Mapping, step: int | None = None, warn: bool = True) -> list[str]:
        """Feed one log entry to every rule; return the warnings that start with it.

        Args:
            logs: the entry (keys `alarms/*` in it are ignored).
            step: its global step; default: `logs["step"]` (as in `log_history`).
            warn: also log each warning through the transformers logger (only the main process should).
        """
        step = logs.get("step") if step is None else step
        # The rules that count training steps read the step from the entry: `log_history`'s entries hold it, the
        # `logs` of a live `on_log` do not.
        entry = logs if step is None or logs.get("step") == step else {**logs, "step": step}
        started = []
        for rule in self.rules:
            verdict = rule.judge(entry)
            if verdict is None:
                continue  # not logged in this entry: the episode (or its absence) goes on
            first = self.judged.get(rule.name, (step, step))[0]
            self.judged[rule.name] = (first, step)
            episode = self._open.get(rule.name)
            if verdict is False:
                if episode is not None:
                    episode.active = False
                    del self._open[rule.name]
                continue
            if episode is not None:
                if SEVERITIES.index(rule.severity) <= SEVERITIES.index(episode.severity):
                    episode.end = step
                    continue
                episode.active = False  # risen to a higher tier: a new episode, warned again
            message = verdict + rule.tag()
            episode = Episode(rule.name, step, step, message, severity=rule.severity)
            self._open[rule.name] = episode
            self.episodes.append(episode)
            self.counts[rule.name] = self.counts.get(rule.name, 0) + 1
            started.append(message)
            if warn:
                _warn_apart_from_progress_bars(message)
                self.warnings.append(message)
        return started

    def alarm_metrics(self) -> dict[str, int]:
        """`alarms/<name>`: how many times each alarm given so far was given (the others are left out)."""
        return {alarm_metric(name): self.counts[name] for name in ALARMS if name in self.counts}

    def replay(self, log_history: list[dict]) -> None:
        """Start afresh and feed `log_history` (a `TrainerState`'s) without warning."""
        self.reset()
        for entry in log_history:
            self.check(entry, warn=False)

    def on_train_begin(self, args, state, control, **kwargs):
        self.replay(state.log_history)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        # Every process judges (the logged values are the same everywhere), so their histories agree; one warns.
        started = self.check(logs, state.global_step, warn=state.is_world_process_zero)
        if LOSS not in logs and not started:
            return  # evaluation or the end-of-training summary: no counts in it
        counts = self.alarm_metrics()
        logs.update(counts)
        entry = state.log_history[-1] if state.log_history else None
        if (
            entry is not None
            and entry.get("step") == state.global_step
            and logs.keys() - counts.keys() <= entry.keys()
        ):
            entry.update(counts)  # Trainer.log recorded this entry before calling the callbacks


def auxiliary_names(names) -> tuple[str, ...] | None:
    """`warn_auxiliary_rewards` as a tuple of names (a single name is one name), `None` for `None`.

    Raises:
        TypeError: for anything but `None`, a name, or a list of names.
    """
    if names is None:
        return None
    if isinstance(names, str):
        return (names,)
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise TypeError(
            "warn_auxiliary_rewards must be a list of reward function names as logged in rewards/<name>/mean "
            f"(e.g. ['format_reward']), or None to tell them by their names' words; got {names!r}."
        )
    return tuple(names)


class AlarmSettings(TrainerCallback, ExportableState):
    """A run's alarm settings, kept in its trainer state (`stateful_callbacks["AlarmSettings"]` of
    `trainer_state.json`, written with every checkpoint and by `Trainer.save_state`), so that `trl-grpo-ext report`
    judges a finished run with the thresholds it ran with. It records the configuration of the run when training
    begins (a resumed run's own).

    Args:
        enabled (`bool`): `warn_on_anomalies`.
        patience (`int`): `warn_patience`.
        thresholds (`dict`): alarm name -> threshold (`None`: off), every alarm's.
        auxiliary_rewards (`list[str]`, *optional*): `warn_auxiliary_rewards`.
    """

    def __init__(
        self,
        enabled: bool = True,
        patience: int = 3,
        thresholds: Mapping | None = None,
        auxiliary_rewards: Sequence[str] | None = None,
    ):
        self.enabled, self.patience = bool(enabled), int(patience)
        self.thresholds = thresholds_of(thresholds)
        self.auxiliary_rewards = auxiliary_names(auxiliary_rewards)

    @classmethod
    def from_config(cls, args) -> AlarmSettings:
        """The settings of `args`; a field `args` lacks (a plain `trl.GRPOConfig` has none) takes `GRPOConfigExt`'s
        default."""
        return cls(
            getattr(args, "warn_on_anomalies", True),
            getattr(args, "warn_patience", 3),
            getattr(args, "alarm_thresholds", None),
            getattr(args, "warn_auxiliary_rewards", None),
        )

    @classmethod
    def from_arguments(cls, args: Mapping) -> AlarmSettings | None:
        """The settings a run's recorded arguments hold (`TrainingArguments.to_dict()`, as TensorBoard keeps them),
        the `warn_*` fields of older releases included; `None` when they hold none (a stock TRL run)."""
        old = {name: args[field] for field, name in RENAMED.items() if field in args}
        if "alarm_thresholds" not in args and not old:
            return None
        thresholds = old | _known(args.get("alarm_thresholds"))
        auxiliary = args.get("warn_auxiliary_rewards")
        return cls(args.get("warn_on_anomalies", True), args.get("warn_patience", 3), thresholds, auxiliary)

    @classmethod
    def from_trainer_state(cls, state: Mapping) -> AlarmSettings | None:
        """The settings a trainer state (`trainer_state.json`'s contents) records; `None` when it records none (a
        stock TRL run, or one of a release without them). Older releases keyed the thresholds by their `warn_*`
        fields without the prefix (`kl_max`): read as the alarms they set."""
        record = (state.get("stateful_callbacks") or {}).get(cls.__name__)
        if not isinstance(record, Mapping) or not isinstance(record.get("args"), Mapping):
            return None
        args = record["args"]
        thresholds = _known(args.get("thresholds"))
        return cls(args.get("enabled", True), args.get("patience", 3), thresholds, args.get("auxiliary_rewards"))

    def monitor(self, live: bool = False) -> AnomalyMonitor:
        """An `AnomalyMonitor` with these thresholds; with `live`, the alarms the run gave: none when it had them off
        (`enabled` False)."""
        thresholds = dict.fromkeys(ALARMS) if live and not self.enabled else self.thresholds
        return AnomalyMonitor(thresholds, patience=self.patience, auxiliary_rewards=self.auxiliary_rewards)

    def state(self) -> dict:
        args = {"enabled": self.enabled, "patience": self.patience, "thresholds": dict(self.thresholds)}
        if self.auxiliary_rewards is not None:
            args["auxiliary_rewards"] = list(self.auxiliary_rewards)
        return {"args": args, "attributes": {}}

    def on_train_begin(self, args, state, control, **kwargs):
        current = self.from_config(args)
        self.enabled, self.patience, self.thresholds = current.enabled, current.patience, current.thresholds
        self.auxiliary_rewards = current.auxiliary_rewards
        state.stateful_callbacks[type(self).__name__] = self.state()


def _known(recorded) -> dict:
    """The thresholds of a run's record by alarm name: those under an alarm's name or an older release's key (a
    `warn_*` field, with or without its prefix); anything else, and a value out of its range, left out (a log is
    read, not refused: those alarms take their defaults)."""
    if not isinstance(recorded, Mapping):
        return {}
    names = {key: name for field, name in RENAMED.items() for key in (field, field.removeprefix("warn_"))}
    names |= {name: name for name in ALARMS}
    known = {names[key]: value for key, value in recorded.items() if key in names}
    return {name: value for name, value in known.items() if ALARMS[name].alarms[name].range.problem(value) is None}
