"""How much of a run's generation went to groups without reward spread, and whether the sampling options would pay.

A group whose completions all got the same reward gives no policy gradient: the generation spent on it is lost.
`dynamic_sampling` replaces such groups (at the cost of more generation), `selective_rollouts` skips, before
generation, the prompts whose last visits were flat. Whether either pays depends on the data: the share of flat
groups, whether prompts recur (several epochs) and how well one visit's flatness predicts the next
(`selective_rollouts/precision`, logged when the option ran). `sampling_summary` reads these from a log history and
says so in one line; the thresholds come from the learning benchmark (docs/performance.md).
"""

from __future__ import annotations

import math

from ..metrics import (
    DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
    FRAC_REWARD_ZERO_STD,
    REWARD_STD_FRAC_ZERO_GROUPS,
    SELECTIVE_ROLLOUTS_PRECISION,
)
from .health import _values

__all__ = ["FLAT_KEYS", "sampling_summary"]

#: The share of generated groups without reward spread, in order of preference: every round of dynamic sampling,
#: this package's per-group share, TRL's own (the share of completions in such groups: the same for equal groups).
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
    """The share of generation spent on groups without reward spread, and what it says about `dynamic_sampling` and
    `selective_rollouts`.

    Returns:
        `None` when the run logged none of `FLAT_KEYS`, else a dict with `flat_share` (the mean of the first of
        `FLAT_KEYS` logged), `flat_share_late` (its mean over the last quarter of the log entries), `epochs` (the last
        `epoch` logged, or `None`), `precision` (the mean `selective_rollouts/precision`, or `None`) and `message`:
        one line with the shares and, from them, whether the options would pay.
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
    message = f"sampling: {flat:.0%} of the groups generated had no reward spread ({late:.0%} in the last quarter)"
    if max(flat, late) < FEW_FLAT:
        message += "; dynamic_sampling and selective_rollouts have little generation to save"
    elif precision is not None:
        message += f"; a prompt selective_rollouts predicted flat was flat again {precision:.0%} of the time"
        if 1.0 - precision <= PREDICTABLE_ERROR * (1.0 - flat):
            message += ": flatness is predictable here, skipping pays"
        else:
            message += f", not much more than the {flat:.0%} of any prompt: skipping saves little on this data"
    elif epochs is not None and epochs < RECURRING_EPOCHS:
        message += (
            f"; the run went through its training set {epochs:.2g} times: selective_rollouts needs prompts that "
            "recur, dynamic_sampling=True replaces flat groups (more generation per step)"
        )
    else:
        message += (
            "; prompts recur: selective_rollouts=True may skip the flat ones before generation (compare its "
            "selective_rollouts/precision with this share), dynamic_sampling=True replaces them"
        )
    return {"flat_share": flat, "flat_share_late": late, "epochs": epochs, "precision": precision, "message": message}
