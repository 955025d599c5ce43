"""Guardrails of a long run, one module each:

- `nonfinite`: keeps optimizer steps with a NaN or infinite loss or gradient off the weights (skip or stop);
- `anomaly`: warns, from the logged metrics, about runs that stopped learning or drift;
- `reward_errors`: names the reward function and the completion behind an exception.
"""

from .anomaly import AnomalyMonitor
from .nonfinite import NONFINITE_POLICIES, NonFiniteGuard, NonFiniteGuardMixin, NonFiniteTrainingError, StepVerdict
from .reward_errors import GuardedAsyncReward, GuardedReward, RewardFunctionError

__all__ = [
    "NONFINITE_POLICIES",
    "AnomalyMonitor",
    "GuardedAsyncReward",
    "GuardedReward",
    "NonFiniteGuard",
    "NonFiniteGuardMixin",
    "NonFiniteTrainingError",
    "RewardFunctionError",
    "StepVerdict",
]
