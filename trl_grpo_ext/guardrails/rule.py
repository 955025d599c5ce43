"""What every alarm rule is: `Rule` (a condition judged on one log entry at a time), the severity tiers, and the
helpers that read a logged number out of an entry. The rules themselves are in `step_rules.py` (one step's values),
`trend_rules.py` (a value against the run's own history) and `progress_rules.py` (whether the run is learning); their
records (`ALARMS`) in `alarms.py`.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping

from ..metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO,
    FRAC_REWARD_ZERO_STD,
    NONFINITE_SKIPPED_STEPS,
    REWARD_STD_FRAC_ZERO_GROUPS,
)

__all__ = [
    "Cadence",
    "HELDOUT_KEY",
    "SEVERITIES",
    "SKIPPED_STEPS_KEY",
    "TRUNCATION_KEYS",
    "ZERO_SPREAD_KEYS",
    "Rule",
    "curvature_t",
    "mean",
    "pearson",
]

#: The severity tiers of the alarms and of the report's verdicts, lowest first.
SEVERITIES = ("ok", "note", "warning", "critical")

#: A held-out metric's mean over k completions per prompt (`heldout/<metric>/mean@<k>`), also with `eval_` in front.
HELDOUT_KEY = re.compile(r"^(?:eval_)?heldout/(?P<metric>.+)/mean@(?P<k>\d+)$")


def _number(entry: Mapping, key: str) -> float | None:
    """`entry[key]` when it is a logged finite number; `None` otherwise: NaN (TRL logs `None` or NaN for "no value"),
    an infinite value (the rules of a level read those from the entry themselves: `RatioRule`, `KLHighRule`,
    `GradNormSpikeRule`; `report` fails the signal), or no number at all. Statistics over a history are taken over
    finite values only."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _step(entry: Mapping) -> float | None:
    """The entry's training step (`step`: `log_history`'s, or the one `AnomalyMonitor.check` adds live), `None` when
    it holds none."""
    step = entry.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return step


def mean(values) -> float:
    """The arithmetic mean in plain float arithmetic: values near the float range overflow to inf, where
    `statistics.fmean`'s exact sum raises (a log holds whatever a run wrote)."""
    values = list(values)
    return sum(values) / len(values)


#: The share of groups without reward spread: this package's, judged on each group (`reward_std/frac_zero_groups`),
#: else TRL's (`frac_reward_zero_std`, which under `scale_rewards="batch"` tests the batch's std instead).
ZERO_SPREAD_KEYS = (REWARD_STD_FRAC_ZERO_GROUPS, FRAC_REWARD_ZERO_STD)


def _first_number(entry: Mapping, keys: tuple[str, ...]) -> tuple[str, float] | tuple[None, None]:
    """The first of `keys` logged as a number in `entry`, and its value."""
    for key in keys:
        value = _number(entry, key)
        if value is not None:
            return key, value
    return None, None


def _not_a_number(value) -> bool:
    """A logged value that says "nothing": `None`, or NaN (how TRL logs the mean of a reward that scored nothing)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of two equally long series, `None` when either is constant (or shorter than 2).

    r = sum((x - mean x)(y - mean y)) / sqrt(sum((x - mean x)^2) * sum((y - mean y)^2))
    """
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
    `a + b x + c (x^2 - mean x^2)` (x the index, centred: the three terms are orthogonal) over its standard error
    `s / sqrt(sum((x^2 - mean x^2)^2))`, `s^2` the residuals' variance over `n - 3`. Positive where the series
    accelerates (an exponential or quadratic rise), about 0 for a straight line however steep, negative where a rise
    slows or stops. 0 for fewer than 4 values or an exact line; +-inf for an exact curve."""
    n = len(values)
    if n < 4:
        return 0.0
    middle = (n - 1) / 2
    xs = [i - middle for i in range(n)]
    mean_square = sum(x * x for x in xs) / n
    squares = [x * x - mean_square for x in xs]
    level = mean(values)
    slope = sum(x * y for x, y in zip(xs, values, strict=True)) / sum(x * x for x in xs)
    spread = sum(q * q for q in squares)
    curvature = sum(q * y for q, y in zip(squares, values, strict=True)) / spread
    residuals = [y - level - slope * x - curvature * q for x, q, y in zip(xs, squares, values, strict=True)]
    error = math.sqrt(sum(r * r for r in residuals) / (n - 3) / spread)
    scale = max(abs(value) for value in values)
    if not error > 1e-12 * scale:  # an exact line or curve: rounding decides nothing
        return 0.0 if abs(curvature) <= 1e-12 * scale else math.copysign(math.inf, curvature)
    return curvature / error


class Cadence:
    """How many training steps lie between a metric's log entries. A run logs every `logging_steps` (1, 10, 50...),
    and TRL logs each metric's mean over the steps since the last entry; a window stated in training steps spans
    `entries(steps, least)` entries: at one entry per step that many, and never fewer than `least`, the entries a
    median and a scatter need. The interval is the median of the last gaps between the metric's entries (1 until
    two entries with a step are seen)."""

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
    """A logged series as the trend rules read it: its first `first_size` values (those `add` admits to the start)
    and its last `last_size`, and how many were added."""

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
        """Both windows hold all their values."""
        return len(self.first) == self.first_size and len(self.last) == self.last_size

    def start(self) -> float:
        return statistics.median(self.first)

    def now(self) -> float:
        return statistics.median(self.last)

    def scatter(self) -> float:
        """The last values' scatter: 1.4826 times their median absolute deviation (a normal's standard deviation)."""
        now = self.now()
        return 1.4826 * statistics.median(abs(value - now) for value in self.last)


class Rule:
    """The condition of one alarm: `judge` (see the module docstring); `name` and `field` are its record's
    (`ALARMS`)."""

    name: str = ""
    field: str = ""
    #: The logged metrics it reads (the report names them when none was logged).
    keys: tuple[str, ...] = ()
    #: The tier of the verdict just given (of `SEVERITIES`): a rule with tiers sets it in `judge`.
    severity: str = "warning"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def judge(self, entry: Mapping) -> str | bool | None:
        raise NotImplementedError

    def pending(self) -> str:
        """What the rule needs before it judges, for a run that ended before it did (`report`'s "too short to
        judge")."""
        return "more log entries"

    def tag(self) -> str:
        """The suffix of every warning: the metric that counts it and the field that sets (or switches off) it."""
        return f" [alarms/{self.name}; {self.field}={self.threshold:g}, None switches it off]"


#: The truncated share of the batch that trains (see `LengthDriftRule.LENGTH_KEYS`), else of every completion.
TRUNCATION_KEYS = (DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO, COMPLETIONS_CLIPPED_RATIO)

#: The non-finite guard's count of the optimizer steps it skipped so far (`GRPOTrainerExt` logs it with every
#: training entry unless `nonfinite_policy="off"`).
SKIPPED_STEPS_KEY = NONFINITE_SKIPPED_STEPS
