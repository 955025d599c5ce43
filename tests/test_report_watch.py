"""The metric records of `trl_grpo_ext.report.watch` (their type in `report.metric_record`): every metric the
package logs has one, the report's signals and the console's line are read from them, and the documents' metric
tables are written from them."""

import pathlib
import re

import pytest

from benchmarks import tables
from trl_grpo_ext import metrics
from trl_grpo_ext.extras.console import CONSOLE_SIGNALS
from trl_grpo_ext.guardrails.alarms import ALARMS
from trl_grpo_ext.report.health import SIGNALS
from trl_grpo_ext.report.metric_record import METRIC_TABLES, README_TABLE, Signal, Watched, metric_table
from trl_grpo_ext.report.watch import WATCHED

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Constants of `metrics` that the package logs but no metric table lists: name -> where the docs say what it is.
DOCUMENTED_ELSEWHERE = {
    "REWARD_STD_GROUP": "a histogram: docs/diagnostics.md, 'Histograms'",
    "VESPO_PHI_SEQ_MEAN": "VESPO's own metric: docs/objective.md, its loss type",
    "IMPORTANCE_SAMPLING_RATIO_RAW": "the folder of the raw ratio's statistics, each listed",
}


def _logged_by_the_package() -> dict[str, str]:
    """The constants of `metrics` not marked (TRL) and not a folder (`*_PREFIX`): constant -> metric name."""
    source = pathlib.Path(metrics.__file__).read_text()
    trl_own = set(re.findall(r"^([A-Z0-9_]+) = .*# \(TRL\)", source, re.MULTILINE))
    return {
        name: value
        for name, value in vars(metrics).items()
        if name.isupper() and not name.endswith("_PREFIX") and name not in trl_own
    }


def test_every_metric_the_package_logs_has_a_record():
    logged = _logged_by_the_package()
    assert "FRAC_REWARD_UNSCORED" in logged and "KL" not in logged  # the (TRL) marks are read
    named = {name for record in WATCHED for name in record.metrics}
    missing = {constant for constant, name in logged.items() if name not in named} - set(DOCUMENTED_ELSEWHERE)
    assert not missing, f"metrics without a record in report/watch.py: {sorted(missing)}"
    assert set(DOCUMENTED_ELSEWHERE) <= set(logged), "an exception names a constant that is gone or is TRL's"


def test_every_signal_and_console_metric_is_one_of_its_row():
    for record in WATCHED:
        if record.signal is not None:
            # the signal's first key is one its row names (the second, where there is one, TRL's fallback)
            assert record.signal.keys[0] in record.metrics or record.signal.keys[0].startswith(metrics.HELDOUT_PREFIX)
    assert [signal.name for signal in SIGNALS] == [r.signal.name for r in WATCHED if r.signal]
    assert len({signal.name for signal in SIGNALS}) == len(SIGNALS)
    judged = [alarm for signal in SIGNALS for alarm in signal.alarms]
    assert sorted(judged) == sorted(ALARMS), "every alarm judges exactly one signal"
    assert [label for _, label in CONSOLE_SIGNALS] == ["reward", "spread", "kl", "clip", "ratio p95", "entropy", "len"]


def test_a_record_is_refused_for_an_unknown_table_a_stray_console_metric_or_signal_kind():
    with pytest.raises(ValueError, match="no metric table 'metrix'"):
        Watched(metrics=(metrics.KL,), what="x", table="metrix")
    with pytest.raises(ValueError, match="the console shows 'entropy'"):
        Watched(metrics=(metrics.KL,), what="x", console=(metrics.ENTROPY, "entropy"))
    with pytest.raises(ValueError, match="kind must be one of"):
        Signal("kl", (metrics.KL,), kind="judged")


def test_a_row_names_its_metrics_shortening_a_shared_folder_from_three_on():
    three = Watched(metrics=(metrics.RATIO_MIN, metrics.RATIO_MAX, metrics.KL), what="x", also="(and more)")
    assert three.names() == "`ratio/min`, `max`, `kl` (and more)"
    two = Watched(metrics=(metrics.LOSS_POLICY, metrics.LOSS_KL_PENALTY), what="x")
    assert two.names() == "`loss/policy`, `loss/kl_penalty`"


def test_a_cell_that_would_break_the_table_is_refused():
    record = Watched(metrics=(metrics.KL,), what="a | b", healthy="y", worrying="z")
    with pytest.raises(ValueError, match="kl: a table cell holds"):
        metric_table("metrics", [record])


def test_a_new_record_is_a_new_row_of_its_table_and_of_the_readme_s():
    record = Watched(
        metrics=(metrics.KL,), what="w", healthy="h", worrying="v", readme="short", table="metrics-sampler"
    )
    rows = metric_table("metrics-sampler", [*WATCHED, record]).splitlines()
    assert rows[-1] == "| `kl` | w | h | v |"
    assert rows[:-1] == metric_table("metrics-sampler", WATCHED).splitlines()
    assert tables.render(README_TABLE).splitlines()[-1].startswith("| `heldout/")  # the README's, from the records


@pytest.mark.parametrize("table", [*METRIC_TABLES, README_TABLE])
def test_each_metric_table_is_marked_once_in_its_document(table):
    document = METRIC_TABLES[table][0] if table in METRIC_TABLES else "README.md"
    everywhere = [(ROOT / path).read_text() for path in tables.documents(str(ROOT))]
    assert sum(text.count(f"<!-- table:{table} -->") for text in everywhere) == 1
    assert f"<!-- table:{table} -->" in (ROOT / document).read_text()
