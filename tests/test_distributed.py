"""Two CPU processes (gloo) under `accelerate launch`: logged statistics are those of the pooled data."""

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from trl_grpo_ext.diagnostics import CORE_BIN_WIDTH

TESTS_DIR = os.path.dirname(__file__)
MICRO_BATCHES_PER_LOG = 4  # logging_steps=2 x gradient_accumulation_steps=2 in distributed_run.py


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script_args, temporary_dir, num_processes=2):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",  # with no GPU, torchrun starts CPU processes that talk through gloo
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *script_args,
    ]
    # TMPDIR: the launcher (torchrun) leaves `torchelastic_*` folders in the temporary folder.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=str(temporary_dir))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def two_process_run(tiny_model_path, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("two_processes")
    launch(
        [os.path.join(TESTS_DIR, "distributed_run.py"), str(output_dir), tiny_model_path],
        tmp_path_factory.mktemp("launcher_tmp"),
    )
    return [torch.load(output_dir / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
def test_logged_statistics_are_those_of_both_processes_pooled(two_process_run):
    ranks = two_process_run
    assert [rank["num_processes"] for rank in ranks] == [2, 2]
    logs = [entry for entry in ranks[0]["log_history"] if "loss" in entry]
    assert len(logs) == 2
    steps = [rank["records"]["steps"] for rank in ranks]
    # The processes saw different completions.
    assert not torch.equal(steps[0][0]["mask"], steps[1][0]["mask"]) or not torch.equal(
        steps[0][0]["advantages"], steps[1][0]["advantages"]
    )
    for window, entry in enumerate(logs):
        window_steps = [
            rank_steps[window * MICRO_BATCHES_PER_LOG : (window + 1) * MICRO_BATCHES_PER_LOG] for rank_steps in steps
        ]
        pooled = [step for rank_steps in window_steps for step in rank_steps]
        ratios = torch.cat([step["ratio"][step["mask"]] for step in pooled]).double()
        log_ratios = torch.cat([step["log_ratio"][step["mask"]] for step in pooled]).double()
        assert entry["ratio/mean"] == pytest.approx(ratios.mean().item(), rel=1e-9)
        assert entry["ratio/std"] == pytest.approx(ratios.std().item(), rel=1e-6)
        assert entry["ratio/min"] == pytest.approx(ratios.min().item(), rel=1e-7)
        assert entry["ratio/max"] == pytest.approx(ratios.max().item(), rel=1e-7)
        for quantile in (0.05, 0.5, 0.95):
            got = math.log(entry[f"ratio/p{round(quantile * 100):02d}"])
            lower = torch.quantile(log_ratios, quantile, interpolation="lower").item()
            higher = torch.quantile(log_ratios, quantile, interpolation="higher").item()
            assert lower - CORE_BIN_WIDTH - 1e-9 <= got <= higher + CORE_BIN_WIDTH + 1e-9
        policy = [step["policy_loss"].item() for step in pooled]
        penalty = [step["kl_penalty"].item() for step in pooled]
        assert entry["loss/policy"] == pytest.approx(sum(policy) / len(policy), rel=1e-6)
        assert entry["loss/kl_penalty"] == pytest.approx(sum(penalty) / len(penalty), rel=1e-6)
        assert entry["loss/policy"] + entry["loss/kl_penalty"] == pytest.approx(entry["loss"], rel=1e-5)
        # TRL's definitions: per micro-batch, a token mean over both processes; then the mean over micro-batches.
        per_step_kl, per_step_clip = [], []
        for first, second in zip(*window_steps, strict=True):
            tokens = first["mask"].sum() + second["mask"].sum()
            kl = first["per_token_kl"][first["mask"]].sum() + second["per_token_kl"][second["mask"]].sum()
            per_step_kl.append((kl / tokens).item())
            clipped = sum(
                (
                    ((step["ratio"] < 0.8) & (step["advantages"] < 0))
                    | ((step["ratio"] > 1.2) & (step["advantages"] > 0))
                )[step["mask"]].sum()
                for step in (first, second)
            )
            per_step_clip.append((clipped / tokens).item())
        assert entry["kl"] == pytest.approx(sum(per_step_kl) / len(per_step_kl), rel=1e-5)
        assert entry["clip_ratio/region_mean"] == pytest.approx(sum(per_step_clip) / len(per_step_clip), rel=1e-6)
        # Rewards are already gathered: both processes hold the same, whole generation batch.
        rewards = [rank["records"]["rewards"][window] for rank in ranks]
        assert torch.equal(rewards[0], rewards[1])
        group_stds = rewards[0].double().view(-1, 4).std(dim=1)
        assert entry["reward_std/group_mean"] == pytest.approx(group_stds.mean().item(), rel=1e-6)
        assert entry["reward_std/group_min"] == pytest.approx(group_stds.min().item(), abs=1e-7)
        assert entry["reward_std/group_max"] == pytest.approx(group_stds.max().item(), rel=1e-6)


@pytest.mark.slow
def test_diagnostics_add_exactly_one_collective_per_log_step(two_process_run):
    for rank in two_process_run:
        calls = rank["collectives"]
        assert rank["records"]["log_calls"] == 2
        assert calls["ours"] == rank["records"]["log_calls"]  # one gather per log step
        assert calls["ours_in_loss"] == 0  # nothing per micro-batch
        assert calls["total"] > calls["ours"]  # TRL's own collectives were counted by the same hooks
