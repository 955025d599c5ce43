"""A launch of several processes that accelerate runs as independent single-process runs is refused."""

from types import SimpleNamespace

import pytest
from helpers import launch

from trl_grpo_ext.guardrails.launch import check_launch, launched_processes


def accelerator(num_processes, distributed_type="NO"):
    return SimpleNamespace(num_processes=num_processes, distributed_type=SimpleNamespace(value=distributed_type))


def test_several_launched_processes_that_accelerate_runs_alone_are_refused():
    environ = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    with pytest.raises(ValueError) as refused:
        check_launch(accelerator(1), environ)
    message = str(refused.value)
    assert "2 processes (WORLD_SIZE=2)" in message and "num_processes=1, distributed_type=NO" in message
    assert "same output_dir" in message  # why
    assert "use_cpu=True" in message and "CUDA_VISIBLE_DEVICES=''" in message  # what to set


def test_an_mpi_launch_that_accelerate_runs_alone_is_refused():
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_SIZE=4"):
        check_launch(accelerator(1), {"OMPI_COMM_WORLD_SIZE": "4"})


@pytest.mark.parametrize(
    "num_processes, environ",
    [
        (2, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}),  # a real distributed run
        (1, {}),  # a plain `python` run
        (1, {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}),  # a launch of one process
        (1, {"WORLD_SIZE": ""}),
    ],
)
def test_a_launch_that_accelerate_joined_or_no_launch_passes(num_processes, environ):
    check_launch(accelerator(num_processes, "MULTI_CPU" if num_processes > 1 else "NO"), environ)


def test_launched_processes_reads_the_launcher_variables():
    assert launched_processes({}) is None
    assert launched_processes({"WORLD_SIZE": "not a number"}) is None
    assert launched_processes({"WORLD_SIZE": "1", "PMI_SIZE": "3"}) == ("PMI_SIZE", 3)
    assert launched_processes({"WORLD_SIZE": "2", "PMI_SIZE": "3"}) == ("WORLD_SIZE", 2)


@pytest.mark.slow
@pytest.mark.parametrize("use_cpu", [False, True], ids=["use_cpu=False", "use_cpu=True"])
def test_a_cpu_launch_is_refused_without_use_cpu(tmp_path, tiny_model_path, use_cpu):
    # tests/launched.py's `build` phase builds the trainer in two processes that see no GPU (`launch` sets
    # CUDA_VISIBLE_DEVICES=""); with use_cpu=False accelerate runs each on its own.
    result = launch(
        "cpu_ddp.yaml", tmp_path / "out", tiny_model_path, ["build"], "--use_cpu", str(use_cpu).lower(), check=False
    )
    output = result.stdout + result.stderr
    if use_cpu:
        assert result.returncode == 0, output[-4000:]
        assert result.stdout.count("num_processes=2") == 2 and result.stdout.count("launch checked") == 2
    else:
        assert result.returncode != 0, output[-4000:]
        assert "ValueError: The launcher started 2 processes (WORLD_SIZE=2)" in output, output[-4000:]
        assert "use_cpu=True" in output and "launch checked" not in output
