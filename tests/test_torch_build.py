"""The build of torch the set-up installs (`tools/torch_build.py`, used by the Makefile): the CPU build where no
NVIDIA driver is found, PyPI's CUDA build where one is. Drivers are simulated (a fake `nvidia-smi` on the search
path, a folder standing for `/proc/driver/nvidia`); nothing is installed."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11

spec = importlib.util.spec_from_file_location("torch_build", os.path.join(REPO, "tools", "torch_build.py"))
torch_build = importlib.util.module_from_spec(spec)
sys.modules["torch_build"] = torch_build  # dataclasses look their module up
spec.loader.exec_module(torch_build)

PINNED = f"torch=={torch_build.TORCH_VERSION}"
CPU = f"{PINNED}+cpu"
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def fake_driver_tool(folder) -> str:
    """A folder holding an executable `nvidia-smi`, for a search path."""
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'NVIDIA-SMI 580.65'\n")
    tool.chmod(0o755)
    return str(folder)


def local_wheels(folder, tag: str = TAG) -> str:
    """A folder like pip's `--find-links` one, holding (an empty file named as) torch's CPU wheel."""
    folder.mkdir(exist_ok=True)
    (folder / f"torch-{torch_build.TORCH_VERSION}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return str(folder)


def test_without_a_driver_linux_gets_the_cpu_build_from_pytorchs_cpu_index():
    build = torch_build.choose(system="Linux", driver=None)
    assert build.pip_args() == [CPU, "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert build.uv_run_args() == ["--index", torch_build.CPU_INDEX, "--index-strategy", "unsafe-best-match"]
    assert "no NVIDIA driver" in build.reason


def test_with_a_driver_linux_gets_pypis_cuda_build():
    build = torch_build.choose(system="Linux", driver="/usr/bin/nvidia-smi")
    assert build.pip_args() == [PINNED] and build.uv_run_args() == []
    assert "/usr/bin/nvidia-smi" in build.reason


def test_a_local_cpu_wheel_for_this_python_is_taken_without_the_index(tmp_path):
    empty, wheels = str(tmp_path / "nothing-here"), local_wheels(tmp_path / "wheels")
    build = torch_build.choose(system="Linux", find_links=f"{empty} file://{wheels}")
    assert build.pip_args() == [CPU]
    assert build.uv_run_args() == ["--find-links", wheels, "--exclude-newer-package", "torch=1970-01-01T00:00:00Z"]
    other_python = local_wheels(tmp_path / "other", tag="cp39")
    assert torch_build.choose(system="Linux", find_links=other_python).index_url == torch_build.CPU_INDEX


def test_a_driver_wins_over_a_local_cpu_wheel(tmp_path):
    build = torch_build.choose(system="Linux", find_links=local_wheels(tmp_path / "wheels"), driver="/proc/x")
    assert build.pip_args() == [PINNED]


def test_the_choice_by_hand_wins_over_the_machine():
    assert torch_build.choose("cuda", system="Linux", driver=None).pip_args() == [PINNED]
    assert torch_build.choose("cpu", system="Linux", driver="/usr/bin/nvidia-smi").requirement == CPU
    index = "https://download.pytorch.org/whl/cu128"
    assert torch_build.choose("cpu", index, system="Linux").pip_args() == [PINNED, "--index-url", index]
    with pytest.raises(ValueError, match="TORCH_BACKEND='rocm'"):
        torch_build.choose("rocm")


@pytest.mark.parametrize("system", ["Darwin", "Windows"])
def test_other_systems_get_pypis_build_which_is_a_cpu_build_there(system):
    assert torch_build.choose(system=system, driver=None).pip_args() == [PINNED]


def test_a_driver_is_found_by_its_tool_on_the_path_or_its_proc_folder(tmp_path):
    no_proc = str(tmp_path / "no-proc")
    assert torch_build.find_nvidia_driver(path=str(tmp_path), proc_dir=no_proc) is None
    tools = fake_driver_tool(tmp_path / "bin")
    assert torch_build.find_nvidia_driver(path=tools, proc_dir=no_proc) == os.path.join(tools, "nvidia-smi")
    proc = tmp_path / "proc"
    proc.mkdir()
    assert torch_build.find_nvidia_driver(path=str(tmp_path), proc_dir=str(proc)) == str(proc)


def test_the_script_prints_the_arguments_of_pip_and_uv(tmp_path):
    env = dict(os.environ, PATH=fake_driver_tool(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    script = [sys.executable, os.path.join(REPO, "tools", "torch_build.py")]

    def run(*args, **settings):
        return subprocess.run([*script, *args], capture_output=True, text=True, env=dict(env, **settings), timeout=60)

    assert run("pip").stdout == f"{PINNED}\n" and run("uv-run").stdout == "\n"
    assert "NVIDIA driver found" in run("explain").stdout
    cpu = run("pip", TORCH_BACKEND="cpu", PIP_FIND_LINKS="")
    assert cpu.stdout == f"{CPU} --index-url {torch_build.CPU_INDEX}\n"
    assert run("pip", TORCH_BACKEND="tpu").returncode == 2 and run().returncode == 2


def make_setup(tmp_path, **env) -> list[str]:
    """The commands `make setup` would run in a new environment (`make -n`: nothing runs but the torch decision)."""
    result = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, **env),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.replace("\\\n", " ").splitlines()


def torch_install(commands: list[str]) -> str:
    """What the set-up's torch install asks pip for."""
    (line,) = [line for line in commands if "tools/torch_build.py explain" in line]
    return re.search(r"-m pip install (.*?);", line).group(1).strip()


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
def test_make_setup_installs_pypis_cuda_build_where_a_driver_is_found(tmp_path):
    path = fake_driver_tool(tmp_path / "bin") + os.pathsep + os.environ["PATH"]
    commands = make_setup(tmp_path, PATH=path, PIP_FIND_LINKS=local_wheels(tmp_path / "wheels"))
    assert torch_install(commands) == PINNED
    # The project's install comes after it and keeps it (the range admits it).
    assert commands.index(next(c for c in commands if 'pip install -e ".[recipes]"' in c)) > 1


@needs_make
@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or os.path.isdir(torch_build.DRIVER_PROC), reason="a driver is here"
)
def test_make_setup_installs_the_cpu_build_where_no_driver_is_found(tmp_path):
    assert torch_install(make_setup(tmp_path, PIP_FIND_LINKS="")) == f"{CPU} --index-url {torch_build.CPU_INDEX}"
    # A machine that keeps the CPU wheel in pip's local folder installs it from there.
    assert torch_install(make_setup(tmp_path, PIP_FIND_LINKS=local_wheels(tmp_path / "wheels"))) == CPU


@needs_make
def test_make_setup_takes_the_build_named_by_hand(tmp_path):
    index = "https://download.pytorch.org/whl/cu128"
    assert torch_install(make_setup(tmp_path, TORCH_INDEX=index)) == f"{PINNED} --index-url {index}"
    path = fake_driver_tool(tmp_path / "bin") + os.pathsep + os.environ["PATH"]
    commands = make_setup(tmp_path, PATH=path, TORCH_BACKEND="cpu", PIP_FIND_LINKS="")
    assert torch_install(commands) == f"{CPU} --index-url {torch_build.CPU_INDEX}"


def test_the_makefile_pin_and_the_project_admit_the_release_the_script_installs():
    with open(os.path.join(REPO, "Makefile")) as handle:
        (spec_line,) = re.findall(r"(?m)^TORCH_SPEC \?= (.*)$", handle.read())
    assert spec_line == PINNED
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        dependencies = [Requirement(line) for line in tomllib.load(handle)["project"]["dependencies"]]
    (torch,) = [requirement for requirement in dependencies if requirement.name == "torch"]
    assert torch.specifier.contains(torch_build.TORCH_VERSION) and torch.specifier.contains(f"{PINNED[7:]}+cpu")


def test_the_docs_uv_run_lines_pass_the_machines_torch_build():
    """Each `uv run` of a recipe script in the README and docs/ (Hugging Face Jobs aside: GPU machines) takes its
    torch arguments from the script, so that a CPU machine is not sent PyPI's CUDA build."""
    pages = [os.path.join(REPO, "README.md")] + [
        os.path.join(REPO, "docs", name) for name in sorted(os.listdir(os.path.join(REPO, "docs")))
    ]
    found = 0
    for page in pages:
        with open(page) as handle:
            text = handle.read().replace("\n", " ")
        for match in re.finditer(r"(?<!jobs )uv run (.{0,60}?)recipes/\w+\.py", text):
            found += 1
            assert match.group(1) == "$(python3 tools/torch_build.py uv-run) ", (page, match.group(0))
    assert found >= 3


def test_the_readme_installs_the_machines_torch_before_the_wheel():
    with open(os.path.join(REPO, "README.md")) as handle:
        lines = [line.split("#")[0].strip() for line in handle]
    wheel = next(i for i, line in enumerate(lines) if line.startswith('pip install "$(ls dist/trl_grpo_ext-'))
    assert lines[wheel - 1] == "pip install $(python3 tools/torch_build.py pip)"
