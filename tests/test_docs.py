"""The documentation's relative links point at files and headings that exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor_of(heading: str) -> str:
    """A heading's anchor as GitHub and the Hub render it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor_of(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_anchor_of_a_heading_is_the_rendered_one():
    assert anchor_of("Multi-epoch: selective rollouts and dynamic sampling's sized rounds") == (
        "multi-epoch-selective-rollouts-and-dynamic-samplings-sized-rounds"
    )
    assert anchor_of("The `report` command") == "the-report-command"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for link in relative_links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading #{fragment} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_alarm_table_has_a_row_per_alarm_with_its_default():
    """docs/diagnostics.md's alarm table (written by hand) lists every alarm once, in `ALARMS` order, with the default
    of its family; `clip_fraction`'s row names `warn_patience`, `reward_composition`'s `warn_auxiliary_rewards`."""
    from trl_grpo_ext import GRPOConfigExt
    from trl_grpo_ext.guardrails.alarms import ALARMS, DEFAULTS

    text = (ROOT / "docs" / "diagnostics.md").read_text()
    header = "| alarm | default | given when | suggests |\n| --- | --- | --- | --- |\n"
    rows = text[text.index(header) + len(header) :].split("\n\n", 1)[0].splitlines()
    table = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 4 and all(cells), row
        table[cells[0].strip("`")] = cells[1]
    assert list(table) == list(ALARMS)
    assert all(float(table[name].split(";")[0]) == default for name, default in DEFAULTS.items())
    assert table["clip_fraction"] == f"0.2; `warn_patience` {GRPOConfigExt.warn_patience}"
    assert table["reward_composition"] == "0.8; `warn_auxiliary_rewards` None"


def test_the_loss_type_table_is_the_one_the_records_give():
    """docs/objective.md's loss-type table is written from the built-in loss-type records and the two configurations'
    defaults (`python -m benchmarks tables`): a changed record or default, or a hand edit of the table, fails here."""
    from benchmarks import tables

    text = (ROOT / "docs" / "objective.md").read_text()
    regions = {match.group("name"): match.group("body") for match in tables.MARKED.finditer(text)}
    assert regions["loss-types"] == tables.render("loss-types"), "run `python -m benchmarks tables`"
    assert "| `grpo` (this package's default) |" in regions["loss-types"]
    assert "| `dapo` (TRL's default) |" in regions["loss-types"]


def test_a_stale_loss_type_table_is_found_and_rewritten():
    from benchmarks import tables

    written = tables.render("loss-types")
    stale = written.replace("| `luspo` | `clipped` | `sequence_sum` |\n", "")
    assert stale != written
    rewritten, changed = tables.rewrite(f"# Objective\n\n<!-- table:loss-types -->\n{stale}<!-- /table -->\n")
    assert changed == ["loss-types"]
    assert rewritten == f"# Objective\n\n<!-- table:loss-types -->\n{written}<!-- /table -->\n"


def test_the_report_s_signals_are_those_the_page_lists_with_their_alarms():
    """docs/diagnostics.md's paragraph on `report`'s signals names each signal's alarms, in the records' order, and
    every alarm belongs to one signal."""
    from trl_grpo_ext.guardrails.alarms import ALARMS
    from trl_grpo_ext.tools.report.health import SIGNALS

    text = " ".join((ROOT / "docs" / "diagnostics.md").read_text().split())
    paragraph = text[text.index("The signals, in order:") :].split(". ", 1)[0]
    parts = paragraph.removeprefix("The signals, in order:").split(";")
    listed = [re.findall(r"`([a-z_0-9]+)`", part) for part in parts]
    assert listed == [list(signal.alarms) for signal in SIGNALS]
    judged = [alarm for signal in SIGNALS for alarm in signal.alarms]
    assert sorted(judged) == sorted(ALARMS)
