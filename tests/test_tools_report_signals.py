"""The report's signals (`tools.report.health.SIGNALS`) and the documents' metric tables: every metric the package logs
is documented in a table, and every alarm judges one signal."""

import pathlib
import re

import pytest

from trl_grpo_ext import metrics
from trl_grpo_ext.guardrails.alarms import ALARMS
from trl_grpo_ext.tools.report.health import SIGNALS, Signal

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The documents whose tables list the metrics.
DOCUMENTS = ("docs/diagnostics.md", "docs/sampling.md")
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


def _table_names() -> set[str]:
    """Every metric a row of the documents' metric tables names: `a/b` in its first cell, and `a/c` for a cell that
    names only the part after a folder named before it in the row (`ratio/mean`, `std`)."""
    names = set()
    for document in DOCUMENTS:
        for line in (ROOT / document).read_text().splitlines():
            if not line.startswith("| `"):
                continue
            folder = ""
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                if "/" in name:
                    folder = name.rpartition("/")[0]
                names.add(name if "/" in name or not folder else f"{folder}/{name}")
    return names


def test_every_metric_the_package_logs_is_a_row_of_a_metric_table():
    logged = _logged_by_the_package()
    assert "FRAC_REWARD_UNSCORED" in logged and "KL" not in logged  # the (TRL) marks are read
    named = _table_names()
    assert {"ratio/p95", "reward_std/group_max", "dynamic_sampling/trained_clipped_ratio"} <= named
    missing = {constant for constant, name in logged.items() if name not in named} - set(DOCUMENTED_ELSEWHERE)
    assert not missing, f"metrics without a row in {' or '.join(DOCUMENTS)}: {sorted(missing)}"
    assert set(DOCUMENTED_ELSEWHERE) <= set(logged), "an exception names a constant that is gone or is TRL's"


def test_every_alarm_judges_exactly_one_signal_whose_metric_is_documented():
    judged = [alarm for signal in SIGNALS for alarm in signal.alarms]
    assert sorted(judged) == sorted(ALARMS)
    assert len({signal.name for signal in SIGNALS}) == len(SIGNALS)
    named = _table_names()
    for signal in SIGNALS:
        assert signal.keys[0] in named or signal.keys[0].startswith(metrics.HELDOUT_PREFIX), signal.name


def test_a_signal_is_refused_for_an_unknown_kind_or_a_required_alarm_it_does_not_have():
    with pytest.raises(ValueError, match="kind must be one of"):
        Signal("kl", (metrics.KL,), kind="judged")
    with pytest.raises(ValueError, match="required alarms"):
        Signal("kl", (metrics.KL,), ("kl_jump",), required=("kl_high",))
