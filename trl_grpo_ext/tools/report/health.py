"""One verdict per signal of a GRPO run's log history, from the alarm rules the trainer runs live, replayed over the
history (docs/diagnostics.md, "The report command"). Works on the history of `GRPOTrainerExt` and of stock
`trl.GRPOTrainer` alike."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...guardrails.alarms import HELDOUT_KEY, SEVERITIES
from ...guardrails.anomaly import AnomalyMonitor, Episode
from ...metrics import (
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    FRAC_REWARD_UNSCORED,
    FRAC_REWARD_ZERO_STD,
    GRAD_NORM,
    KL,
    LOSS,
    LOSS_POLICY,
    LOSS_PREFIX,
    NONFINITE_SKIPPED_STEPS,
    RATIO_NAN_COUNT,
    RATIO_P95,
    REWARD,
    REWARD_LENGTH_CORR,
    REWARD_STD_FRAC_ZERO_GROUPS,
    REWARD_STD_GROUP_MEAN,
    heldout_metric,
)

#: The kinds of `Signal`.
SIGNAL_KINDS = ("alarms", "count", "shown")


@dataclass(frozen=True)
class Signal:
    """A signal that `report` judges and `report.png` draws.

    Attributes:
        name: its name on the report's line.
        keys: the metrics shown, in order of preference (the first one logged is summarised).
        alarms: the alarms that judge it.
        kind: `"alarms"` (judged by its alarms), `"count"` (fine while 0 and no alarm fired) or `"shown"` (not
            judged, but a NaN or infinite value is a `FAIL`).
        required: the alarms (of `alarms`) that must have judged for an `ok` where they are on; none: any of them.
    """

    name: str
    keys: tuple[str, ...]
    alarms: tuple[str, ...] = ()
    kind: str = "alarms"
    required: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"signal {self.name!r}: kind must be one of {SIGNAL_KINDS}, got {self.kind!r}")
        if not set(self.required) <= set(self.alarms):
            raise ValueError(f"signal {self.name!r}: required alarms {self.required} are not all of {self.alarms}")


_HELDOUT_MEAN = heldout_metric("<metric>", "mean", "<k>")
#: The signals judged, in the order of docs/diagnostics.md's metric table; every alarm judges one of them.
SIGNALS = (
    Signal("reward", (REWARD,), ("plateau", "reward_drop", "reward_composition"), required=("plateau",)),
    Signal("reward spread in groups", (REWARD_STD_GROUP_MEAN,), ("no_spread", "reward_scale")),
    Signal("groups without spread", (REWARD_STD_FRAC_ZERO_GROUPS, FRAC_REWARD_ZERO_STD), ("zero_std", "flat_groups")),
    Signal("unscored completions", (FRAC_REWARD_UNSCORED,), ("unscored",), kind="count"),
    Signal("KL to the reference", (KL,), ("kl_jump", "kl_high", "kl_growth")),
    Signal("loss split", (LOSS_POLICY, LOSS), kind="shown"),
    Signal("clip fraction", (CLIP_RATIO_REGION_MEAN,), ("clip_fraction", "clip_asymmetry")),
    Signal("importance ratio", (RATIO_P95,), ("ratio_p95", "ratio_max")),
    Signal("NaN log ratios", (RATIO_NAN_COUNT,), kind="count"),
    Signal("entropy", (ENTROPY,), ("entropy_collapse",)),
    Signal(
        "completion length",
        (COMPLETIONS_MEAN_LENGTH,),
        ("truncation", "truncation_sustained", "length_drift", "length_growth", "length_in_group"),
    ),
    Signal("skipped non-finite steps", (NONFINITE_SKIPPED_STEPS,), kind="count"),
    Signal("gradient norm", (GRAD_NORM,), ("grad_norm_spike", "no_gradient", "vanishing_gradient")),
    Signal("held-out metric", (_HELDOUT_MEAN,), ("reward_vs_heldout",)),
)

DIAGNOSTICS = "GRPOTrainerExt logs it with log_diagnostics; stock TRL does not"
#: Why a metric may be missing from a history (shown when a signal was not logged).
MISSING_REASONS = {
    REWARD_STD_GROUP_MEAN: DIAGNOSTICS,
    REWARD_STD_FRAC_ZERO_GROUPS: DIAGNOSTICS,
    FRAC_REWARD_UNSCORED: DIAGNOSTICS,
    LOSS_POLICY: DIAGNOSTICS,
    RATIO_P95: DIAGNOSTICS,
    RATIO_NAN_COUNT: DIAGNOSTICS,
    REWARD_LENGTH_CORR: DIAGNOSTICS,
    NONFINITE_SKIPPED_STEPS: "GRPOTrainerExt's non-finite guard logs it; stock TRL does not",
    KL: "logged only when beta > 0; TRL's default beta is 0.0",
    CLIP_RATIO_REGION_MEAN: "logged for the clipped-surrogate loss types; CISPO logs cispo_clip_ratio",
    _HELDOUT_MEAN: "no held-out evaluation was logged during training",
}


# `SEVERITIES` (the alarms' tiers) are the verdicts' too, lowest first; `--fail-on` of `report` takes the last three.
#: The verdicts that keep a run from being called healthy (with any alarm).
PROBLEMS = ("FAIL", "note", "short")
#: The last word on a run with no finding.
HEALTHY = "No alarm was raised and no health check failed."
#: ... and on one whose only findings are signals too short to judge.
TOO_SHORT = (
    "Too short to judge: no alarm was raised, but the run logged too few entries to tell whether it learned "
    "(train longer, or log more often: logging_steps):"
)
_SEVERITY = {"FAIL": "critical", "note": "note", "short": "note"}


@dataclass
class SignalHealth:
    """The verdict on one signal.

    Attributes:
        signal: the signal.
        verdict: `"ALARM"`, `"FAIL"`, `"note"`, `"short"`, `"ok"`, `"shown"` or `"missing"` (docs/diagnostics.md,
            "The report command").
        detail: what the values did, which alarms fired at which steps, or why nothing was logged.
        episodes: the alarm episodes concerned.
        onset: the first step the verdict is about, `None` where there is none or it is not known.
    """

    signal: Signal
    verdict: str
    detail: str
    episodes: list[Episode] = field(default_factory=list)
    onset: int | None = None

    @property
    def severity(self) -> str:
        """The verdict's tier of `SEVERITIES`: `FAIL` critical, `ALARM` its episodes' highest, `note` and `short` a
        note, others ok."""
        if self.verdict == "ALARM":
            return highest_severity(episode.severity for episode in self.episodes)
        return _SEVERITY.get(self.verdict, "ok")

    def line(self) -> str:
        return f"{self.verdict:<7} {self.signal.name:<25} {self.detail}"


@dataclass
class RunHealth:
    """The verdicts on every signal of a run, and the alarm episodes behind them."""

    signals: list[SignalHealth]
    episodes: list[Episode]
    training_entries: int

    @property
    def alarms(self) -> list[str]:
        """The names of the alarms raised, each once, in the order they first fired."""
        return list(dict.fromkeys(episode.name for episode in self.episodes))

    def lines(self) -> list[str]:
        """One line per signal."""
        return [signal.line() for signal in self.signals]

    @property
    def ok(self) -> bool:
        """No alarm was raised, no signal failed or needs a look, and the run was long enough to judge."""
        return not self.episodes and not any(signal.verdict in PROBLEMS for signal in self.signals)

    @property
    def too_short(self) -> bool:
        """Nothing is wrong but that some signals could not be judged yet: the run is too short to tell."""
        verdicts = {signal.verdict for signal in self.signals}
        return not self.episodes and "short" in verdicts and not verdicts & {"FAIL", "note"}

    def headline(self) -> str:
        """The run's verdict in one line: `HEALTHY`, too short to judge, or what was found."""
        if self.ok:
            return HEALTHY
        if self.too_short:
            return "Too short to judge: too few log entries to tell whether the run learned"
        found = []
        if self.alarms:
            found.append(
                f"{len(self.alarms)} alarm{'s' if len(self.alarms) > 1 else ''} raised: {', '.join(self.alarms)}"
            )
        for verdict, words in (("FAIL", "failed"), ("note", "worth a look"), ("short", "too short to judge")):
            names = [
                signal.signal.name for signal in self.signals if signal.verdict == verdict and not signal.episodes
            ]
            if names:
                found.append(f"{words}: {', '.join(names)}")
        return "; ".join(found)

    def problem_lines(self) -> list[str]:
        """`alarm_lines`, then one line per signal whose verdict is `FAIL`, `note` or `short` and that no alarm
        explains."""
        lines = self.alarm_lines()
        lines += [
            f"{signal.signal.name}: {signal.detail}"
            for signal in self.signals
            if signal.verdict in PROBLEMS and not signal.episodes
        ]
        return lines

    def alarm_lines(self) -> list[str]:
        """One line per alarm raised: its name, the steps of its episodes and the first warning (what to do)."""
        lines = []
        for name in self.alarms:
            episodes = [episode for episode in self.episodes if episode.name == name]
            lines.append(f"{name} ({_episode_steps(episodes)}): {episodes[0].message}")
        return lines


def highest_severity(tiers: Iterable[str]) -> str:
    """The highest of `tiers` (of `SEVERITIES`), `"ok"` for none."""
    return max(tiers, key=SEVERITIES.index, default="ok")


def _values(log_history: list[dict], key: str) -> list[tuple[int | None, float]]:
    """`(step, value)` of every entry holding `key` as a number other than NaN."""
    pairs = []
    for entry in log_history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            pairs.append((entry.get("step"), float(value)))
    return pairs


def _nan_steps(log_history: list[dict], key: str) -> list[int | None]:
    """The steps of the entries holding `key` as NaN: logged, without a value (not the same as not logged)."""
    return [entry.get("step") for entry in log_history if isinstance(entry.get(key), float) and math.isnan(entry[key])]


def _nonfinite_losses(log_history: list[dict]) -> dict[str, list[int | None]]:
    """The steps at which `loss` or a `loss/*` value was logged as NaN or infinite, per key (first seen first)."""
    steps: dict[str, list[int | None]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if (key == LOSS or key.startswith(LOSS_PREFIX)) and isinstance(value, float) and not math.isfinite(value):
                steps.setdefault(key, []).append(entry.get("step"))
    return steps


def _first_step(steps: list) -> int | None:
    return next((step for step in steps if step is not None), None)


def _heldout_keys(log_history: list[dict]) -> list[str]:
    return sorted({key for entry in log_history for key in entry if HELDOUT_KEY.match(key)})


def _span(steps: list) -> str:
    known = [step for step in steps if step is not None]
    if not known:
        return "steps ?"
    return f"step {known[0]}" if known[0] == known[-1] else f"steps {known[0]}-{known[-1]}"


def _summary(key: str, pairs: list[tuple[int | None, float]], nan_steps: list | None = None) -> str:
    """`key first -> last (min .. max), steps a-b`, and how many of the logged steps held NaN; with no number logged,
    `key NaN at every logged step (steps a-b)`."""
    nan_steps = nan_steps or []
    if not pairs:
        return f"{key} NaN at every logged step ({_span(nan_steps)})"
    values = [value for _, value in pairs]
    text = f"{key} {values[0]:.3g} -> {values[-1]:.3g}"
    if len(values) > 2:
        text += f" (min {min(values):.3g}, max {max(values):.3g})"
    text += f", {_span([step for step, _ in pairs])}"
    if nan_steps:
        text += f"; NaN at {len(nan_steps)} of {len(nan_steps) + len(pairs)} logged steps, from {_span(nan_steps[:1])}"
    return text


#: The last logged `grad_norm` at or above this many times the run's median is a `note` (a run that ends diverging).
FINAL_GRAD_NORM_FACTOR = 5.0


def _failure(signal: Signal, key: str, pairs: list[tuple[int | None, float]]) -> SignalHealth | None:
    """A verdict no alarm rule gives: a value that is not finite, `grad_norm` 0 at every step, or a last `grad_norm`
    far above the run's median."""
    infinite = [step for step, value in pairs if math.isinf(value)]
    if infinite:
        return SignalHealth(
            signal,
            "FAIL",
            f"{key} is not finite at {_span(infinite)}: {_summary(key, pairs)}",
            onset=_first_step(infinite),
        )
    if key != GRAD_NORM:
        return None
    values = [value for _, value in pairs]
    if all(value == 0.0 for value in values):
        return SignalHealth(
            signal, "FAIL", f"grad_norm 0 at every logged step ({_span([s for s, _ in pairs])}): nothing was learned"
        )
    median = statistics.median(values[:-1]) if len(values) > 4 else None
    if median and values[-1] >= FINAL_GRAD_NORM_FACTOR * median:
        return SignalHealth(
            signal,
            "note",
            f"the last grad_norm ({values[-1]:.3g}, {_span([pairs[-1][0]])}) is {values[-1] / median:.1f}x the "
            f"run's median ({median:.3g}): the run may have been diverging at its end | {_summary(key, pairs)}",
            onset=pairs[-1][0],
        )
    return None


#: What a metric logged as NaN at every step means, where more can be said than that nothing was measured.
NAN_THROUGHOUT = {
    GRAD_NORM: "no update reached the weights, or every one was broken (see nonfinite/skipped_steps)",
}


def _nan_throughout(signal: Signal, key: str, nan_steps: list) -> SignalHealth:
    """`key` logged, and NaN at every step that logged it: a `FAIL`."""
    why = NAN_THROUGHOUT.get(key, "the run cannot have trained well with it")
    return SignalHealth(signal, "FAIL", f"{_summary(key, [], nan_steps)}: {why}", onset=_first_step(nan_steps))


def _judge(signal: Signal, log_history: list[dict], monitor: AnomalyMonitor) -> SignalHealth:
    keys = _heldout_keys(log_history) if signal.keys == (_HELDOUT_MEAN,) else list(signal.keys)
    # The first key logged at all, as a number or as NaN: a metric logged as NaN is logged, without a value.
    logged = []
    for key in keys:
        pairs, nan_steps = _values(log_history, key), _nan_steps(log_history, key)
        if pairs or nan_steps:
            logged.append((key, pairs, nan_steps))
    episodes = [episode for episode in monitor.episodes if episode.name in signal.alarms]
    judged = [name for name in signal.alarms if name in monitor.judged]
    shown = _summary(*logged[0]) if logged else ""
    failure = None
    if logged and signal.kind != "shown":
        key, pairs, nan_steps = logged[0]
        failure = _failure(signal, key, pairs) if pairs else _nan_throughout(signal, key, nan_steps)
    if failure is not None and not episodes:
        return failure
    logged = [(key, pairs) for key, pairs, _ in logged if pairs]
    if signal.kind == "count" and not episodes:
        if not logged:
            if signal.keys == (RATIO_NAN_COUNT,) and _values(log_history, RATIO_P95):
                return SignalHealth(signal, "ok", "none (ratio/nan_count is logged only when there are some)")
            return SignalHealth(signal, "missing", _missing(signal.keys[0]))
        key, pairs = logged[0]
        nonzero = [step for step, value in pairs if value > 0]
        if not nonzero:
            return SignalHealth(signal, "ok", f"{key} always 0, {_span([step for step, _ in pairs])}")
        return SignalHealth(
            signal,
            "note",
            f"{key} up to {max(v for _, v in pairs):.3g}, not 0 at {_span(nonzero)}",
            onset=_first_step(nonzero),
        )
    if signal.kind == "shown":
        # A loss that is NaN or infinite is the one thing its values do say: the run stopped training there.
        nonfinite = _nonfinite_losses(log_history)
        if nonfinite:
            onset = min((s for steps in nonfinite.values() for s in steps if s is not None), default=None)
            where = "; ".join(f"{key} at {_span(steps)}" for key, steps in nonfinite.items())
            return SignalHealth(
                signal,
                "FAIL",
                f"not finite (NaN or inf) from step {onset if onset is not None else '?'}: {where}"
                + (f" | finite values: {shown}" if shown else ""),
                onset=onset,
            )
        return SignalHealth(signal, "shown", (shown or _missing(signal.keys[0])) + " (its sign and size say little)")
    if episodes:
        raised = "; ".join(
            f"{name} at {_episode_steps(group)}"
            for name in signal.alarms
            if (group := [episode for episode in episodes if episode.name == name])
        )
        return SignalHealth(
            signal,
            "ALARM",
            f"{raised} | {shown or _missing(keys[0] if keys else signal.keys[0])}",
            episodes,
            onset=min((e.start for e in episodes if e.start is not None), default=None),
        )
    if not logged and not judged:
        return SignalHealth(signal, "missing", _missing(keys[0] if keys else signal.keys[0]))
    # A signal is judged when its required alarms that are on judged (the reward's plateau: did the run learn at
    # all?), else when one of its alarms did; logged, but with none of that, it is too short to judge, not fine.
    rules = {rule.name: rule for rule in monitor.rules}
    waiting = [name for name in signal.required if name in rules and name not in judged]
    if signal.alarms and rules.keys() & set(signal.alarms) and (waiting or not judged):
        waiting = waiting or [name for name in signal.alarms if name in rules]
        needs = "; ".join(f"{name} needs {rules[name].pending()}" for name in waiting)
        entries = len(logged[0][1]) if logged else 0
        return SignalHealth(
            signal, "short", f"too short to judge ({entries} log entries): {needs} | {shown or _missing(keys[0])}"
        )
    if not judged:
        return SignalHealth(signal, "ok", shown)
    first = min(monitor.judged[name][0] for name in judged)
    last = max(monitor.judged[name][1] for name in judged)
    checked = f"no alarm ({', '.join(judged)}) over {_span([first, last])}"
    return SignalHealth(signal, "ok", f"{checked} | {shown or _missing(signal.keys[0])}")


def _episode_steps(episodes: list[Episode]) -> str:
    """`step 3` or `steps 3-5, 9`."""
    steps = ", ".join(episode.steps() for episode in episodes)
    return f"step {steps}" if len(episodes) == 1 and "-" not in steps else f"steps {steps}"


def _missing(key: str) -> str:
    return f"not logged: {key} ({MISSING_REASONS.get(key, 'not in the log history')})"


def assess(log_history: list[dict], monitor: AnomalyMonitor | None = None) -> RunHealth:
    """Judge a run's log history: one `SignalHealth` per entry of `SIGNALS`, and every alarm episode.

    Args:
        log_history: the entries, in order.
        monitor: the thresholds to judge with (`AnomalyMonitor.from_config(args)`), replayed from scratch over the
            history; default: `GRPOConfigExt`'s.
    """
    monitor = monitor or AnomalyMonitor()
    monitor.replay(log_history)
    signals = [_judge(signal, log_history, monitor) for signal in SIGNALS]
    entries = sum(1 for entry in log_history if LOSS in entry)
    return RunHealth(signals, list(monitor.episodes), entries)
