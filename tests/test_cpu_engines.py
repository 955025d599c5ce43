"""The CPU shims of the tests (`tests/cpu_engines.py`): accelerate starts FSDP or DeepSpeed on CPU processes only when
asked to; the module runs a script with them; the flags are read one way; vLLM gets the shim through the tests' plugin,
the package registering none."""

import importlib.util
import os
import subprocess
import sys

import cpu_engines
import pytest
import torch
from accelerate.state import PartialState
from cpu_engines import VLLM_ON_CPU_ENV, enable_sharded_engines_on_cpu, env_flag, requested_engine
from helpers import REPO, free_port

MODULE = os.path.join(REPO, "tests", "cpu_engines.py")
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


@pytest.mark.parametrize("value", ["1", "true", "Yes"])
def test_a_flag_is_read_one_way(monkeypatch, value):
    monkeypatch.setenv("SOME_FLAG", value)
    assert env_flag("SOME_FLAG")
    monkeypatch.setenv("SOME_FLAG", "0")
    assert not env_flag("SOME_FLAG") and not env_flag("AN_UNSET_FLAG")


def test_run_as_a_script_it_runs_the_script_it_is_given_as_main(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print('ran', sys.argv)\n")
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_ENV}
    result = subprocess.run(
        [sys.executable, MODULE, str(script), "--flag", "1"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ran [{str(script)!r}, '--flag', '1']"


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


def test_the_package_registers_no_vllm_plugin_and_the_tests_plugin_applies_the_shim_where_asked(monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        assert "vllm.general_plugins" not in tomllib.load(handle)["project"].get("entry-points", {})
    plugin_dir = os.path.join(REPO, "tests", "vllm_plugin")
    with open(os.path.join(plugin_dir, "pyproject.toml"), "rb") as handle:
        (target,) = tomllib.load(handle)["project"]["entry-points"]["vllm.general_plugins"].values()
    name, function = target.split(":")
    spec = importlib.util.spec_from_file_location(name, os.path.join(plugin_dir, f"{name}.py"))
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    calls = []
    monkeypatch.setattr(cpu_engines, "enable_vllm_on_cpu", lambda: calls.append("shim"))
    monkeypatch.delenv(VLLM_ON_CPU_ENV, raising=False)
    getattr(plugin, function)()
    assert calls == []
    monkeypatch.setenv(VLLM_ON_CPU_ENV, "1")
    getattr(plugin, function)()
    assert calls == ["shim"]
