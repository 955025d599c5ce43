"""The alarm records (`ALARMS`): one `Alarm` per alarm (`alarm.py`), with its rule, its threshold's `GRPOConfigExt`
field, default, range and help, and its row of docs/diagnostics.md's alarm table, which `GRPOConfigExt`,
`AnomalyMonitor`, the report, the card and the docs read. The records are in `step_alarms.py` (a step's values) and
`course_alarms.py` (the run's course); a new alarm is one record there.

Each rule reads a run's log entries one at a time and says whether its failure mode holds now (`rule.Rule`; the rules
are in `step_rules.py`, `trend_rules.py` and `progress_rules.py`). An entry is what `Trainer.log` records: the dict a
callback's `on_log` gets, or one item of `trainer_state.json`'s `log_history`. `AnomalyMonitor` (`anomaly.py`) feeds
the rules live and gives each alarm once per episode; `trl_grpo_ext.report.health` feeds a finished run's history
through the same rules. Each rule:

- `name`, `field`: its record's;
- `judge(entry)`: the warning text when the condition holds, `False` when it does not, `None` when the entry does
  not tell (the metric was not logged in it: rewards are logged only at the steps that generate, for instance).

A rule keeps the history it needs (a running median, the first values, a streak), so a rule must see the entries
in order, each once. The names of the rules' module (`Rule`, `pearson`, the key constants) stay importable from here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .alarm import Alarm, alarm_table
from .course_alarms import COURSE_ALARMS
from .rule import HELDOUT_KEY, SEVERITIES, SKIPPED_STEPS_KEY, ZERO_SPREAD_KEYS, Rule, pearson
from .step_alarms import STEP_ALARMS

__all__ = [
    "ALARMS",
    "ALARM_FIELDS",
    "DEFAULT_THRESHOLDS",
    "HELDOUT_KEY",
    "SEVERITIES",
    "SKIPPED_STEPS_KEY",
    "ZERO_SPREAD_KEYS",
    "Alarm",
    "Rule",
    "alarm_table",
    "build_rules",
    "pearson",
]

#: alarm name -> its record, in checking order.
ALARMS: dict[str, Alarm] = {alarm.name: alarm for alarm in (*STEP_ALARMS, *COURSE_ALARMS)}
#: alarm name -> its `GRPOConfigExt` field.
ALARM_FIELDS = {name: alarm.field for name, alarm in ALARMS.items()}
#: `GRPOConfigExt` field -> its default.
DEFAULT_THRESHOLDS = {alarm.field: alarm.default for alarm in ALARMS.values()}


def build_rules(
    thresholds: Mapping[str, float | None], patience: int = 3, auxiliary: Collection[str] | None = None
) -> list[Rule]:
    """The rules whose threshold is set, in `ALARMS` order.

    Args:
        thresholds: alarm name (a key of `ALARMS`) -> threshold, `None` (or absent) to leave that alarm out.
        patience: log steps in a row a high clip fraction must last (`warn_patience`).
        auxiliary: the names of the auxiliary reward functions (`warn_auxiliary_rewards`); `None`: told by the words
            of their names.
    """
    unknown = set(thresholds) - set(ALARMS)
    if unknown:
        raise ValueError(f"unknown alarms {sorted(unknown)}; known: {list(ALARMS)}.")
    settings = {"patience": patience, "auxiliary": auxiliary}
    return [
        alarm.build(thresholds[name], **settings) for name, alarm in ALARMS.items() if thresholds.get(name) is not None
    ]
