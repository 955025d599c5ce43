"""`enable_sharded_engines_on_cpu`: accelerate starts FSDP or DeepSpeed on CPU processes only when asked to."""

import os
import subprocess
import sys

import pytest
import torch
from accelerate.state import PartialState
from helpers import REPO, free_port

from trl_grpo_ext.cpu_engines import enable_sharded_engines_on_cpu, requested_engine

MODULE = os.path.join(REPO, "trl_grpo_ext", "cpu_engines.py")
LAUNCHER_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK", "ACCELERATE_TORCH_DEVICE")
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the function does nothing")


@pytest.fixture
def launcher_env(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_engine_asked_for_is_read_from_the_launcher_environment(launcher_env):
    assert requested_engine() is None
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")
    assert requested_engine() == "fsdp"
    launcher_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert requested_engine() == "deepspeed"


def test_nothing_happens_without_a_launcher_or_without_a_sharded_engine(launcher_env):
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")  # but not started by a distributed launcher
    assert enable_sharded_engines_on_cpu() is None
    launcher_env.delenv("ACCELERATE_USE_FSDP")
    launcher_env.setenv("LOCAL_RANK", "0")  # a DDP launch
    assert enable_sharded_engines_on_cpu() is None
    assert "ACCELERATE_TORCH_DEVICE" not in os.environ


@needs_no_gpu
def test_it_refuses_to_run_after_accelerate_state_exists(launcher_env):
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")
    launcher_env.setenv("LOCAL_RANK", "0")
    launcher_env.setattr(PartialState, "_shared_state", {"distributed_type": "NO"})
    with pytest.raises(RuntimeError, match="before accelerate's state is created"):
        enable_sharded_engines_on_cpu()
    assert "ACCELERATE_TORCH_DEVICE" not in os.environ


# One process of a launch (world size 1): the module loaded alone (not the package), before accelerate is imported.
PROBE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cpu_engines", {MODULE!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("enabled:", module.enable_sharded_engines_on_cpu())
from accelerate import Accelerator
accelerator = Accelerator(cpu=sys.argv[1] == "cpu")
print("distributed_type:", accelerator.distributed_type, "device:", accelerator.device)
"""


def probe(engine_flag: str, cpu: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update({engine_flag: "true", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    env.pop("ACCELERATE_TORCH_DEVICE", None)
    command = [sys.executable, "-c", PROBE, "cpu" if cpu else "device"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@needs_no_gpu
@pytest.mark.slow
@pytest.mark.parametrize("cpu", [True, False], ids=["use_cpu", "no_use_cpu"])
def test_an_fsdp_launch_on_cpu_processes_runs_fsdp(cpu):
    result = probe("ACCELERATE_USE_FSDP", cpu)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "enabled: fsdp" in result.stdout
    assert "distributed_type: DistributedType.FSDP device: cpu" in result.stdout


@needs_no_gpu
@pytest.mark.slow
def test_deepspeed_with_use_cpu_is_refused_with_the_fix():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    result = probe("ACCELERATE_USE_DEEPSPEED", cpu=True)
    assert result.returncode != 0
    assert "DeepSpeed on CPU processes needs use_cpu=False" in result.stderr
