"""The record of a metric row (`Watched`) and of a signal the report judges (`Signal`), and the tables written from
the records (`metric_table`, `readme_table`). The records themselves are in `report.watch`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["METRIC_TABLES", "README_TABLE", "SIGNAL_KINDS", "Signal", "Watched", "metric_table", "readme_table"]

#: The kinds of `Signal`.
SIGNAL_KINDS = ("alarms", "count", "shown")


@dataclass(frozen=True)
class Signal:
    """A signal that `trl-grpo-ext report` judges and `report.png` draws (one line, one panel).

    Attributes:
        name: its name on the report's line.
        keys: the metrics shown, in order of preference (the first one logged is summarised).
        alarms: the alarms that judge it.
        kind: `"alarms"` (judged by its alarms), `"count"` (fine while the metric is 0 and no alarm fired: a count
            of events, shown with the steps where it was not 0) or `"shown"` (not judged: the loss, whose sign and
            size say little; a NaN or infinite `loss` or `loss/*` value is a `FAIL` all the same).
        required: the alarms (of `alarms`) that must have judged the run for its verdict to be `ok`, where they are
            on: the reward's `plateau`, which tells whether the run learned at all; without any, one of `alarms`
            judging is enough. Until then the signal is too short to judge.
    """

    name: str
    keys: tuple[str, ...]
    alarms: tuple[str, ...] = ()
    kind: str = "alarms"
    required: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"signal {self.name!r}: kind must be one of {SIGNAL_KINDS}, got {self.kind!r}")
        if not set(self.required) <= set(self.alarms):
            raise ValueError(f"signal {self.name!r}: required alarms {self.required} are not all of {self.alarms}")


@dataclass(frozen=True, kw_only=True)
class Watched:
    """One row of a metric table: a metric, or a few read together.

    Attributes:
        metrics: the metrics' names (their constants of `trl_grpo_ext.metrics`; a family with its part in angle
            brackets, `rewards/<func>/mean`). The table's first cell names them; in a row of three or more, each
            after the first that shares its folder by the part after it (`ratio/mean`, `std`, `min`).
        what: what it is (Markdown, one line).
        table: the table it is a row of, a key of `METRIC_TABLES`.
        healthy, worrying: its healthy and worrying values (`""`: a table without those columns).
        also: a note after the names in the first cell (`(and loss/router when on)`).
        readme: what it says in the README's short table ("What to watch"); `None`: not listed there.
        signal: what `trl-grpo-ext report` judges of it; `None`: not judged.
        console: `(metric, label)` on the console's line; `None`: not shown there.
    """

    metrics: tuple[str, ...]
    what: str
    table: str = "metrics"
    healthy: str = ""
    worrying: str = ""
    also: str = ""
    readme: str | None = None
    signal: Signal | None = None
    console: tuple[str, str] | None = None

    def __post_init__(self):
        if self.table not in METRIC_TABLES:
            raise ValueError(f"{self.metrics[0]}: no metric table {self.table!r} (known: {', '.join(METRIC_TABLES)})")
        if self.console is not None and self.console[0] not in self.metrics:
            raise ValueError(f"{self.metrics[0]}: the console shows {self.console[0]!r}, which the row does not name")

    def names(self) -> str:
        """The first cell: the metrics; in a row of three or more, each after the first that shares its folder by
        the part after it."""
        folder = self.metrics[0].rpartition("/")[0] if len(self.metrics) > 2 else ""
        cells = [f"`{self.metrics[0]}`"]
        for name in self.metrics[1:]:
            head, _, tail = name.rpartition("/")
            cells.append(f"`{tail}`" if folder and head == folder else f"`{name}`")
        return ", ".join(cells) + (f" {self.also}" if self.also else "")


#: The metric tables: region name -> (document, the sentence that says what its rows are, whether it has the
#: healthy and worrying columns).
METRIC_TABLES = {
    "metrics": ("docs/diagnostics.md", "every metric the package logs or reads, with TRL's own that matter", True),
    "metrics-sampler": ("docs/diagnostics.md", "the sampler/trainer mismatch under vLLM", True),
    "metrics-sampler-cuts": ("docs/diagnostics.md", "vLLM's truncated sampling matched", True),
    "metrics-dynamic-sampling": ("docs/sampling.md", "dynamic sampling's rounds", False),
    "metrics-selective-rollouts": ("docs/sampling.md", "selective rollouts' predictions", False),
}
#: The README's "What to watch" table (the records with a `readme` text).
README_TABLE = "watch"


def _row(cells: Iterable[str], where: str) -> str:
    cells = list(cells)
    for cell in cells:
        if "|" in cell or "\n" in cell:
            raise ValueError(f"{where}: a table cell holds '|' or a line break: {cell!r}")
    return f"| {' | '.join(cells)} |\n"


def metric_table(table: str, records: Iterable[Watched]) -> str:
    """The metric table `table` (a key of `METRIC_TABLES`): one row per record of that table, in their order;
    `python -m benchmarks tables` writes it into its document and `--check` fails when the document's differs."""
    graded = METRIC_TABLES[table][2]
    columns = ["metric", "what it is", "healthy", "worrying"] if graded else ["metric", "what it is"]
    lines = [_row(columns, table), _row(["---"] * len(columns), table)]
    for record in records:
        if record.table == table:
            cells = [record.names(), record.what] + ([record.healthy, record.worrying] if graded else [])
            lines.append(_row(cells, record.metrics[0]))
    return "".join(lines)


def readme_table(records: Iterable[Watched]) -> str:
    """The README's "What to watch" table: the records with a `readme` text, in their order."""
    lines = [_row(["metric", "what it says"], README_TABLE), _row(["---", "---"], README_TABLE)]
    lines += [_row([record.names(), record.readme], record.metrics[0]) for record in records if record.readme]
    return "".join(lines)
