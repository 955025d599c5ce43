"""The scripts' PEP 723 headers (`uv run`, Hugging Face Jobs) and the Jobs commands of docs/recipes.md."""

import ast
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from trl_grpo_ext.tools.recipes import grpo

tomllib = pytest.importorskip("tomllib")  # Python 3.11

SCRIPTS = [os.path.join("recipes", "grpo.py"), os.path.join("recipes", "quickstart.py")]
# PEP 723's reference regular expression for a metadata block.
BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
# Where an import's name is not its distribution's.
DISTRIBUTIONS = {"trl_grpo_ext": "trl-grpo-ext"}


def script_metadata(path: str) -> dict:
    """The `script` block of a file, as `uv` reads it."""
    with open(os.path.join(REPO, path)) as handle:
        text = handle.read()
    (match,) = [match for match in BLOCK.finditer(text) if match.group("type") == "script"]
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:] for line in match.group("content").splitlines(True)
    )
    return tomllib.loads(content)


def imported_distributions(path: str) -> set[str]:
    """The distributions of the modules a script imports (the standard library left out)."""
    with open(os.path.join(REPO, path)) as handle:
        tree = ast.parse(handle.read())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    tops = {module.split(".")[0] for module in modules} - set(sys.stdlib_module_names)
    return {canonicalize_name(DISTRIBUTIONS.get(top, top)) for top in tops}


@pytest.mark.parametrize("path", SCRIPTS)
def test_each_script_header_parses_and_lists_what_the_script_imports(path):
    metadata = script_metadata(path)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    assert metadata["requires-python"] == project["requires-python"]
    listed = {canonicalize_name(Requirement(line).name) for line in metadata["dependencies"]}
    assert imported_distributions(path) <= listed, (path, listed)


def test_the_recipe_header_brings_the_extras_and_the_logger_the_recipes_use():
    requirements = {Requirement(line).name: Requirement(line) for line in script_metadata(SCRIPTS[0])["dependencies"]}
    assert {"recipes", "math"} <= requirements["trl-grpo-ext"].extras  # TensorBoard, matplotlib; math-verify
    assert "trackio" in requirements  # report_to trackio, as in the Jobs commands


def jobs_commands() -> list[list[str]]:
    """The `hf jobs uv run` commands of docs/recipes.md, split as a shell splits them (`<your-user>` filled in)."""
    with open(os.path.join(REPO, "docs", "recipes.md")) as handle:
        blocks = re.findall(r"```bash\n(.*?)```", handle.read(), re.DOTALL)
    commands = [block.replace("\\\n", " ") for block in blocks if block.startswith("hf jobs uv run")]
    return [shlex.split(command.replace("<your-user>", "me")) for command in commands]


def test_the_docs_give_a_jobs_command_for_each_gsm8k_recipe():
    configs = [command[command.index("--config") + 1] for command in jobs_commands()]
    assert sorted(configs) == [
        "recipes/Qwen2.5-0.5B-Instruct/grpo/config_gsm8k_lora.yaml",
        "recipes/Qwen2.5-1.5B-Instruct/grpo/config_gsm8k_full.yaml",
    ]


@pytest.mark.parametrize("command", jobs_commands(), ids=lambda command: command[command.index("--config") + 1])
def test_the_jobs_command_runs_the_recipe_with_push_to_hub_and_trackio(command, monkeypatch):
    script = command.index("recipes/grpo.py")
    assert command[:4] == ["hf", "jobs", "uv", "run"]
    assert command[4:script] == ["--flavor", "a100-large", "--timeout", "2h", "--secrets", "HF_TOKEN"] + [
        "--env",
        "UV_NO_SOURCES=1",  # the job has the script, not the clone: the package from PyPI
    ]
    script_args = command[script + 1 :]
    monkeypatch.chdir(REPO)  # the paths are the clone's, as `hf` uploads them
    _, training_args, _ = grpo.parse_args(script_args)
    assert training_args.push_to_hub and training_args.hub_model_id.startswith("me/")
    assert training_args.hub_strategy == "every_save"
    assert training_args.report_to == ["trackio"] and training_args.trackio_space_id == "me/trackio"


HF = os.path.join(os.path.dirname(sys.executable), "hf")


@pytest.mark.skipif(not os.path.exists(HF), reason="needs huggingface_hub's `hf` command")
@pytest.mark.parametrize("command", jobs_commands(), ids=lambda command: command[command.index("--config") + 1])
def test_hf_would_submit_the_jobs_command_as_written(command, tmp_path):
    """`hf jobs uv run --dry-run` (no network, nothing submitted): the flavor, timeout and secret, and every argument
    after the script reaches the script (`hf` takes its own options anywhere on the line)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_TOKEN="hf_not_a_real_token", NO_COLOR="1", HF_HOME=str(tmp_path))
    result = subprocess.run(
        [HF, *command[1:4], "--dry-run", *command[4:]], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = dict(line.strip().split(None, 1) for line in result.stdout.splitlines()[1:] if line.startswith("  "))
    script = command.index("recipes/grpo.py")
    assert summary["script"] == "recipes/grpo.py" and shlex.split(summary["args"]) == command[script + 1 :]
    assert (summary["flavor"], summary["timeout"], summary["secrets"]) == ("a100-large", "2h", "HF_TOKEN=***")
    assert "Job not submitted" in result.stdout
