"""What an alarm is: `Rule`, the base of a family of alarms (one class per family, each alarm a method of it judging
one log entry at a time), `Alarm` (an alarm's default threshold, its range and its tier), and what the families
share: the readers of a logged number and the windows over a metric's history."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ...metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO,
    FRAC_REWARD_ZERO_STD,
    NONFINITE_SKIPPED_STEPS,
    REWARD_STD_FRAC_ZERO_GROUPS,
)

__all__ = [
    "FACTOR",
    "FRACTION",
    "HELDOUT_KEY",
    "POSITIVE",
    "SEVERITIES",
    "SHARE",
    "SKIPPED_STEPS_KEY",
    "STEPS",
    "TRUNCATION_KEYS",
    "ZERO_SPREAD_KEYS",
    "Alarm",
    "Cadence",
    "Range",
    "Rule",
    "RunningMedian",
    "Series",
    "curvature_t",
    "mean",
    "pearson",
]

#: The severity tiers of the alarms and of the report's verdicts, lowest first.
SEVERITIES = ("ok", "note", "warning", "critical")

#: A held-out metric's mean over k completions per prompt (`heldout/<metric>/mean@<k>`), also with `eval_` in front.
HELDOUT_KEY = re.compile(r"^(?:eval_)?heldout/(?P<metric>.+)/mean@(?P<k>\d+)$")
#: The share of groups without reward spread: this package's, judged on each group, else TRL's (which under
#: `scale_rewards="batch"` tests the batch's std instead).
ZERO_SPREAD_KEYS = (REWARD_STD_FRAC_ZERO_GROUPS, FRAC_REWARD_ZERO_STD)
#: The truncated share of the batch that trains (under dynamic sampling `completions/*` count every round), else of
#: every completion.
TRUNCATION_KEYS = (DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO, COMPLETIONS_CLIPPED_RATIO)
#: The non-finite guard's count of the optimizer steps it skipped so far.
SKIPPED_STEPS_KEY = NONFINITE_SKIPPED_STEPS


@dataclass(frozen=True)
class Range:
    """The values a threshold may take: between `low` and `high`, each end in or out; `whole`: a count of steps."""

    low: float
    high: float
    low_in: bool = False
    high_in: bool = False
    whole: bool = False

    def text(self) -> str:
        """`in (0, 1]`, `> 1`, `>= 1`."""
        if math.isinf(self.high):
            return f"{'>=' if self.low_in else '>'} {self.low:g}"
        return f"in {'[' if self.low_in else '('}{self.low:g}, {self.high:g}{']' if self.high_in else ')'}"

    def problem(self, value) -> str | None:
        """What is wrong with `value` as a threshold of this range, `None` when nothing is (`None` never is)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number or None, got {value!r}"
        inside = (self.low <= value if self.low_in else self.low < value) and (
            value <= self.high if self.high_in else value < self.high
        )
        if not inside:
            return f"must be {self.text()} (or None to switch its alarm off), got {value}"
        if self.whole and value != int(value):
            return f"must be a whole number of steps, got {value}"
        return None


SHARE = Range(0.0, 1.0, high_in=True)  # a share of completions, groups or tokens, or a correlation
FRACTION = Range(0.0, 1.0)  # a fraction of a start value
POSITIVE = Range(0.0, math.inf)
FACTOR = Range(1.0, math.inf)  # a multiple of a usual value
STEPS = Range(1, math.inf, low_in=True, whole=True)


class Alarm(NamedTuple):
    """One alarm of a family: its threshold's default and `Range`, the `GRPOConfigExt` field that held it before
    `alarm_thresholds` (`was`; `None` for an alarm added since), and its tier (of `SEVERITIES`)."""

    default: float
    range: Range
    was: str | None = None
    severity: str = "warning"


class Rule:
    """A family of alarms on one concern: a subclass lists its alarms (`alarms`: name -> `Alarm`) and judges each in
    the method of the alarm's name, whose warning ends with what to change (each alarm's advice is written there, or
    once for the family, and nowhere else). An instance judges one alarm of its family.

    `judge(entry)` reads one log entry (what `Trainer.log` records: a callback's `logs`, or an item of
    `trainer_state.json`'s `log_history`) and returns the warning when the alarm's condition holds, `False` when it
    does not, `None` when the entry does not tell (the metric was not logged in it). A rule keeps the history it needs,
    so it must see the entries in order, each once.

    Args:
        name (`str`): the alarm, a key of `alarms`; counted as `alarms/<name>`.
        threshold (`float`): its threshold.
        settings: the run's alarm settings (`patience`, `auxiliary`), taken by the families that use them.
    """

    alarms: ClassVar[dict[str, Alarm]] = {}

    def __init__(self, name: str, threshold: float, **settings):
        if name not in self.alarms:
            raise ValueError(f"{type(self).__name__} judges {list(self.alarms)}, not {name!r}.")
        self.name, self.threshold = name, threshold
        #: The tier of the verdict just given: the alarm's, or one its method sets.
        self.severity = self.alarms[name].severity
        self.condition = getattr(self, name)

    def judge(self, entry: Mapping) -> str | bool | None:
        return self.condition(entry)

    def pending(self) -> str:
        """What the rule needs before it judges, for a run that ended before it did (`report`'s "too short")."""
        return "more log entries"

    def tag(self) -> str:
        """The suffix of every warning: the metric that counts it and the setting of its threshold."""
        return f" [alarms/{self.name}; alarm_thresholds['{self.name}']={self.threshold:g}, None switches it off]"


def number(entry: Mapping, key: str) -> float | None:
    """`entry[key]` when it is a logged finite number; `None` otherwise: NaN (TRL's "no value"), an infinite value
    (the rules of a level read those themselves), or no number at all."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def first_number(entry: Mapping, keys: tuple[str, ...]) -> tuple[str, float] | tuple[None, None]:
    """The first of `keys` logged as a finite number in `entry`, and its value."""
    for key in keys:
        value = number(entry, key)
        if value is not None:
            return key, value
    return None, None


def level(entry: Mapping, key: str) -> float | None:
    """`entry[key]` when it is a number, infinite or NaN included (a level that is not finite is alarming)."""
    value = entry.get(key)
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)


def step_of(entry: Mapping) -> float | None:
    """The entry's training step (`log_history`'s, or the one `AnomalyMonitor.check` adds live), `None` if none."""
    step = entry.get("step")
    return None if number(entry, "step") is None else step


def mean(values) -> float:
    """The arithmetic mean in plain float arithmetic: values near the float range overflow to inf, where
    `statistics.fmean`'s exact sum raises (a log holds whatever a run wrote)."""
    values = list(values)
    return sum(values) / len(values)


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of two equally long series, `None` when either is constant (or shorter than 2)."""
    if len(xs) < 2:
        return None
    mean_x, mean_y = mean(xs), mean(ys)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mean_x) * (x - mean_x) for x in xs)
    syy = sum((y - mean_y) * (y - mean_y) for y in ys)
    if not sxx > 0 or not syy > 0 or not math.isfinite(sxx * syy):
        return None
    return sxy / math.sqrt(sxx * syy)


def curvature_t(values: list[float]) -> float:
    """The t statistic of the curvature of `values` against their index: the coefficient `c` of a least-squares fit
    `a + b x + c (x^2 - mean x^2)` (x the centred index: the three terms are orthogonal) over its standard error
    `s / sqrt(sum((x^2 - mean x^2)^2))`, `s^2` the residuals' variance over `n - 3`. Positive where the series
    accelerates, about 0 for a straight line, negative where a rise slows. 0 for fewer than 4 values or an exact
    line; +-inf for an exact curve."""
    n = len(values)
    if n < 4:
        return 0.0
    middle = (n - 1) / 2
    xs = [i - middle for i in range(n)]
    mean_square = sum(x * x for x in xs) / n
    squares = [x * x - mean_square for x in xs]
    level_ = mean(values)
    slope = sum(x * y for x, y in zip(xs, values, strict=True)) / sum(x * x for x in xs)
    spread = sum(q * q for q in squares)
    curvature = sum(q * y for q, y in zip(squares, values, strict=True)) / spread
    residuals = [y - level_ - slope * x - curvature * q for x, q, y in zip(xs, squares, values, strict=True)]
    error = math.sqrt(sum(r * r for r in residuals) / (n - 3) / spread)
    scale = max(abs(value) for value in values)
    if not error > 1e-12 * scale:  # an exact line or curve: rounding decides nothing
        return 0.0 if abs(curvature) <= 1e-12 * scale else math.copysign(math.inf, curvature)
    return curvature / error


def robust_spread(values: list[float]) -> float:
    """1.4826 times the median absolute deviation of `values`: a normal's standard deviation, robust to outliers."""
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(value - middle) for value in values)


class Cadence:
    """How many training steps lie between a metric's log entries (the median of the last `GAPS` gaps; 1 until two
    entries with a step are seen). A window stated in training steps spans `entries(steps, least)` log entries."""

    GAPS = 10

    def __init__(self):
        self.last: float | None = None
        self.gaps: list[float] = []

    def add(self, step: float | None) -> None:
        """Count an entry of the metric logged at `step` (`None`: an entry without a step, which tells nothing)."""
        if step is None:
            return
        if self.last is not None and step > self.last:
            self.gaps = (self.gaps + [step - self.last])[-self.GAPS :]
        self.last = step

    def interval(self) -> float:
        return statistics.median(self.gaps) if self.gaps else 1.0

    def entries(self, steps: int, least: int) -> int:
        """The log entries a window of `steps` training steps spans, at least `least`."""
        return max(least, math.ceil(steps / self.interval()))


class Series:
    """A logged series' first `first_size` values (those `add` admits to the start) and its last `last_size`."""

    def __init__(self, first_size: int, last_size: int):
        self.first_size, self.last_size = first_size, last_size
        self.first: list[float] = []
        self.last: list[float] = []
        self.seen = 0

    def add(self, value: float, start: bool = True) -> None:
        """Add a logged value; `start=False` keeps it out of the first values."""
        if start and len(self.first) < self.first_size:
            self.first.append(value)
        self.last = (self.last + [value])[-self.last_size :]
        self.seen += 1

    def full(self) -> bool:
        return len(self.first) == self.first_size and len(self.last) == self.last_size

    def start(self) -> float:
        return statistics.median(self.first)

    def now(self) -> float:
        return statistics.median(self.last)


class RunningMedian:
    """A metric's running median over the last `steps` training steps, as the run logs it: over
    `Cadence.entries(steps, least)` log entries. `add` returns `None` until the window is full.

    Its noise `sigma` is the robust spread of the last `HISTORY` differences between successive values over sqrt(2),
    which a trend does not inflate. `error` is the standard error of the running median, `1.2533 sigma / sqrt(n)`
    over `n` values; `step_error` that of a median over `steps` steps logged one by one, at least `error`."""

    HISTORY = 200

    def __init__(self, steps: int, least: int):
        self.steps, self.least = steps, least
        self.cadence = Cadence()
        self.values: list[float] = []
        self.differences: list[float] = []
        self.size = least  # the entries of the last window

    def add(self, value: float, step: float | None) -> float | None:
        self.cadence.add(step)
        self.size = self.cadence.entries(self.steps, self.least)
        if self.values:
            self.differences = (self.differences + [value - self.values[-1]])[-self.HISTORY :]
        self.values = (self.values + [value])[-max(self.steps, self.least) :]
        return statistics.median(self.values[-self.size :]) if len(self.values) >= self.size else None

    def sigma(self) -> float:
        return robust_spread(self.differences) / math.sqrt(2)

    def error(self) -> float:
        return 1.2533 * self.sigma() / math.sqrt(self.size)

    def step_error(self) -> float:
        return 1.2533 * self.sigma() * math.sqrt(max(self.cadence.interval() / self.steps, 1 / self.size))
