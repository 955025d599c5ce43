"""Dynamic sampling and row skipping in two CPU processes (gloo), under DDP, FSDP2 and DeepSpeed ZeRO-3: one launch
of tests/launched.py's sampling phases per engine."""

import pytest
import torch
from helpers import launch, phase_results

ENGINES = {"ddp": "cpu_ddp.yaml", "fsdp2": "cpu_fsdp2.yaml", "zero3": "cpu_zero3.yaml"}
G = 4


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_run(request, tiny_model_path, tmp_path_factory) -> str:
    if request.param.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[dev]' installs it)")
    output_dir = str(tmp_path_factory.mktemp(request.param))
    phases = ["dynamic", "skip-whole", "skip", "disagree"]  # "disagree" ends training with an error: last
    launch(ENGINES[request.param], output_dir, tiny_model_path, phases)
    return output_dir, request.param


# The engine accelerate must really run (a CPU launch can silently fall back to independent processes).
ACTIVE_ENGINE = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}


def training_logs(rank: dict) -> list[dict]:
    return [{k: v for k, v in entry.items() if k != "step_time"} for entry in rank["log_history"] if "loss" in entry]


def reward_constant_on_some_prompts(prompt: str, completion: str) -> float:  # tests/launched.py's
    return 1.0 if prompt in ("xyz=", "qq=") else completion.count("a") + 0.1 * len(completion)


@pytest.mark.slow
def test_processes_keep_the_same_groups_train_as_many_micro_batches_and_log_alike(engine_run):
    engine_run, engine = engine_run
    ranks = phase_results(engine_run, "dynamic")
    assert all(rank["error"] is None for rank in ranks)
    for rank in ranks:
        assert rank["engine"]["processes"] == 2 and rank["engine"]["distributed_type"].endswith(ACTIVE_ENGINE[engine])
    assert training_logs(ranks[0]) == training_logs(ranks[1])
    assert ranks[0]["micro_batches"] == ranks[1]["micro_batches"] == 8
    logs = [entry for entry in training_logs(ranks[0]) if "dynamic_sampling/rounds" in entry]
    assert any(entry["dynamic_sampling/rounds"] > 0 for entry in logs)
    for first, second in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        # 3 rows per process and step, 2 steps per generation: 6 per process, groups 1 spanning both processes
        assert len(first["prompts"]) == len(second["prompts"]) == 6
        prompts = first["prompts"] + second["prompts"]
        completions = first["completions"] + second["completions"]
        rewards = torch.tensor(
            [reward_constant_on_some_prompts(*pair) for pair in zip(prompts, completions, strict=True)]
        )
        assert all(len(set(prompts[i : i + G])) == 1 for i in range(0, len(prompts), G))  # whole groups
        assert (rewards.view(-1, G).std(dim=1) > 0).all()  # none without spread trains
        advantages = torch.cat([first["advantages"], second["advantages"]])
        grouped = rewards.view(-1, G)
        expected = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
        torch.testing.assert_close(advantages, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_process_that_skips_every_row_trains_in_step_with_the_other(engine_run):
    engine_run, _ = engine_run
    whole, skipped = phase_results(engine_run, "skip-whole"), phase_results(engine_run, "skip")
    assert skipped[1]["forward_rows"] == [1] * 8  # rank 1's rewards are all equal: one carrier row per micro-batch
    assert whole[1]["forward_rows"] == [4] * 8
    expected, got = training_logs(whole[0]), training_logs(skipped[0])
    assert len(expected) == len(got) == 4
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "grad_norm", "reward", "clip_ratio/region_mean"):
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert have["skipped_rows/fraction"] >= 0.5
    assert training_logs(skipped[0]) == training_logs(skipped[1])


@pytest.mark.slow
def test_processes_that_decide_differently_raise_an_error_naming_it_instead_of_waiting(engine_run):
    engine_run, _ = engine_run
    ranks = phase_results(engine_run, "disagree")
    for rank in ranks:
        assert rank["error"] is not None and "different keep/drop decisions" in rank["error"]
