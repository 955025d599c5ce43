"""Guardrails of a long run, one module each:

- `nonfinite`: keeps optimizer steps with a NaN or infinite loss or gradient off the weights (skip or stop);
- `alarms`: the alarm rules, each judging one log entry at a time (used live and by `trl_grpo_ext.health`);
- `anomaly`: warns, from the logged metrics, about runs that stopped learning or drift, and counts the alarms;
- `reward_errors`: names the reward function and the completion behind an exception.
"""

from .alarms import ALARM_FIELDS, RULES
from .anomaly import AnomalyMonitor, Episode
from .nonfinite import NONFINITE_POLICIES, NonFiniteGuard, NonFiniteGuardMixin, NonFiniteTrainingError, StepVerdict
from .reward_errors import GuardedAsyncReward, GuardedReward, RewardFunctionError

__all__ = [
    "ALARM_FIELDS",
    "NONFINITE_POLICIES",
    "RULES",
    "AnomalyMonitor",
    "Episode",
    "GuardedAsyncReward",
    "GuardedReward",
    "NonFiniteGuard",
    "NonFiniteGuardMixin",
    "NonFiniteTrainingError",
    "RewardFunctionError",
    "StepVerdict",
]
