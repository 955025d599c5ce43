"""Guardrails of a long run, one module each:

- `nonfinite`: keeps optimizer steps with a NaN or infinite loss or gradient off the weights (skip or stop);
- `alarms`: the alarms, one rule class per family (`ALARMS`: alarm name -> its family), each judging one log entry
  at a time, live and in `trl-grpo-ext report`;
- `anomaly`: `AnomalyMonitor` gives the alarms during training and counts them; `AlarmSettings` keeps a run's;
- `reward_errors`: names the reward function and the completion behind an exception or a bad value;
- `launch`: refuses processes that a launcher started but that would train apart.
"""

from __future__ import annotations

from .. import _exported_lazily

__all__ = [
    "ALARMS",
    "NONFINITE_POLICIES",
    "AlarmSettings",
    "AnomalyMonitor",
    "Episode",
    "GuardedAsyncReward",
    "GuardedReward",
    "NonFiniteGuard",
    "NonFiniteEnforcer",
    "NonFiniteTrainingError",
    "RewardFunctionError",
    "StepVerdict",
]

# The names are loaded on first use, as the package's own: `config` reads the alarms (`guardrails.alarms`) without
# loading the monitor, the non-finite guard and the reward guards.
_HOMES = {
    "ALARMS": ".alarms",
    "AlarmSettings": ".anomaly",
    "AnomalyMonitor": ".anomaly",
    "Episode": ".anomaly",
    "NONFINITE_POLICIES": ".nonfinite",
    "NonFiniteEnforcer": ".nonfinite",
    "NonFiniteGuard": ".nonfinite",
    "NonFiniteTrainingError": ".nonfinite",
    "StepVerdict": ".nonfinite",
    "GuardedAsyncReward": ".reward_errors",
    "GuardedReward": ".reward_errors",
    "RewardFunctionError": ".reward_errors",
}


__getattr__, __dir__ = _exported_lazily(__name__, _HOMES)
