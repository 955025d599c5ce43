"""The alarm rules that judge whether the run is still making progress: the reward's plateau."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from .rule import Rule, _number


def slope_t(values: list[float]) -> float:
    """The t statistic of the least-squares slope of `values` against their index: the slope over its standard
    error, `b / (s / sqrt(sum((i - mean i)^2)))` with `s^2` the residuals' variance over `n - 2`. 0 for a constant
    series (no trend) or fewer than 3 values; +-inf for an exact line."""
    n = len(values)
    if n < 3:
        return 0.0
    mean_i, mean_v = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((i - mean_i) ** 2 for i in range(n))
    slope = sum((i - mean_i) * (v - mean_v) for i, v in enumerate(values)) / sxx
    residual = sum((v - mean_v - slope * (i - mean_i)) ** 2 for i, v in enumerate(values)) / (n - 2)
    if residual <= 1e-24:
        return 0.0 if abs(slope) <= 1e-12 else math.copysign(math.inf, slope)
    return slope / math.sqrt(residual / sxx)


def _function_means(entry: Mapping) -> dict[str, float]:
    """Each reward function's logged mean (`rewards/<name>/mean`), where it is a number."""
    means = {}
    for key in entry:
        if key.startswith("rewards/") and key.endswith("/mean"):
            value = _number(entry, key)
            if value is not None:
                means[key.removeprefix("rewards/").removesuffix("/mean")] = value
    return means


class PlateauRule(Rule):
    """The reward made no progress for `threshold` log steps: its running median (over `SMOOTH` log steps) has not
    risen above its best by more than `NOISE_SE` standard errors of such a median since then. The standard error is
    `1.2533 sigma / sqrt(SMOOTH)` (a median of normal noise), `sigma` the scatter of the reward's last `SMOOTH`
    values (their median absolute deviation times 1.4826), so a noisy but rising reward keeps setting new bests and a
    flat one stops; 1.5, not 1: the best is the luckiest median so far, and a flat reward's medians beat it by one
    standard error now and then, which would end a plateau by chance. A run that never improves at all is a plateau
    from its start. A `note`: a converged run plateaus too, and then its remaining steps cost compute for nothing."""

    keys = ("reward",)
    SMOOTH = 10  # log steps of the running median
    NOISE_SE = 1.5
    severity = "note"

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.recent: list[float] = []
        self.best: float | None = None
        self.since = 0  # log steps since the best was set

    def judge(self, entry):
        value = _number(entry, "reward")
        if value is None:
            return None
        self.recent = (self.recent + [value])[-self.SMOOTH :]
        if len(self.recent) < self.SMOOTH:
            return False
        median = statistics.median(self.recent)
        deviation = statistics.median(abs(v - median) for v in self.recent)
        noise = self.NOISE_SE * 1.2533 * 1.4826 * deviation / math.sqrt(self.SMOOTH)
        if self.best is None or median > self.best + noise:
            self.best, self.since = median, 0
            return False
        self.since += 1
        if self.since < self.threshold:
            return False
        return (
            f"the reward has not improved for {self.since} log steps: its running median ({median:.3g}, over "
            f"{self.SMOOTH} log steps) stays within its noise of its best ({self.best:.3g}). The run has converged "
            "or stopped learning; if the held-out metric is flat too, stop it, or change what limits it (harder "
            "prompts, a higher learning_rate, more num_generations or temperature)."
        )
