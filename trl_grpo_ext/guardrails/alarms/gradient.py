"""The gradient norm: no gradient, a spike, a gradient that vanishes (`Gradient`)."""

from __future__ import annotations

import math
import statistics

from ...metrics import GRAD_NORM
from .rule import FACTOR, FRACTION, SKIPPED_STEPS_KEY, STEPS, Alarm, Rule, Series, level, number

__all__ = ["Gradient"]


class Gradient(Rule):
    """`grad_norm`:

    - `no_gradient`: exactly 0 for `threshold` log steps in a row: no update moves the weights;
    - `grad_norm_spike`: above `threshold` times the median of its last `HISTORY` values above `FLOOR` (judged once
      `MIN_HISTORY` are there; a median below `FLOOR` counts as `FLOOR`), or not finite. Norms at or below `FLOOR`
      (steps without reward spread) stay out of the median. A non-finite norm logged where the non-finite guard's
      count rose since the last entry is a step the guard skipped (its update never reached the weights): no spike;
    - `vanishing_gradient`: the median of its last `RECENT` values is above 0 and below `threshold` times the
      median of its first `BASELINE` values above 0 (`grad_norm` is taken before the learning rate scales the
      update: a schedule is no cause).
    """

    alarms = {
        "no_gradient": Alarm(3, STEPS, "warn_zero_grad_steps"),
        "grad_norm_spike": Alarm(10.0, FACTOR, "warn_grad_norm_spike"),
        "vanishing_gradient": Alarm(0.2, FRACTION, "warn_grad_norm_vanish"),
    }
    FLOOR = 1e-3
    HISTORY = 20
    MIN_HISTORY = 5
    BASELINE = RECENT = 5

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.streak = 0  # no_gradient
        self.history: list[float] = []  # grad_norm_spike
        self.skipped = 0.0  # the guard's count at the last entry that logged it
        self.norms = Series(self.BASELINE, self.RECENT)  # vanishing_gradient

    def no_gradient(self, entry):
        value = level(entry, GRAD_NORM)
        if value is None or math.isnan(value):
            return None
        self.streak = self.streak + 1 if value == 0.0 else 0
        if self.streak < self.threshold:
            return False
        return (
            f"grad_norm has been 0 for {self.streak} log steps: nothing is learned. Every advantage is 0 (no reward "
            "spread, or no completion scored), every token is clipped, or the trainable parameters get no gradient "
            "(check requires_grad and the LoRA target modules)."
        )

    def grad_norm_spike(self, entry):
        skipped = number(entry, SKIPPED_STEPS_KEY)
        guard_skipped = skipped is not None and skipped > self.skipped
        if skipped is not None:
            self.skipped = skipped
        value = level(entry, GRAD_NORM)
        if value is None:
            return None
        if not math.isfinite(value):
            if guard_skipped:
                return None
            return (
                f"grad_norm is {value}: a loss or gradient was not finite. nonfinite_policy='skip' (the default) "
                "keeps such updates off the weights; lower the learning_rate if it recurs."
            )
        baseline = statistics.median(self.history) if len(self.history) >= self.MIN_HISTORY else None
        if value > self.FLOOR:
            self.history = (self.history + [value])[-self.HISTORY :]
        if baseline is None:
            return None  # too few values to judge yet
        if value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"grad_norm spiked to {value:.3g}, {value / max(baseline, self.FLOOR):.0f}x its running median "
            f"{baseline:.3g}: spikes like this often precede a collapse. Lower the learning_rate, set or lower "
            "max_grad_norm, or raise beta."
        )

    def vanishing_gradient(self, entry):
        value = number(entry, GRAD_NORM)
        if value is None:
            return None
        self.norms.add(value, start=value > 0)
        if not self.norms.full():
            return None  # too few values to judge yet
        start, now = self.norms.start(), self.norms.now()
        if now <= 0 or now >= self.threshold * start:
            return False
        return (
            f"grad_norm fell to {now:.3g} (median of the last {self.RECENT} log steps), {now / start:.1%} of its "
            f"start ({start:.3g}): the updates vanish without stopping. Check the reward spread "
            "(frac_reward_zero_std: advantages near 0 everywhere), the loss's scale (loss_type, a gradient "
            "accumulation or scaling bug), and whether most tokens are clipped."
        )
