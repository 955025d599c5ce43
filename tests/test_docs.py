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


def test_the_alarm_table_lists_every_alarm_with_its_field_and_default():
    """docs/diagnostics.md's alarm table against the records (`ALARMS`): a new alarm, a renamed field or a changed
    default that the page does not follow fails here."""
    from trl_grpo_ext.guardrails.alarms import ALARMS

    text = (ROOT / "docs" / "diagnostics.md").read_text()
    header = "| alarm | field | default | given when | suggests |"
    rows = text[text.index(header) :].split("\n\n", 1)[0].splitlines()[2:]
    table = {}
    for row in rows:
        name, fields, defaults = (cell.strip() for cell in row.strip("|").split("|")[:3])
        table[name.strip("`")] = (fields.split(",")[0].strip().strip("`"), float(defaults.split(",")[0]))
    assert set(table) == set(ALARMS)
    for name, alarm in ALARMS.items():
        assert table[name] == (alarm.field, alarm.default), name


def test_the_report_s_signals_are_those_the_page_lists_with_their_alarms():
    """docs/diagnostics.md's paragraph on `report`'s signals names each signal's alarms, in the records' order, and
    every alarm belongs to one signal."""
    from trl_grpo_ext.guardrails.alarms import ALARMS
    from trl_grpo_ext.report.health import SIGNALS

    text = " ".join((ROOT / "docs" / "diagnostics.md").read_text().split())
    paragraph = text[text.index("The signals, in order:") :].split(". ", 1)[0]
    parts = paragraph.removeprefix("The signals, in order:").split(";")
    listed = [re.findall(r"`([a-z_0-9]+)`", part) for part in parts]
    assert listed == [list(signal.alarms) for signal in SIGNALS]
    judged = [alarm for signal in SIGNALS for alarm in signal.alarms]
    assert sorted(judged) == sorted(ALARMS)
