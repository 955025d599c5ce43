"""Guardrails of a long run, one module each:

- `nonfinite`: keeps optimizer steps with a NaN or infinite loss or gradient off the weights (skip or stop);
- `alarms`: one record per alarm (`ALARMS`: rule, threshold field, default, range, help, its docs table row), each
  rule judging one log entry at a time (used live and by `trl_grpo_ext.report.health`); the record type in `alarm`,
  the records in `step_alarms` and `course_alarms`; the rules in `rule` (what a rule is),
  `step_rules` (one step's values), `trend_rules` (against the run's history), `progress_rules` (still progressing);
- `anomaly`: warns, from the logged metrics, about runs that stopped learning or drift, and counts the alarms;
- `reward_errors`: names the reward function and the completion behind an exception or a bad value;
- `launch`: refuses processes that a launcher started but that would train apart.
"""

from __future__ import annotations

from .. import _exported_lazily

__all__ = [
    "ALARMS",
    "ALARM_FIELDS",
    "NONFINITE_POLICIES",
    "Alarm",
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

# The names are loaded on first use, as the package's own: `config` reads the alarm records (`guardrails.alarms`)
# without loading the monitor, the non-finite guard and the reward guards.
_HOMES = {
    "ALARMS": ".alarms",
    "ALARM_FIELDS": ".alarms",
    "Alarm": ".alarms",
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
