"""The `trl-grpo-ext` command, `python -m trl_grpo_ext`, the demo files shipped in the package, and the wheel."""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import PackageNotFoundError, version

import pytest
from helpers import RECIPE_CONFIGS, REPO
from packaging.version import Version

from trl_grpo_ext.tools import cli
from trl_grpo_ext.tools.recipes import grpo
from trl_grpo_ext.tools.recipes.demo import DEMO_DIR

DEMO_FILES = ["config_demo.yaml", "base_model", "data"]


@pytest.fixture
def parsed(monkeypatch):
    """Runs commands with the training replaced by recording what it would have been given."""
    calls = []
    monkeypatch.setattr(grpo, "main", lambda *args: calls.append(args))
    return calls


@pytest.mark.parametrize("config", RECIPE_CONFIGS, ids=lambda path: os.path.relpath(path, REPO))
def test_the_grpo_command_parses_every_shipped_config(config, parsed):
    assert cli.main(["grpo", "--config", config, "--max_steps", "3"]) == 0
    ((script_args, training_args, model_args),) = parsed
    assert training_args.max_steps == 3 and training_args.loss_type == "grpo"
    assert script_args.reward_funcs and model_args.model_name_or_path


def test_the_demo_command_uses_the_files_shipped_in_the_package_and_flags_win(parsed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any folder
    assert cli.main(["demo", "--max_steps", "4", "--logging_steps", "1"]) == 0
    ((script_args, training_args, model_args),) = parsed
    assert model_args.model_name_or_path == os.path.join(DEMO_DIR, "base_model")
    assert script_args.dataset_name == os.path.join(DEMO_DIR, "data")
    assert os.path.isfile(os.path.join(model_args.model_name_or_path, "model.safetensors"))
    assert training_args.output_dir == os.path.join("runs", "tiny-demo")  # relative: lands in the current folder
    assert (training_args.max_steps, training_args.logging_steps) == (4, 1)
    assert model_args.use_peft and script_args.reward_funcs == ["exact_match"]  # the rest is the demo config
    cli.main(["demo", "--output_dir", str(tmp_path / "elsewhere"), "--model_name_or_path", "my/model"])
    assert parsed[1][1].output_dir == str(tmp_path / "elsewhere") and parsed[1][2].model_name_or_path == "my/model"


def test_a_second_demo_writes_to_a_fresh_folder_and_says_so(parsed, tmp_path, monkeypatch, capsys):
    """A second `trl-grpo-ext demo` trained over the first run's folder, silently (two TensorBoard runs in it)."""
    monkeypatch.chdir(tmp_path)
    first = os.path.join("runs", "tiny-demo")
    assert cli.main(["demo"]) == 0
    assert parsed[-1][1].output_dir == first and "earlier run" not in capsys.readouterr().out
    os.makedirs(os.path.join(first, "runs"))  # what the first run left
    for expected in ("tiny-demo-2", "tiny-demo-3"):
        assert cli.main(["demo"]) == 0
        assert parsed[-1][1].output_dir == os.path.join("runs", expected)
        assert capsys.readouterr().out.splitlines() == [
            f"{first} holds an earlier run: this run writes to {parsed[-1][1].output_dir} (--output_dir names "
            "another folder; --resume_from_checkpoint true continues the earlier run)."
        ]
        os.makedirs(os.path.join(parsed[-1][1].output_dir, "runs"))
    assert cli.main(["demo", "--resume_from_checkpoint", "true"]) == 0  # continues the run in its folder
    assert parsed[-1][1].output_dir == first
    assert cli.main(["grpo", "--config", os.path.join(DEMO_DIR, "config_demo.yaml"), "--output_dir", first]) == 0
    assert parsed[-1][1].output_dir == first  # a folder the config names is the recipe's to decide: kept


def tensorboard_missing(monkeypatch):
    """transformers' check, as after a plain `pip install trl-grpo-ext` (no `recipes` extra)."""
    import transformers.integrations

    monkeypatch.setattr(transformers.integrations, "is_tensorboard_available", lambda: False)


def test_the_demo_runs_without_tensorboard_when_it_is_missing_saying_so_once(parsed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tensorboard_missing(monkeypatch)
    assert cli.main(["demo", "--max_steps", "4"]) == 0
    ((_, training_args, _),) = parsed
    assert training_args.report_to == []  # the demo config names tensorboard
    output = capsys.readouterr().out
    assert output.count("TensorBoard is not installed") == 1
    assert "pip install tensorboard" in output


def test_the_demo_keeps_tensorboard_when_it_is_installed(parsed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--max_steps", "4"]) == 0
    assert parsed[0][1].report_to == ["tensorboard"] and "not installed" not in capsys.readouterr().out


@pytest.mark.parametrize("logger", ["tensorboard", "trackio", "wandb"])
def test_the_recipe_refuses_a_logger_that_is_not_installed_in_one_line(logger, monkeypatch):
    import transformers.integrations

    monkeypatch.setattr(transformers.integrations, f"is_{logger}_available", lambda: False)
    install = f"pip install {logger}"
    with pytest.raises(ValueError, match=f"^report_to names {logger}, which is not installed: {re.escape(install)}"):
        grpo.check_loggers_installed(["none", logger])
    grpo.check_loggers_installed([])  # nothing to check


@pytest.mark.slow
def test_the_demo_command_runs_where_tensorboard_cannot_be_imported(tmp_path):
    """`trl-grpo-ext demo` in a process where `import tensorboard` fails and transformers finds no TensorBoard (a
    `None` in `sys.modules` does both), matplotlib as well: the plain install's situation."""
    code = (
        "import sys\n"
        "for name in ('tensorboard', 'tensorboardX', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        "from trl_grpo_ext.tools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", code, "demo", *PLAIN_DEMO_FLAGS]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    check_plain_demo_run(result, tmp_path)


# A short demo run: two steps of 2 prompts x 8 completions, each logged, no held-out evaluation.
PLAIN_DEMO_FLAGS = ["--max_steps", "2", "--logging_steps", "1", "--eval_samples", "0", "--save_strategy", "no"]
PLAIN_DEMO_FLAGS += ["--per_device_train_batch_size", "16"]


def check_plain_demo_run(result: subprocess.CompletedProcess, workdir) -> None:
    """What a demo run without TensorBoard and matplotlib leaves: the adapter and card, no TensorBoard logs, no
    report, each absence said once with the command that adds them."""
    output = result.stdout + result.stderr
    assert output.count("TensorBoard is not installed") == 1, output[-4000:]
    files = set(os.listdir(workdir / "runs" / "tiny-demo"))
    assert {"adapter_model.safetensors", "README.md"} <= files and not {"runs", "report.png"} & files
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(os.path.join("Output folder: runs", "tiny-demo")) and "TensorBoard" not in last
    assert "no report.png: matplotlib is not installed (pip install matplotlib)" in last


@pytest.mark.parametrize(
    ("command", "first_line"),
    [
        ("grpo", "Train with GRPO (GRPOTrainerExt) from a YAML config and flags"),
        ("demo", "The offline demo: GRPO on a tiny shipped model"),
    ],
)
def test_help_says_what_a_command_does_before_its_arguments(command, first_line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: trl-grpo-ext {command} ")
    assert first_line in text.replace("\n", " ")
    assert text.index(first_line.split()[0]) < text.index("--learning_rate") < text.index("--lora_r")


def test_the_bare_command_lists_its_commands_on_stderr_and_exits_2_and_refuses_unknown_ones(capsys):
    assert cli.main([]) == 2
    text = capsys.readouterr().err
    assert all(command in text for command in ("grpo", "demo", "slurm")) and "usage: trl-grpo-ext" in text
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train"])
    assert exit_info.value.code == 2 and "invalid choice: 'train'" in capsys.readouterr().err


def test_python_m_trl_grpo_ext_and_the_recipe_script_run_the_same_recipe():
    for command, usage in (
        (["-m", "trl_grpo_ext", "demo", "--help"], "usage: trl-grpo-ext demo [--field value ...]"),
        (["recipes/grpo.py", "-h"], "usage: grpo.py --config <yaml> [--field value ...]"),
    ):
        result = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=REPO, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith(usage) and "--max_steps" in result.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(("target", "extra"), [("demo", "recipes"), ("quickstart", "recipes"), ("test", "dev")])
def test_make_installs_what_each_target_needs(target, extra, tmp_path):
    """`make demo` installs the `recipes` extra only (no DeepSpeed build); the tests get the `dev` extra."""
    dry_run = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert dry_run.returncode == 0, dry_run.stderr
    installs = [line for line in dry_run.stdout.splitlines() if "pip install -e" in line]
    assert installs[-1].endswith(f'pip install -e ".[{extra}]"'), installs
    if extra == "recipes":
        assert "[dev]" not in dry_run.stdout


def test_the_repository_holds_one_copy_of_the_demo_files():
    for name in DEMO_FILES:
        old_path = os.path.join(REPO, "recipes", "tiny", name)  # where they were, and where `make demo` reads them
        assert os.path.realpath(old_path) == os.path.realpath(os.path.join(DEMO_DIR, name)), name
    assert os.path.realpath(os.path.join(REPO, "trl_grpo_ext", "tools", "recipes", "tiny")) == os.path.realpath(
        DEMO_DIR
    )


def _copy_sources(destination):
    """What a wheel is built from, copied so that the build leaves nothing in the repository: the package, and the
    `benchmarks` package beside it (as in a checkout), which the wheel must leave out."""
    for package in ("trl_grpo_ext", "benchmarks"):
        shutil.copytree(
            os.path.join(REPO, package), destination / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), destination / name)


#: What the `recipes` extra adds (TensorBoard, matplotlib): left out of the plain install's view of the packages.
RECIPES_EXTRA_PACKAGES = ("tensorboard", "tensorboardx", "matplotlib", "mpl_toolkits", "pylab")


def _fresh_venv(venv, wheel, env, dependencies: str, *, with_pip: bool = True) -> str:
    """A virtual environment with the wheel installed (no dependencies, no index: no network) that sees the packages
    of the folder `dependencies` through a path file, which adds the folder without running its path files (so a
    development install of this project stays invisible there). Returns its `purelib` folder.

    Without `with_pip` the environment gets no pip of its own (creating one takes about 10 s here): this
    environment's pip installs the wheel into it (`pip --python`)."""
    subprocess.run(
        [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(venv)],
        check=True,
        timeout=600,
        env=env,
    )
    python = str(venv / "bin" / "python")
    fresh_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.strip()
    with open(os.path.join(fresh_site, "dependencies.pth"), "w") as handle:
        handle.write(dependencies + "\n")
    pip = [python, "-m", "pip"] if with_pip else [sys.executable, "-m", "pip", "--python", python]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--quiet", wheel], check=True, timeout=600, env=env)
    return fresh_site


def _without_recipes_extra(destination) -> str:
    """A folder of links to this environment's packages, without those of the `recipes` extra: what a plain
    `pip install trl-grpo-ext` has."""
    destination.mkdir()
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        if not name.lower().startswith(RECIPES_EXTRA_PACKAGES):
            os.symlink(os.path.join(site, name), destination / name)
    return str(destination)


@pytest.mark.slow
def test_the_wheel_installs_a_command_that_runs_the_demo_from_an_empty_folder(tmp_path):
    """Build the wheel, install it into a fresh virtual environment, run `trl-grpo-ext demo` in an empty folder; then
    the same as a plain install (`pip install trl-grpo-ext`, without the `recipes` extra: no TensorBoard, no
    matplotlib), which runs without TensorBoard logs and report.png, saying so.

    The wheel holds the package and its metadata only: not the benchmarks (`python -m benchmarks`, from a checkout).
    The fresh environments see this one's packages (torch, trl, ...) through a path file (see `_fresh_venv`).
    """
    sources = tmp_path / "src"
    sources.mkdir()
    _copy_sources(sources)
    # pip keeps nothing in the home folder, and the commands below see no PYTHONPATH (e.g. the repository).
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    # Build with this environment's setuptools when it is recent enough, else in isolation (pip fetches one).
    try:
        isolation = ["--no-build-isolation"] if Version(version("setuptools")) >= Version("77") else []
    except PackageNotFoundError:
        isolation = []
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(sources)]
    result = subprocess.run(build, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "dist" / "trl_grpo_ext-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "trl_grpo_ext/__init__.py" in names
    assert [name for name in names if name.startswith(("benchmarks/", "trl_grpo_ext/bench/"))] == []
    (metadata,) = {name.split("/")[0] for name in names} - {"trl_grpo_ext"}
    assert metadata.startswith("trl_grpo_ext-") and metadata.endswith(".dist-info"), metadata

    venv = tmp_path / "venv"
    fresh_site = _fresh_venv(venv, wheel, env, sysconfig.get_paths()["purelib"])
    workdir = tmp_path / "empty"
    workdir.mkdir()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import trl_grpo_ext; print(trl_grpo_ext.__file__)"],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    )
    assert where.stdout.startswith(fresh_site), where.stdout + where.stderr  # the wheel, not the repository

    command = [str(venv / "bin" / "trl-grpo-ext"), "demo", "--max_steps", "4", "--logging_steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    output_dir = workdir / "runs" / "tiny-demo"
    files = set(os.listdir(output_dir))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {"README.md", "report.png"} <= files
    assert result.stdout.strip().splitlines()[-1].startswith(os.path.join("Output folder: runs", "tiny-demo"))
    assert set(os.listdir(workdir)) == {"runs"}

    plain = tmp_path / "plain"
    _fresh_venv(plain, wheel, env, _without_recipes_extra(tmp_path / "plain-dependencies"), with_pip=False)
    workdir = tmp_path / "plain-empty"
    workdir.mkdir()
    command = [str(plain / "bin" / "trl-grpo-ext"), "demo", *PLAIN_DEMO_FLAGS]
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    check_plain_demo_run(result, workdir)
    assert set(os.listdir(workdir)) == {"runs"}
