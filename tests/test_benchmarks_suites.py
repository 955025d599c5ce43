"""The benchmark code runs, and its baselines compute what they claim to."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from benchmarks import kernel
from benchmarks.common import format_table, summarize
from trl_grpo_ext import grpo_loss


def test_baselines_compute_the_same_objective():
    inputs = kernel.make_inputs(6, 10, torch.float64, "cpu")
    full = torch.ones_like(inputs["mask"])
    ours = grpo_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], full).loss
    # With every completion the same length, a token mean over the batch is the per-sequence mean.
    seed = kernel.seed000_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], full.double())
    trl = kernel.trl_inline_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], full.double())
    torch.testing.assert_close(seed, ours)
    torch.testing.assert_close(trl, ours)
    # With variable lengths, TRL's per-sequence mean still agrees; the seed's token mean does not.
    mask = inputs["mask"]
    ours = grpo_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], mask).loss
    trl = kernel.trl_inline_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], mask.double())
    torch.testing.assert_close(trl, ours)


@pytest.mark.parametrize("side", kernel.SIDES[:4])
def test_every_side_runs_forward_and_backward(side):
    inputs = kernel.make_inputs(4, 16, torch.float32, "cpu")
    leaf = inputs["logps"].clone().requires_grad_(True)
    kernel.side_function(side, inputs)(leaf)
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def test_minimal_bytes_and_bandwidth_are_positive():
    inputs = kernel.make_inputs(4, 16, torch.float32, "cpu")
    assert kernel.minimal_bytes(inputs) == 4 * 16 * (4 * 4 + 8) + 4 * 4  # 4 fp32 tensors, int64 mask, advantages
    assert kernel.memory_bandwidth("cpu", megabytes=16, repeats=1) > 1e8


def test_summaries_and_tables():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    text = format_table(["a", "bb"], [[1, "x"], [22, "yy"]])
    assert text.splitlines()[0] == "| a  | bb |" and len(text.splitlines()) == 4


@pytest.mark.slow
def test_the_benchmark_command_runs_quickly_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks", "kernel", "--quick", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)  # as from a clone
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up vs seed000" in result.stdout
    results = json.loads(out.read_text())
    (case,) = results["kernel"]["cases"]
    assert set(case["sides"]) == set(kernel.SIDES)
    for stats in case["sides"].values():
        assert stats["time_s"]["median"] > 0 and stats["extra_peak_bytes"] >= 0


@pytest.mark.slow
def test_the_communication_benchmark_counts_one_gather_per_log_step(tmp_path, monkeypatch):
    from benchmarks import comm

    system_temp = tmp_path / "system_temp"  # the launched processes' temporary folder: it must stay empty
    system_temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_temp))
    results = comm.run(batch_sizes=(4, 8), workdir=tmp_path / "work")
    assert list(system_temp.iterdir()) == []
    assert {"model", "ext-4.json", "trl-8.json"} <= {path.name for path in (tmp_path / "work").iterdir()}
    runs = {(run["side"], run["per_device_batch"]): run for run in results["runs"]}
    for batch in (4, 8):
        ours, stock = runs[("ext", batch)], runs[("trl", batch)]
        assert ours["ext_diagnostics"]["calls"] == results["log_steps"]  # one per log step
        assert ours["trl_loss_metrics"]["calls"] == 0
        assert stock["trl_loss_metrics"]["calls"] == 7 * results["micro_batches"]  # 5 reductions, 2 gathers
        assert ours["other"]["calls"] == stock["other"]["calls"]  # generation and rewards: the same on both sides
    assert runs[("ext", 4)]["ext_diagnostics"]["bytes"] == runs[("ext", 8)]["ext_diagnostics"]["bytes"]
    assert runs[("trl", 4)]["trl_loss_metrics"]["bytes"] < runs[("trl", 8)]["trl_loss_metrics"]["bytes"]
    # The committed figures (docs/performance.md's table): the same bytes per log step for the same run's shape.
    with open(os.path.join(REPO, "benchmarks", "results", "comm.json")) as handle:
        committed = json.load(handle)["comm"]
    assert (committed["log_steps"], committed["micro_batches"]) == (results["log_steps"], results["micro_batches"])
    published = {run["side"]: run["ext_diagnostics"] for run in committed["runs"]}["ext"]
    measured = runs[("ext", 8)]["ext_diagnostics"]
    assert measured["bytes"] / measured["per"] == published["bytes"] / published["per"]


def test_the_learning_summary_times_each_side_to_stock_trl_s_final_exact_match():
    from benchmarks import learning

    def run(side, seed, curve, step_times, logged=None):
        return {
            "side": side,
            "seed": seed,
            "curve": curve,
            "training_cpu_s": curve[-1][1],
            "training_wall_s": curve[-1][2],
            "step_times": step_times,
            "logged": logged or {"frac_reward_zero_std": 0.4},
        }

    runs = [
        run("trl", 0, [(0, 0.0, 0.0, 0.2), (10, 50.0, 60.0, 0.5), (20, 100.0, 120.0, 0.6)], [5.0, 5.0]),
        run("trl", 1, [(0, 0.0, 0.0, 0.2), (10, 50.0, 60.0, 0.7), (20, 100.0, 120.0, 0.8)], [5.0, 5.0]),
        run("ext_beta0_skip", 0, [(0, 0.0, 0.0, 0.2), (10, 30.0, 40.0, 0.7), (20, 60.0, 80.0, 0.7)], [3.0, 3.0]),
        run("ext_beta0_skip", 1, [(0, 0.0, 0.0, 0.2), (10, 30.0, 40.0, 0.5), (20, 60.0, 80.0, 0.6)], [3.0, 3.0]),
    ]
    results = learning.summary(runs, ("trl", "ext_beta0_skip"))
    assert results["target_exact_match"] == pytest.approx(0.7)  # stock TRL's mean final exact match
    assert results["trl_training_cpu_s"] == 100.0
    trl, skip = results["summary"]["trl"], results["summary"]["ext_beta0_skip"]
    assert trl["time_to_target_cpu_s"] == [None, 50.0]  # the first evaluation at or above the target
    assert skip["time_to_target_cpu_s"] == [30.0, None]
    assert skip["time_to_target_vs_trl_training"] == pytest.approx(0.3)
    assert skip["step_time_median_cpu_s"] == 3.0
    text = learning.table({**results, "skip_step_times": {}})
    assert "CPU s to 0.700" in text and "(1/2)" in text


def test_the_learning_curve_table_means_the_seeds_at_every_kth_step():
    from benchmarks import learning

    runs = [
        {"side": "trl", "curve": [(0, 0.0, 0.0, 0.1), (50, 5.0, 6.0, 0.2), (100, 10.0, 12.0, 0.4)]},
        {"side": "trl", "curve": [(0, 0.0, 0.0, 0.1), (50, 7.0, 8.0, 0.3), (100, 14.0, 16.0, 0.6)]},
        {"side": "ext", "curve": [(0, 0.0, 0.0, 0.1), (50, 3.0, 4.0, 0.2), (100, 6.0, 8.0, 0.3)]},
    ]
    lines = learning.curve_table(runs, ("trl", "ext", "absent"), 100).splitlines()
    assert [cell.strip() for cell in lines[2].strip("|").split("|")] == ["trl", "0.100 / 0.500", "0 / 12"]
    assert [cell.strip() for cell in lines[3].strip("|").split("|")] == ["ext", "0.100 / 0.300", "0 / 6"]
    assert len(lines) == 4  # a side without runs has no row


def test_the_skipping_step_times_split_generation_from_training():
    from benchmarks import learning

    runs = [
        {"side": "ext_beta0", "step_times": [1.0, 3.0], "generation_times": [0.5, 1.5], "logged": {}},
        {"side": "ext_beta0_skip", "step_times": [0.8, 2.8], "generation_times": [0.5, 1.5], "logged": {}},
    ]
    skip = learning.skip_summary(runs)
    assert skip["ext_beta0"]["rest_mean_cpu_s"] == pytest.approx(1.0)
    assert skip["ext_beta0_skip"]["rest_mean_cpu_s"] == pytest.approx(0.8)
    assert "0.800 (0.80)" in learning.skip_table(skip)


def test_the_learning_benchmark_rotates_its_sides_and_runs_with_none():
    from benchmarks import learning

    assert learning._rotations(("a", "b", "c"), 4) == ("b", "c", "a")
    assert learning._rotations((), 1) == ()


@pytest.mark.slow
def test_the_demo_suite_runs_the_recipe_and_records_what_it_printed(tmp_path):
    out = tmp_path / "demo.json"
    command = [sys.executable, "-m", "benchmarks", "demo", "--quick", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    demo = json.loads(out.read_text())["demo"]
    assert demo["steps"] == 4 and demo["wall_s"] > demo["train_runtime_s"] > 0
    (score,) = demo["heldout"].values()  # the demo's one metric, exact match, before and after
    assert 0.0 <= score["before"] <= 1.0 and 0.0 <= score["after"] <= 1.0
    assert "| held-out exact_match mean@1, before GRPO -> after " in result.stdout
