"""One console for the recipe, the quickstart and the Python API: `GRPOConfigExt.console`, compact by default; the
README's offline example runs as written."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, make_trainer
from transformers import PrinterCallback, ProgressCallback
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.extras.console import ConsoleCallback

ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def console_kinds(trainer) -> list[type]:
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    return [kind for kind in kinds if issubclass(kind, (PrinterCallback, ProgressCallback))]


@pytest.fixture
def build(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    def build(config_class=GRPOConfigExt, **overrides):
        return make_trainer(
            tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, config_cls=config_class, **overrides
        )

    return build


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_the_trainer_shows_the_compact_console_by_default(build, disable_tqdm):
    assert console_kinds(build(disable_tqdm=disable_tqdm)) == [ConsoleCallback]


def test_a_plain_trl_config_gets_the_compact_console_too(build):
    kwargs = {"loss_type": "grpo", "beta": 0.04}
    assert console_kinds(build(GRPOConfig, **kwargs)) == [ConsoleCallback]


@pytest.mark.parametrize(("disable_tqdm", "kind"), [(True, PrinterCallback), (False, ProgressCallback)])
def test_console_raw_keeps_transformers_own(build, disable_tqdm, kind):
    assert console_kinds(build(console="raw", disable_tqdm=disable_tqdm)) == [kind]


def test_installing_the_console_again_keeps_one(build):
    trainer = build()
    ConsoleCallback.install(trainer)
    assert console_kinds(trainer) == [ConsoleCallback]


def test_a_python_api_run_prints_compact_lines_and_raw_prints_dicts(build, capsys):
    build(max_steps=2).train()
    out = capsys.readouterr().out
    starts = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("step ")]
    assert starts == ["step 1/2", "step 2/2", "step 2/2"]  # two log steps and the end-of-training summary
    assert "'loss':" not in out
    build(max_steps=1, console="raw").train()
    out = capsys.readouterr().out
    assert "'loss':" in out and not any(line.startswith("step ") for line in out.splitlines())


def readme_offline_example() -> str:
    with open(os.path.join(REPO, "README.md")) as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), re.DOTALL)
    (example,) = [block for block in blocks if "DEMO_MODEL" in block]
    return example


def test_the_readme_offline_example_runs_as_written(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", readme_offline_example()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 5/10 | reward ") and lines[1].startswith("step 10/10 | reward ")
    assert lines[-1].startswith("step 10/10 | train_runtime ") and "'loss':" not in result.stdout


@pytest.mark.slow
def test_the_quickstart_script_prints_the_compact_console(tmp_path):
    command = [sys.executable, os.path.join(REPO, "recipes", "quickstart.py"), "--steps", "5"]
    command += ["--output_dir", str(tmp_path / "quickstart")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step 5/5 | reward " in result.stdout and "'loss':" not in result.stdout
    assert "mean reward per logging window:" in result.stdout


@pytest.mark.slow
def test_the_quickstart_first_run_raises_no_alarm_and_its_reward_rises(tmp_path):
    command = [sys.executable, os.path.join(REPO, "recipes", "quickstart.py"), "--output_dir", str(tmp_path / "qs")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert "ALARM" not in output and "[alarms/" not in output, output[-4000:]
    summary = next(line for line in result.stdout.splitlines() if line.startswith("mean reward per logging window:"))
    rewards = [float(value) for value in summary.split(":")[1].split("->")]
    assert rewards[-1] > rewards[0] + 0.5
