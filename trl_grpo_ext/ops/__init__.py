"""The objective as pure tensor code (torch only: nothing here imports TRL or transformers).

- `objective`: `grpo_loss` (DeepSeekMath's GRPO objective), `policy_objective` (every TRL loss type, the formula that
  trains) and `total_loss` (the entropy bonus and the router loss added to it);
- `terms`: the policy terms and aggregations, each written once; `loss_types`: one record per loss type;
- `fused`: the opt-in kernel of the clipped-surrogate rows (analytic gradient, eager or compiled);
- `numerics`: the exponentials continued linearly above a threshold; `validation`: the checks of the inputs;
- `advantages`: group-relative advantages.
"""

from .advantages import NO_SPREAD_STD, group_relative_advantages, has_spread
from .loss_types import LOSS_TYPES, LossType, register_loss_type, register_policy_term
from .numerics import EXP_LINEAR_ABOVE
from .objective import IMPLEMENTATIONS, GRPOLossOutput, ObjectiveOptions, grpo_loss, policy_objective, total_loss
from .validation import hyperparameter_problems

__all__ = [
    "EXP_LINEAR_ABOVE",
    "IMPLEMENTATIONS",
    "LOSS_TYPES",
    "NO_SPREAD_STD",
    "GRPOLossOutput",
    "LossType",
    "ObjectiveOptions",
    "group_relative_advantages",
    "grpo_loss",
    "has_spread",
    "hyperparameter_problems",
    "policy_objective",
    "register_loss_type",
    "register_policy_term",
    "total_loss",
]
