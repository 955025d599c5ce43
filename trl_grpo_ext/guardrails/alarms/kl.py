"""How far the policy moves from the reference (`KL`) and whether it still explores (`Entropy`)."""

from __future__ import annotations

import math
import statistics

from ...metrics import ENTROPY
from ...metrics import KL as KL_KEY
from .rule import FACTOR, FRACTION, POSITIVE, Alarm, Rule, curvature_t, level, mean, number

__all__ = ["KL", "Entropy"]


class KL(Rule):
    """`kl`, the KL to the reference:

    - `kl_jump`: above `threshold` times the median of its last `HISTORY` values (judged once `MIN_HISTORY` are
      there; a median below `FLOOR` counts as `FLOOR`: every run's KL grows from 0);
    - `kl_high`: above `threshold`, or not finite: a level, seen from the first log step;
    - `kl_growth`: it keeps growing, faster and faster. With `now` the median of the last `SMOOTH` values and
      `m(d)` the same median `d` log steps earlier, it grows when `now >= threshold * m(LAG)`,
      `now >= sqrt(threshold) * m(LAG / 2)` and `now >= FLOOR_GROWTH`; an episode starts only where the KL
      accelerates (`curvature_t` of its last `LAG + SMOOTH` values at least `CURVATURE_T`: a rise from 0 is a
      straight line at best and bends down where it stops) and goes on while it grows. Judged from the
      `LAG + SMOOTH`th logged value.
    """

    alarms = {
        "kl_jump": Alarm(10.0, FACTOR, "warn_kl_jump"),
        "kl_high": Alarm(1.0, POSITIVE, "warn_kl_max"),
        "kl_growth": Alarm(2.0, FACTOR, "warn_kl_growth"),
    }
    advice = "Lower the learning_rate, raise beta, or check the rewards for hacking."
    FLOOR = 1e-2
    HISTORY = 10
    MIN_HISTORY = 5
    SMOOTH = 20
    LAG = 50
    FLOOR_GROWTH = 0.1
    CURVATURE_T = 3.0

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.history: list[float] = []  # kl_jump
        self.values: list[float] = []  # kl_growth: the last LAG + SMOOTH values
        self.growing = False  # kl_growth: in an episode

    def kl_jump(self, entry):
        value = number(entry, KL_KEY)
        if value is None:
            return None
        baseline = statistics.median(self.history) if len(self.history) >= self.MIN_HISTORY else None
        self.history = (self.history + [value])[-self.HISTORY :]
        if baseline is None:
            return None  # too few values to judge yet
        if value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"kl jumped to {value:.3g}, more than {self.threshold:g}x its recent median {baseline:.3g}: the policy is "
            f"leaving the reference fast. {self.advice}"
        )

    def kl_high(self, entry):
        value = level(entry, KL_KEY)
        if value is None:
            return None
        if math.isfinite(value) and value <= self.threshold:
            return False
        return (
            f"kl = {value:.3g} exceeds {self.threshold:g}: the policy is far from the reference (a KL blow-up). "
            f"{self.advice}"
        )

    def kl_growth(self, entry):
        value = number(entry, KL_KEY)
        if value is None:  # a non-finite KL is kl_high's
            return None
        self.values = (self.values + [value])[-(self.LAG + self.SMOOTH) :]
        if len(self.values) < self.LAG + self.SMOOTH:
            return None  # too few values to judge yet
        half = self.LAG // 2
        then = statistics.median(self.values[: self.SMOOTH])
        halfway = statistics.median(self.values[half : half + self.SMOOTH])
        now = statistics.median(self.values[-self.SMOOTH :])
        grows = (
            now >= self.FLOOR_GROWTH and now >= self.threshold * then and now >= math.sqrt(self.threshold) * halfway
        )
        self.growing = grows and (self.growing or curvature_t(self.values) >= self.CURVATURE_T)
        if not self.growing:
            return False
        factor = f" ({now / then:.1f}x)" if then > 0 else ""
        return (
            f"kl keeps growing: its median over the last {self.SMOOTH} log steps is {now:.3g}, up from {halfway:.3g} "
            f"{self.LAG - half} and {then:.3g} {self.LAG} log steps earlier{factor}. The policy is leaving the "
            f"reference faster and faster, a KL blow-up before kl_high's level. {self.advice}"
        )


class Entropy(Rule):
    """`entropy_collapse`: `entropy` below `threshold` times the mean of its first `BASELINE` logged values."""

    alarms = {"entropy_collapse": Alarm(0.1, FRACTION, "warn_entropy_collapse")}
    BASELINE = 3

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.first: list[float] = []

    def entropy_collapse(self, entry):
        value = number(entry, ENTROPY)
        if value is None:
            return None
        if len(self.first) < self.BASELINE:
            self.first.append(value)
            return None  # the baseline, not judged
        baseline = mean(self.first)
        if baseline <= 0 or value >= self.threshold * baseline:
            return False
        return (
            f"entropy fell to {value:.3g}, {value / baseline:.0%} of its first logged values ({baseline:.3g}): the "
            "policy stopped exploring, its completions of a prompt become alike and their rewards equal. Raise "
            "temperature, lower the learning_rate, widen epsilon_high (clip-higher, e.g. 0.28), or add an entropy "
            "bonus (entropy_coef)."
        )
