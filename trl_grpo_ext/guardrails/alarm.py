"""What an alarm is: one record (`Alarm`) holding its rule, its threshold's `GRPOConfigExt` field with default, range
and help, and its row of the docs' alarm table; `alarm_table` writes that table from the records.

The records themselves are in `step_alarms.py` and `course_alarms.py`, gathered in `alarms.ALARMS`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .rule import Rule

__all__ = ["SETTINGS", "Alarm", "alarm_table"]

#: The run's settings that a rule may take beside its threshold: its parameter -> the `GRPOConfigExt` field.
SETTINGS = {"patience": "warn_patience", "auxiliary": "warn_auxiliary_rewards"}


@dataclass(frozen=True, kw_only=True)
class Alarm:
    """Everything about one alarm, in one place: its rule, its threshold's `GRPOConfigExt` field with its default,
    range and help, and how the monitor, the report and the card name it.

    Attributes:
        name (`str`): counted as `alarms/<name>`.
        rule (`type[Rule]`): the condition; built with the threshold and `rule_options`.
        field (`str`): the `GRPOConfigExt` field of the threshold (`None` there switches the alarm off);
            `AnomalyMonitor` takes it as a keyword without the `warn_` prefix.
        default (`float`): the field's default.
        low, high (`float`): the range of the threshold; `low_inclusive`, `high_inclusive` say whether the ends are in.
        help (`str`): the field's help (what the alarm means).
        given_when, suggests (`str`): its row of docs/diagnostics.md's alarm table (`alarm_table`), Markdown: when it
            is given (with the evidence behind its default) and what to change.
        whole (`bool`): the threshold counts log steps (a whole number).
        rule_options (`dict`): more arguments of the rule (the metric a ratio alarm reads).
    """

    name: str
    rule: type[Rule]
    field: str
    default: float
    low: float
    high: float
    low_inclusive: bool
    high_inclusive: bool
    help: str
    given_when: str
    suggests: str
    whole: bool = False
    rule_options: Mapping = dataclasses.field(default_factory=dict)

    @property
    def keyword(self) -> str:
        return self.field.removeprefix("warn_")

    def range_text(self) -> str:
        """The range in words: `in (0, 1]`, `> 1`, `>= 1`."""
        if math.isinf(self.high):
            return f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        return (
            f"in {'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}{']' if self.high_inclusive else ')'}"
        )

    def problem(self, value) -> str | None:
        """The sentence that refuses `value` for this alarm's field, `None` when it is fine (`None` always is)."""
        if value is None:
            return None
        inside = (self.low <= value if self.low_inclusive else self.low < value) and (
            value <= self.high if self.high_inclusive else value < self.high
        )
        if not inside:
            return f"`{self.field}` must be {self.range_text()} (or None to switch its alarm off), got {value}."
        if self.whole and value != int(value):
            return f"`{self.field}` must be a whole number of log steps, got {value}."
        return None

    def build(self, threshold: float, **settings) -> Rule:
        """The rule, judging against `threshold`, with those of the run's `settings` that it takes (`patience`:
        `warn_patience`, for the rules that wait; `auxiliary`: `warn_auxiliary_rewards`, for `reward_composition`)."""
        parameters = inspect.signature(self.rule).parameters
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise TypeError(f"alarm {self.name}: unknown settings {sorted(unknown)}; known: {list(SETTINGS)}.")
        options = dict(self.rule_options) | {key: value for key, value in settings.items() if key in parameters}
        rule = self.rule(threshold, **options)
        rule.name, rule.field = self.name, self.field
        return rule

    def config_field(self) -> dataclasses.Field:
        """The `GRPOConfigExt` field of the threshold: its default and help."""
        return dataclasses.field(
            default=self.default,
            metadata={"help": f"{self.help} {self.range_text()[0].upper()}{self.range_text()[1:]}."},
        )

    def table_row(self) -> str:
        """Its row of the alarm table: name, field, default, when it is given, what it suggests. A rule that takes a
        setting of `SETTINGS` (`patience`: a rule that waits) names its field and default too."""
        fields, defaults = [f"`{self.field}`"], [f"{self.default:g}"]
        parameters = inspect.signature(self.rule).parameters
        for setting, field in SETTINGS.items():
            if setting in parameters:
                fields.append(f"`{field}`")
                default = parameters[setting].default
                defaults.append("None" if default is None else f"{default:g}")
        cells = [f"`{self.name}`", ", ".join(fields), ", ".join(defaults), self.given_when, self.suggests]
        for cell in cells:
            if "|" in cell or "\n" in cell:
                raise ValueError(f"alarm {self.name}: a table cell holds '|' or a line break: {cell!r}")
        return f"| {' | '.join(cells)} |"


def alarm_table(alarms: Iterable[Alarm]) -> str:
    """The alarm table of docs/diagnostics.md ("Alarms: anomaly warnings"), one row per record in their order;
    `python -m benchmarks tables` writes it there and `--check` fails when the page's differs."""
    header = "| alarm | field | default | given when | suggests |\n| --- | --- | --- | --- | --- |\n"
    return header + "".join(f"{alarm.table_row()}\n" for alarm in alarms)
