"""Installing as the README says: each requirement a range from the oldest release tested to the next major, and the
scripts' PEP 723 headers taking this package from the clone (`uv run recipes/grpo.py` from a clone, while the package
is not on PyPI)."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11

SCRIPTS = [os.path.join("recipes", "grpo.py"), os.path.join("recipes", "quickstart.py")]
BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")  # PEP 723's


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def script_metadata(path: str) -> dict:
    with open(os.path.join(REPO, path)) as handle:
        (match,) = [match for match in BLOCK.finditer(handle.read()) if match.group("type") == "script"]
    lines = match.group("content").splitlines(True)
    return tomllib.loads("".join(line[2:] if line.startswith("# ") else line[1:] for line in lines))


def ranges_table() -> dict[str, list[str]]:
    """docs/compatibility.md's table of the ranges: package -> its row (range, floor, newest tested)."""
    with open(os.path.join(REPO, "docs", "compatibility.md")) as handle:
        text = handle.read()
    table = text.split("## Ranges", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    rows = [[cell.strip(" `") for cell in line.split("|")[1:-1]] for line in lines]
    return {row[0]: row[1:] for row in rows}


def requirements() -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in project()["dependencies"]}


def test_each_requirement_is_the_range_the_docs_give_from_the_measured_floor_to_the_next_major():
    """Floors are the oldest releases the tests pass with; ceilings the next major release (none for torch, whose
    ceiling is transformers', which names none); docs/compatibility.md's table is the same."""
    table, declared = ranges_table(), requirements()
    assert set(table) == {"trl", "transformers", "peft", "torch", "accelerate", "datasets"} == set(declared)
    for name, requirement in declared.items():
        assert requirement.specifier == SpecifierSet(table[name][0]), name
        floor = Version(table[name][1])
        assert requirement.specifier.contains(floor) and not requirement.specifier.contains(_just_below(floor)), name
    for name, next_major in (("trl", "2.0.0"), ("peft", "1.0.0"), ("transformers", "6.0.0")):
        assert not declared[name].specifier.contains(next_major), name
        assert declared[name].specifier.contains(_just_below(Version(next_major))), name
    for newest_tested in ("2.14.1", "2.15.0", "3.0.0"):
        assert declared["torch"].specifier.contains(newest_tested)
    import torch as installed

    assert declared["torch"].specifier.contains(Version(installed.__version__).base_version)


def _just_below(version: Version) -> str:
    """A release just below `version` (`1.14.0` -> `1.13.99`; `1.0.0` -> `0.99.99`)."""
    parts = list(version.release) + [0] * (3 - len(version.release))
    for index in range(2, -1, -1):
        if parts[index] > 0:
            parts[index] -= 1
            parts[index + 1 :] = [99] * (2 - index)
            return ".".join(map(str, parts))
    raise ValueError(version)


@pytest.mark.parametrize("path", SCRIPTS)
def test_each_script_header_takes_this_package_from_the_clone_it_is_in(path):
    metadata = script_metadata(path)
    (requirement,) = [Requirement(line) for line in metadata["dependencies"] if line.startswith("trl-grpo-ext")]
    source = metadata["tool"]["uv"]["sources"]["trl-grpo-ext"]
    # uv resolves a path source of a script against the script's folder.
    root = os.path.normpath(os.path.join(REPO, os.path.dirname(path), source["path"]))
    assert root == os.path.normpath(REPO) and source.get("editable") is True
    with open(os.path.join(root, "pyproject.toml"), "rb") as handle:
        assert tomllib.load(handle)["project"]["name"] == requirement.name


def _uv() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "uv")  # the dev extra installs it into the environment
    return beside if os.path.exists(beside) else shutil.which("uv")


def _pip_find_links() -> list[str]:
    """The wheel folders pip is set up to search (its configuration, `PIP_FIND_LINKS`), for uv to search too: a
    machine with a CPU build of torch there gets it instead of PyPI's CUDA build."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    folders = result.stdout.split() if result.returncode == 0 else []
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    return [folder for folder in dict.fromkeys(folders) if os.path.isdir(folder.removeprefix("file://"))]


@pytest.mark.slow
@pytest.mark.skipif(_uv() is None, reason="needs uv (the dev extra installs it)")
def test_uv_run_runs_both_scripts_from_the_clone(tmp_path):
    """`uv run recipes/grpo.py` (two demo steps) and `uv run recipes/quickstart.py`, each in the environment uv makes
    from the header alone: the package comes from this clone, the rest from PyPI."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(UV_CACHE_DIR=str(tmp_path / "uv-cache"), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.update(HF_HUB_OFFLINE="1", UV_NO_PROGRESS="1")
    uv = [_uv(), "run", "--python", sys.executable]
    # As docs/compatibility.md runs it, `uv run $(python3 tools/torch_build.py uv-run) ...`, with pip's wheel folders:
    # a CPU build of torch there is taken from there only (torch has no upper bound; PyPI's newest is a CUDA build).
    torch_args = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "torch_build.py"), "uv-run"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(env, PIP_FIND_LINKS=" ".join(_pip_find_links())),
    ).stdout.split()
    uv += torch_args
    try:
        recipe = ["recipes/grpo.py", "--config", "recipes/tiny/config_demo.yaml", "--max_steps", "2"]
        recipe += ["--logging_steps", "1", "--eval_samples", "0", "--save_strategy", "no", "--report_to", "none"]
        recipe += ["--per_device_train_batch_size", "16", "--output_dir", str(tmp_path / "recipe")]
        result = subprocess.run([*uv, *recipe], capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
        assert result.returncode == 0, result.stderr[-4000:]
        assert f"trl-grpo-ext @ file://{REPO}" in result.stderr  # built from the clone, not fetched
        assert (tmp_path / "recipe" / "adapter_model.safetensors").is_file()
        assert "step 2/2 | reward" in result.stdout

        quickstart = ["recipes/quickstart.py", "--steps", "2", "--output_dir", str(tmp_path / "quickstart")]
        result = subprocess.run([*uv, *quickstart], capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "mean reward per logging window:" in result.stdout
    finally:
        shutil.rmtree(tmp_path / "uv-cache", ignore_errors=True)  # about 1.4 GB, torch included
