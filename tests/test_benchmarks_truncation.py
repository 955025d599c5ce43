"""`python -m benchmarks truncation-cost`: its batch, its two distributions and its two sides compute what the
benchmark's docstring says (the vLLM side of `benchmarks/truncation.py` is tested in `tests/real_vllm/`)."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from benchmarks import truncation


def test_the_batch_is_one_right_padded_group_of_log_normal_lengths():
    ids, attention_mask, completion_mask = truncation.cost_batch(8, 32, 128, vocab=1000)
    assert ids.shape == attention_mask.shape == (8, 160) and completion_mask.shape == (8, 128)
    lengths = completion_mask.sum(dim=1)
    assert (lengths >= 1).all() and (lengths <= 128).all() and len(set(lengths.tolist())) > 4
    assert torch.equal(completion_mask, (torch.arange(128)[None] < lengths[:, None]).long())  # right padding
    assert attention_mask[:, :32].all()


def test_the_lm_like_distribution_is_peaked_and_the_flat_one_is_not():
    lm_like = truncation.projection_inputs("lm-like", 64, 16, 4096)
    flat = truncation.projection_inputs("flat", 64, 16, 4096)
    assert truncation.mean_entropy(*lm_like) < 2.5 < 7.5 < truncation.mean_entropy(*flat)


@pytest.mark.parametrize("scenario", truncation.SCENARIOS)
def test_both_sides_give_the_same_truncated_log_probs_and_only_before_sorts_everything(scenario):
    hidden, weight = truncation.projection_inputs(scenario, 40, 16, 8192)
    targets = torch.randint(0, 8192, (40,))
    with truncation.rows_through("topk", "sort") as before_rows:
        before = truncation.project("before", hidden, weight, targets)
    with truncation.rows_through("topk", "sort") as after_rows:
        after = truncation.project("after", hidden, weight, targets)
    for got, want in zip(after, before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert sum(before_rows["sort"]) == 40 and before_rows["topk"] == []
    assert after_rows["topk"][0] == 40  # one chunk of 40 positions through the first bound
    assert sum(after_rows["sort"]) == (40 if scenario == "flat" else 0)


@pytest.mark.slow
def test_the_cost_benchmark_runs_quickly_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks", "truncation-cost", "--quick", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)  # as from a clone
    assert result.returncode == 0, result.stderr[-3000:]
    assert "projection / forward" in result.stdout
    cost = json.loads(out.read_text())["truncation_cost"]
    assert cost["forward_s"]["median"] > 0 and set(cost["scenarios"]) == set(truncation.SCENARIOS)
    for entry in cost["scenarios"].values():
        before, after = entry["sides"]["before"], entry["sides"]["after"]
        assert before["positions"] == 4 * 16 > after["positions"] == cost["batch"]["completion_tokens"]
        assert before["sorted_rows"] == before["positions"] and before["extra_peak_bytes"] > 0
    assert cost["scenarios"]["lm-like"]["sides"]["after"]["sorted_rows"] == 0
