"""Figures that stay true: the documents' benchmark tables are written from the results committed under
`benchmarks/results/` (`python -m benchmarks tables`), and a count of tests quoted in the documents names the commit
it was counted at."""

import glob
import json
import os
import re
import shutil
import subprocess

import pytest
from helpers import REPO

from benchmarks import tables
from benchmarks.common import git_commit

RESULTS = sorted(glob.glob(os.path.join(REPO, tables.RESULTS_DIR, "*.json")))


def test_every_marked_table_is_the_one_its_results_give():
    """Fails when a table was edited by hand, or its JSON changed without `python -m benchmarks tables`."""
    assert tables.main(["--check"], root=REPO) == 0


def test_every_results_file_has_its_table_in_a_document_and_every_table_its_file():
    marked = set()
    for document in tables.documents(REPO):
        with open(os.path.join(REPO, document)) as handle:
            marked |= {match.group("name") for match in tables.MARKED.finditer(handle.read())}
    files = {os.path.basename(path).removesuffix(".json") for path in RESULTS}
    assert files == set(tables.RENDERERS) == marked - set(tables.record_tables())


@pytest.mark.parametrize("path", RESULTS, ids=os.path.basename)
def test_each_results_file_names_its_command_commit_and_date(path):
    with open(path) as handle:
        payload = json.load(handle)
    assert payload["command"].startswith("python -m benchmarks ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", payload["environment"]["date"])
    commit = payload["environment"]["commit"]
    assert re.fullmatch(r"[0-9a-f]{7,40}", commit), "measured on committed code"
    shallow = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    )
    if shallow.stdout.strip() == "false":  # the whole history is here
        found = subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        assert found.returncode == 0, f"{commit} is not in this repository's history"


def checkout_copy(tmp_path, document: str) -> str:
    """A folder laid out as the checkout, with the results files and one document."""
    shutil.copytree(os.path.join(REPO, tables.RESULTS_DIR), tmp_path / tables.RESULTS_DIR)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(document)
    return str(tmp_path)


def test_a_hand_edit_inside_a_table_is_found_and_rewritten_leaving_the_rest(tmp_path, capsys):
    table = tables.render("e2e", REPO)
    edited = table.replace("| full | trl ", "| full | TRL ", 1)
    assert edited != table
    before, after = "# A page\n\nProse before.\n\n", "\nProse after, 0.990 by hand.\n"
    root = checkout_copy(tmp_path, f"{before}<!-- table:e2e -->\n{edited}<!-- /table -->{after}")
    page = tmp_path / "docs" / "page.md"

    assert tables.main(["--check"], root=root) == 1
    assert "docs/page.md: table 'e2e' is stale" in capsys.readouterr().out
    assert edited in page.read_text()  # --check changes nothing
    assert tables.main([], root=root) == 0
    assert page.read_text() == f"{before}<!-- table:e2e -->\n{table}<!-- /table -->{after}"
    assert tables.main(["--check"], root=root) == 0


def test_a_new_result_changes_the_table_it_renders(tmp_path):
    root = checkout_copy(tmp_path, "")
    path = os.path.join(root, tables.RESULTS_DIR, "kernel.json")
    with open(path) as handle:
        payload = json.load(handle)
    timing = payload["kernel"]["cases"][0]["sides"]["compiled"]["time_s"]
    timing["median"] = 0.00099
    payload["environment"]["commit"] = "abcdef0"
    with open(path, "w") as handle:
        json.dump(payload, handle)
    rendered = tables.render("kernel", root)
    row = next(line for line in rendered.splitlines() if "| compiled " in line)  # the first case's
    assert f"| 0.99 [{timing['min'] * 1e3:.2f}, {timing['max'] * 1e3:.2f}]" in row
    date = payload["environment"]["date"]
    assert f"(commit abcdef0, {date})" in rendered and rendered != tables.render("kernel", REPO)


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- table:e2e -->\nno end\n", "1 table markers opened and 0 closed"),
        ("<!-- table:nosuch -->\n<!-- /table -->\n", "no such table"),
    ],
)
def test_a_marker_without_its_end_or_its_results_is_an_error(text, message):
    with pytest.raises(ValueError, match=message):
        tables.rewrite(text, REPO)


def test_the_benchmarks_record_the_commit_they_ran_on(tmp_path):
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert git_commit(REPO).removesuffix("+changes") == head.stdout.strip()
    assert git_commit(str(tmp_path)) is None


# A count of tests, not a version number's digits ("TRL 1.14 tests").
TEST_COUNT = re.compile(r"(?<![\d.])\d[\d,]*\s+tests\b")


def test_every_count_of_tests_in_the_docs_names_the_commit_it_was_counted_at():
    """Counts of tests change with every test added: one quoted in the README, the Makefile or docs/ must be a dated
    measurement (a commit named between its section's heading and the count), or go."""
    pages = ["Makefile", *tables.documents(REPO)]  # the README and docs/*.md
    counts = 0
    for page in pages:
        with open(os.path.join(REPO, page)) as handle:
            text = handle.read()
        for match in TEST_COUNT.finditer(text):
            counts += 1
            start = max(text.rfind("\n#", 0, match.start()), 0)
            end = text.find("\n", match.end())
            assert re.search(r"commit [0-9a-f]{7,40}", text[start:end]), (page, match.group(0))
    assert counts >= 3  # the CI durations of docs/performance.md and the real-vLLM tier of docs/vllm.md


# The demo's figures quoted in prose, outside any generated table: where each is said, and how to read it.
DEMO_MINUTES = {
    "README.md": r"make demo .*about (\d+) minutes",
    "Makefile": r"The offline demo recipe: ~(\d+) minutes",
    "trl_grpo_ext/tools/cli.py": r"the offline demo .*~(\d+) minutes",
    "trl_grpo_ext/tools/recipes/tiny/config_demo.yaml": r"about (\d+) minutes",
    "docs/recipes.md": r"config_demo\.yaml.*about (\d+) minutes",
    "benchmarks/__main__.py": r"alarms \(about (\d+) minutes",
}
# The recipe's printed line, in the docs' copies of its output.
DEMO_SCORES = {
    "docs/recipes.md": r"exact_match mean@1: ([\d.]+) before GRPO -> ([\d.]+) after",
    "docs/diagnostics.md": r"heldout/exact_match/mean@1 ([\d.]+) -> ([\d.]+)",
}


def demo_results() -> dict:
    with open(os.path.join(REPO, tables.RESULTS_DIR, "demo.json")) as handle:
        return json.load(handle)["demo"]


@pytest.mark.parametrize("page", DEMO_MINUTES)
def test_the_demos_minutes_said_in_prose_are_those_measured(page):
    """`python -m benchmarks demo` measures the demo; a page that says how long it takes says it in whole minutes."""
    with open(os.path.join(REPO, page)) as handle:
        claims = re.findall(DEMO_MINUTES[page], handle.read())
    assert len(claims) == 1, (page, claims)
    measured = demo_results()["wall_s"] / 60
    assert int(claims[0]) == round(measured), f"{page} says about {claims[0]} minutes; measured {measured:.1f}"


@pytest.mark.parametrize("page", DEMO_SCORES)
def test_the_demos_scores_quoted_in_the_docs_are_those_measured(page):
    with open(os.path.join(REPO, page)) as handle:
        quoted = re.findall(DEMO_SCORES[page], handle.read())
    assert len(quoted) == 1, (page, quoted)
    measured = demo_results()["heldout"]["exact_match mean@1"]
    assert [float(value) for value in quoted[0]] == [round(measured["before"], 3), round(measured["after"], 3)]


def test_the_demo_suite_reads_the_held_out_lines_the_recipe_prints():
    from benchmarks import demo
    from trl_grpo_ext.tools.recipes.grpo import heldout_lines

    before = {"heldout/exact_match/mean@1": 0.2, "heldout/exact_match/pass@1": 0.2, "heldout/f1/mean@4": 0.5}
    after = {"heldout/exact_match/mean@1": 0.782, "heldout/exact_match/pass@1": 0.782, "heldout/f1/mean@4": 0.61}
    printed = "Held-out evaluation on 500 test prompts:\n" + "\n".join(heldout_lines(before, after)) + "\nDone.\n"
    assert demo.heldout_scores(printed) == {
        "exact_match mean@1": {"before": 0.2, "after": 0.782},
        "f1 mean@4": {"before": 0.5, "after": 0.61},
    }
    assert demo.minutes(162.4) == "2 min 42 s" and demo.minutes(59.6) == "1 min 00 s"
