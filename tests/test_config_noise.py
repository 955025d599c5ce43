"""No warning that the package's own configs cause: not from a `GRPOConfigExt` with its defaults, not from the shipped
YAML configs, not from a demo run with checkpoints and held-out evaluations, even with every warning shown."""

import glob
import os
import subprocess
import sys
import warnings

import pytest
from helpers import REPO

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.tools.recipes import grpo

CONFIGS = sorted(glob.glob(os.path.join(REPO, "recipes", "**", "*.yaml"), recursive=True))
CONFIGS = [path for path in CONFIGS if "accelerate_configs" not in path]


def warnings_of(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [f"{warning.category.__name__}: {warning.message}" for warning in caught]


def test_a_config_with_the_defaults_warns_about_nothing(tmp_path):
    assert warnings_of(lambda: GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)) == []


def test_activation_checkpointing_is_on_by_default_as_in_trl_and_off_in_one_name(tmp_path):
    on = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)
    off = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=False)
    assert (on.gradient_checkpointing, on.activation_checkpointing) == (True, True)  # TRL's default
    assert (off.gradient_checkpointing, off.activation_checkpointing) == (False, False)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: os.path.relpath(path, REPO))
def test_each_shipped_config_parses_without_a_warning(config, monkeypatch):
    monkeypatch.chdir(REPO)
    assert warnings_of(lambda: grpo.parse_args(["--config", config])) == []


@pytest.mark.slow
def test_a_demo_run_with_checkpoints_shows_no_warning_even_with_every_warning_on(tmp_path):
    """`python -W always` (each warning at each occurrence): four steps, a checkpoint every two, held-out passes."""
    command = [sys.executable, "-W", "always", "-m", "trl_grpo_ext", "demo", "--max_steps", "4", "--logging_steps"]
    command += ["1", "--save_steps", "2", "--eval_samples", "8", "--heldout_every_steps", "2"]
    command += ["--per_device_train_batch_size", "16"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert {"checkpoint-2", "checkpoint-4", "report.png"} <= set(os.listdir(tmp_path / "runs" / "tiny-demo"))
    shown = result.stdout + result.stderr
    for word in ("Warning:", "deprecated", "matplotlib"):
        assert word not in shown, shown[-4000:]
