"""The SLURM launcher (N training nodes + 1 vLLM server node), with fake `SLURM_*` variables and a fake `srun`."""

import os
import shlex
import subprocess

import pytest
from helpers import REPO

from trl_grpo_ext.tools import cli
from trl_grpo_ext.tools.recipes import grpo, slurm
from trl_grpo_ext.tools.recipes.slurm import expand_hostlist

FULL_CONFIG = os.path.join("recipes", "Qwen2.5-1.5B-Instruct", "grpo", "config_gsm8k_full.yaml")
ZERO2 = os.path.join("recipes", "accelerate_configs", "zero2.yaml")
THREE_NODES = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("node07", ["node07"]),
        ("node[08-10]", ["node08", "node09", "node10"]),  # padded to the lower bound's width
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("node[01-02,07],gpu-a[1-2]-ib,login", ["node01", "node02", "node07", "gpu-a1-ib", "gpu-a2-ib", "login"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_the_host_list_parser_expands_ranges_padding_lists_and_groups(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["", "node[01-03", "node]01", "node[a-c]", "node[3-1]", "node[1-]", "a,,b"])
def test_the_host_list_parser_refuses_what_it_cannot_read(hostlist):
    with pytest.raises(ValueError, match="host list|range"):
        expand_hostlist(hostlist)


@pytest.fixture
def slurm_job(monkeypatch):
    """A fake allocation (no `scontrol` on PATH: the launcher's own parser reads the node list), run from the
    repository root."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)

    def set_job(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_job


def dry_run(capsys, *args) -> list[list[str]]:
    """`trl-grpo-ext slurm --dry-run ...`: the commands it prints, split as a shell splits them."""
    assert cli.main(["slurm", "--dry-run", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.startswith("# ") for line in lines] == [True, False] * (len(lines) // 2)  # a comment per command
    return [shlex.split(line) for line in lines if not line.startswith("#")]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_dry_run_prints_the_vllm_server_on_the_last_node_and_one_training_command_per_other_node(slurm_job, capsys):
    slurm_job(**THREE_NODES)
    server, *training = dry_run(capsys, "--config", FULL_CONFIG, "--accelerate_config", ZERO2, "--max_steps", "10")
    assert server[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node03"]
    assert server[4:9] == ["env", "VLLM_SERVER_DEV_MODE=1", "vllm", "serve", "Qwen/Qwen2.5-1.5B-Instruct"]
    assert option(server, "--revision") == "main" and option(server, "--port") == "8000"
    assert (option(server, "--tensor-parallel-size"), option(server, "--data-parallel-size")) == ("1", "1")
    assert len(training) == 2 and not any(part.startswith("--cpus-per-task") for part in server)
    for rank, (node, command) in enumerate(zip(["node01", "node02"], training, strict=True)):
        assert command[:4] == ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}"]
        assert command[4:6] == ["accelerate", "launch"] and option(command, "--config_file") == ZERO2
        assert option(command, "--machine_rank") == str(rank)
        assert (option(command, "--num_machines"), option(command, "--num_processes")) == ("2", "16")
        assert option(command, "--main_process_ip") == "node01"
        assert option(command, "--main_process_port") == "29500"
        recipe = command[command.index("-m") :]
        assert recipe[:3] == ["-m", "trl_grpo_ext", "grpo"]
        # What each training process runs parses as the recipe's arguments: vLLM in server mode on node03.
        script_args, training_args, model_args = grpo.parse_args(recipe[3:])
        assert training_args.use_vllm and training_args.vllm_mode == "server"
        assert (training_args.vllm_server_host, training_args.vllm_server_port) == ("node03", 8000)
        assert training_args.max_steps == 10 and model_args.model_name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert training[0][training[0].index("-m") :] == training[1][training[1].index("-m") :]


def test_dry_run_takes_ports_gpus_and_the_vllm_server_size_from_the_options(slurm_job, capsys):
    slurm_job(SLURM_JOB_NODELIST="gpu-[7-8],gpu-12", SLURM_NNODES="3", SLURM_CPUS_ON_NODE="96")  # GPUs: see below
    options = ["--gpus_per_node", "4", "--main_process_port", "6000", "--vllm_port", "8100"]
    options += ["--vllm_tensor_parallel_size", "2", "--vllm_data_parallel_size", "2"]
    server, first, second = dry_run(capsys, "--config", FULL_CONFIG, "--accelerate_config", ZERO2, *options)
    assert "--nodelist=gpu-12" in server
    assert all("--cpus-per-task=96" in command for command in (server, first, second))  # the node's CPUs
    assert (option(server, "--tensor-parallel-size"), option(server, "--data-parallel-size")) == ("2", "2")
    assert option(server, "--port") == "8100"
    assert "--nodelist=gpu-7" in first and "--nodelist=gpu-8" in second
    assert option(first, "--num_processes") == "8" and option(first, "--main_process_ip") == "gpu-7"
    assert option(first, "--main_process_port") == "6000"
    assert (option(first, "--vllm_server_host"), option(first, "--vllm_server_port")) == ("gpu-12", "8100")


@pytest.mark.parametrize(
    ("variables", "args", "message"),
    [
        ({}, [], "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "node01", "SLURM_GPUS_ON_NODE": "8"}, [], "needs N \\+ 1"),
        ({**THREE_NODES, "SLURM_JOB_NUM_NODES": "4"}, [], "SLURM_JOB_NUM_NODES=4 but"),
        ({**THREE_NODES, "SLURM_GPUS_ON_NODE": ""}, [], "pass --gpus_per_node"),
        (THREE_NODES, ["--vllm_mode", "colocate"], "vllm_mode is 'colocate'"),
        (THREE_NODES, ["--use_vllm=false"], "use_vllm is false"),
        (THREE_NODES, ["--vllm_server_host", "elsewhere"], "vllm_server_host is set"),
        (THREE_NODES, ["--vllm_tensor_parallel_size", "4", "--vllm_data_parallel_size", "4"], "needs 16 GPUs"),
        (THREE_NODES, ["--gpus-per-node", "8"], "Unknown flag --gpus-per-node"),
    ],
)
def test_the_launcher_refuses_what_it_cannot_run(slurm_job, variables, args, message):
    slurm_job(**variables)
    with pytest.raises(ValueError, match=message):
        cli.main(["slurm", "--dry-run", "--config", FULL_CONFIG, "--accelerate_config", ZERO2, *args])


FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$SRUN_LOG"
case "$*" in
  *"vllm serve"*) trap 'echo "server stopped" >> "$SRUN_LOG"; exit 0' TERM; while true; do sleep 0.05; done ;;
  *"--machine_rank 1 "*)  # after rank 0 has started: a failing rank makes the launcher stop the others
    until grep -q -- "--machine_rank 0 " "$SRUN_LOG"; do sleep 0.05; done; exit "${RANK1_STATUS:-0}" ;;
esac
"""


@pytest.mark.parametrize("rank1_status", [0, 3])
def test_the_job_stops_the_server_when_training_ends_with_the_training_status(
    slurm_job, monkeypatch, tmp_path, rank1_status
):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text(FAKE_SRUN)
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SRUN_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setenv("RANK1_STATUS", str(rank1_status))
    slurm_job(**THREE_NODES)
    cli_args, recipe_flags = slurm._parser("slurm").parse_known_args(
        ["--config", FULL_CONFIG, "--accelerate_config", ZERO2]
    )
    plan = slurm.plan_from_environment(cli_args, recipe_flags)
    assert slurm.execute(plan, poll_seconds=0.05) == rank1_status
    log = (tmp_path / "srun.log").read_text().splitlines()
    assert sum("vllm serve" in line for line in log) == 1 and sum("accelerate launch" in line for line in log) == 2
    assert log[-1] == "server stopped"


def test_the_batch_script_runs_the_launcher_once_per_job():
    script = os.path.join(REPO, "recipes", "slurm", "train.slurm")
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    text = open(script).read()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --nodes=3" in text
    assert text.rstrip().endswith('exec python -m trl_grpo_ext.tools.recipes.slurm "$@"')
