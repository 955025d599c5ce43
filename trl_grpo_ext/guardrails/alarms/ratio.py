"""The importance ratio `pi / pi_old` (`Ratio`) and the clipping of the surrogate (`Clip`)."""

from __future__ import annotations

import math

from ...metrics import CLIP_RATIO_HIGH_MEAN, CLIP_RATIO_LOW_MEAN, CLIP_RATIO_REGION_MEAN, RATIO_MAX, RATIO_P95
from .rule import FACTOR, SHARE, Alarm, Rule, level, number

__all__ = ["Clip", "Ratio"]


class Ratio(Rule):
    """`ratio_p95`, `ratio_max`: `ratio/p95` or `ratio/max` above `threshold`, or not finite."""

    alarms = {"ratio_p95": Alarm(1.5, FACTOR, "warn_ratio_p95"), "ratio_max": Alarm(100.0, FACTOR, "warn_ratio_max")}

    def ratio_p95(self, entry):
        return self._above(entry, RATIO_P95)

    def ratio_max(self, entry):
        return self._above(entry, RATIO_MAX)

    def _above(self, entry, key: str):
        value = level(entry, key)
        if value is None:
            return None
        if math.isfinite(value) and value <= self.threshold:
            return False
        return (
            f"{key} = {value:.3g} exceeds {self.threshold:g}: the policy moved far from the one that sampled the "
            "completions. Lower the learning_rate or num_iterations; with vLLM, check that it samples with the same "
            "weights and sampling settings as the trainer."
        )


class Clip(Rule):
    """The clipped surrogate's flat, zero-gradient region:

    - `clip_fraction`: `clip_ratio/region_mean` above `threshold` for `patience` log steps in a row;
    - `clip_asymmetry`: one side does the clipping: `clip_ratio/low_mean` (negative-advantage tokens below
      `1 - epsilon`) or `clip_ratio/high_mean` (positive-advantage tokens above `1 + epsilon_high`) at least
      `threshold` times the other (counted as at least `FLOOR`), the larger at least `MIN_CLIPPED`, at each of
      `WINDOW` log steps in a row. Mostly high caps the gains of good completions' rare tokens and goes with
      entropy collapse; mostly low pushes the policy off bad completions' tokens faster than it gains on good ones.

    Args:
        patience (`int`): `clip_fraction`'s log steps in a row (`warn_patience`).
    """

    alarms = {
        "clip_fraction": Alarm(0.2, SHARE, "warn_clip_fraction"),
        "clip_asymmetry": Alarm(3.0, FACTOR, "warn_clip_asymmetry"),
    }
    advice = "Lower the learning_rate or num_iterations, or widen epsilon."
    FLOOR = 0.005  # on-policy steps clip nothing on either side
    MIN_CLIPPED = 0.05
    WINDOW = 5

    def __init__(self, name: str, threshold: float, patience: int = 3, **settings):
        super().__init__(name, threshold)
        self.patience = patience
        self.streak = 0

    def clip_fraction(self, entry):
        value = number(entry, CLIP_RATIO_REGION_MEAN)
        if value is None:
            return None
        self.streak = self.streak + 1 if value > self.threshold else 0
        if self.streak < self.patience:
            return False
        return (
            f"clip_ratio/region_mean has stayed above {self.threshold:g} for {self.streak} log steps "
            f"({value:.2f} now): many tokens sit in the flat, zero-gradient part of the surrogate. {self.advice}"
        )

    def clip_asymmetry(self, entry):
        low, high = number(entry, CLIP_RATIO_LOW_MEAN), number(entry, CLIP_RATIO_HIGH_MEAN)
        if low is None or high is None:
            return None
        larger, smaller = max(low, high), min(low, high)
        lopsided = larger >= self.MIN_CLIPPED and larger >= self.threshold * max(smaller, self.FLOOR)
        self.streak = self.streak + 1 if lopsided else 0
        if self.streak < self.WINDOW:
            return False
        if low > high:
            side = (
                f"clip_ratio/low_mean {low:.2f} against high_mean {high:.2f}: tokens of negative-advantage "
                f"completions are pushed below 1 - epsilon much more than good ones gain. {self.advice}"
            )
        else:
            side = (
                f"clip_ratio/high_mean {high:.2f} against low_mean {low:.2f}: the gains of positive-advantage tokens "
                "are capped at 1 + epsilon_high, which starves rare good tokens and precedes entropy collapse. Widen "
                "epsilon_high (clip-higher, e.g. 0.28) or lower the learning_rate."
            )
        return f"for {self.streak} log steps one side of the clip range has done the clipping, {side}"
