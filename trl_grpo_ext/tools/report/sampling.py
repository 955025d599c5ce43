"""The share of a run's generation spent on groups without reward spread, and whether `dynamic_sampling` or
`selective_rollouts` would pay (docs/sampling.md)."""

from __future__ import annotations

import math

from ...metrics import (
    DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
    FRAC_REWARD_ZERO_STD,
    REWARD_STD_FRAC_ZERO_GROUPS,
    SELECTIVE_ROLLOUTS_PRECISION,
)
from .health import _values

#: The share of generated groups without reward spread, in order of preference.
FLAT_KEYS = (
    DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
    REWARD_STD_FRAC_ZERO_GROUPS,
    FRAC_REWARD_ZERO_STD,
)
PRECISION_KEY = SELECTIVE_ROLLOUTS_PRECISION
#: Below this flat share, the sampling options have little generation to save.
FEW_FLAT = 0.2
#: Prompts must recur for their history to predict anything: at least this many epochs.
RECURRING_EPOCHS = 2.0
#: Flatness is predictable when a prompt predicted flat has spread at most this share as often as any prompt.
PREDICTABLE_ERROR = 0.5


def _mean(log_history: list[dict], key: str) -> float | None:
    values = [value for _, value in _values(log_history, key) if math.isfinite(value)]
    return sum(values) / len(values) if values else None


def sampling_summary(log_history: list[dict]) -> dict | None:
    """The share of generation spent on groups without reward spread, and what would save it.

    Returns:
        `None` without any of `FLAT_KEYS`, else `flat_share` (the mean of the first logged), `flat_share_late` (over
        the last quarter of the entries), `epochs`, `precision` (the mean `selective_rollouts/precision`) and
        `message` (`None` where fewer than `FEW_FLAT` of the groups were flat: nothing to change).
    """
    key = next((key for key in FLAT_KEYS if _values(log_history, key)), None)
    if key is None:
        return None
    values = [value for _, value in _values(log_history, key)]
    flat = sum(values) / len(values)
    late_values = values[len(values) * 3 // 4 :]
    late = sum(late_values) / len(late_values)
    epochs = max((value for _, value in _values(log_history, "epoch")), default=None)
    precision = _mean(log_history, PRECISION_KEY)
    message = None
    if max(flat, late) >= FEW_FLAT:
        message = (
            f"sampling: in {flat:.0%} of the groups generated ({late:.0%} in the last quarter) every completion "
            "scored the same: such a group teaches nothing and costs a full generation; "
        )
        replace = "dynamic_sampling=True replaces those groups with new ones (more generation per step)"
        skipping = "skipping the prompts predicted to score alike (selective_rollouts)"
        if precision is not None and 1.0 - precision <= PREDICTABLE_ERROR * (1.0 - flat):
            message += f"{skipping} was right {precision:.0%} of the time: it pays here"
        elif precision is not None:
            message += (
                f"{skipping} was right {precision:.0%} of the time, not much more than the {flat:.0%} of any prompt: "
                f"it saves little here; {replace}"
            )
        elif epochs is not None and epochs >= RECURRING_EPOCHS:
            message += (
                f"{replace}; the prompts recur ({epochs:.2g} passes over the training set): selective_rollouts=True "
                "skips the ones whose last visits scored alike, before generating them"
            )
        else:
            message += replace
    return {"flat_share": flat, "flat_share_late": late, "epochs": epochs, "precision": precision, "message": message}
