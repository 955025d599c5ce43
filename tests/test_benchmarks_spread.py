"""The spread task's rows span the demo model's difficulties, and its flatness statistics count what they claim."""

import math
import statistics

import pytest

from benchmarks import learning
from benchmarks.spread import BANDS, LENGTH_WEIGHTS, band_of, flatness_statistics, make_spread_splits


def test_the_spread_splits_are_deterministic_disjoint_and_span_every_length():
    train, test = make_spread_splits(600, 200, seed=3)
    assert (train, test) == make_spread_splits(600, 200, seed=3)
    assert train != make_spread_splits(600, 200, seed=4)[0]
    prompts = [row["prompt"] for row in train + test]
    assert len(set(prompts)) == len(prompts) == 800
    assert all(row["solution"] == row["prompt"][:-1][::-1] for row in train + test)
    lengths = [len(row["solution"]) for row in train]
    assert set(lengths) == set(LENGTH_WEIGHTS)
    # Lengths of 3 letters and more (1,000 words and more each) near their weights' shares; lengths 1 and 2 hold
    # 10 and 100 words, so their redrawn duplicates go to the others.
    longer = [length for length in lengths if length >= 3]
    longer_weights = sum(weight for length, weight in LENGTH_WEIGHTS.items() if length >= 3)
    for length in range(3, 10):
        share = longer.count(length) / len(longer)
        assert share == pytest.approx(LENGTH_WEIGHTS[length] / longer_weights, abs=0.03)
    assert sum(len(row["solution"]) == 1 for row in train + test) == 10


def test_every_band_holds_a_real_share_of_the_training_prompts():
    train, _ = make_spread_splits(500, 0)
    shares = {band: statistics.mean(band_of(row["prompt"]) == band for row in train) for band in BANDS}
    assert shares["learnable"] > 0.5 and shares["out_of_reach"] > 0.3 and shares["easy"] > 0
    with pytest.raises(ValueError, match="too many"):
        make_spread_splits(10**9, 0)


def test_the_demo_model_finds_the_bands_as_easy_learnable_and_out_of_reach():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.extras.generation import SamplingSettings, generate_completions
    from trl_grpo_ext.tools.recipes.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    train, _ = make_spread_splits(400, 0)
    by_band = {band: [row for row in train if band_of(row["prompt"]) == band][:10] for band in BANDS}
    accuracy = {}
    for band, rows in by_band.items():
        prompts = [row["prompt"] for row in rows for _ in range(8)]  # a group of 8 completions per prompt
        completions = generate_completions(model, tokenizer, prompts, SamplingSettings(max_completion_length=10))
        right = [c.strip() == p[:-1][::-1] for c, p in zip(completions, prompts, strict=True)]
        accuracy[band] = statistics.mean(right)
    assert accuracy["easy"] > 0.4
    assert 0.05 < accuracy["learnable"] < 0.5
    assert accuracy["out_of_reach"] < 0.03


def test_flatness_statistics_count_flat_groups_and_their_next_visits():
    nan = math.nan
    visits = [
        (0, "a=", 0.0),  # flat, all wrong
        (0, "b=", nan),
        (1, "c=", 1.0),  # flat, all right
        (2, "a=", 0.0),  # flat after flat
        (2, "b=", 0.0),  # flat after spread
        (3, "a=", nan),  # spread after flat
        (3, "c=", 1.0),  # flat after flat
    ]
    stats = flatness_statistics(visits, steps=4, parts=2)
    assert stats["groups"] == 7 and stats["pairs"] == 4
    assert stats["zero_spread"] == pytest.approx(5 / 7)
    assert stats["zero_spread_by_part"] == [pytest.approx(2 / 3), pytest.approx(3 / 4)]
    assert stats["all_wrong"] == pytest.approx(3 / 7) and stats["all_right"] == pytest.approx(2 / 7)
    assert stats["flat_after_flat"] == pytest.approx(2 / 3)
    assert stats["flat_after_spread"] == 1.0
    assert stats["revisited"] == pytest.approx(4 / 7)
    empty = flatness_statistics([], steps=4)
    assert empty["flat_after_flat"] is None and empty["zero_spread_by_part"] == [None] * 4


def test_the_learning_summary_averages_flatness_over_the_seeds():
    def run(side, seed, flat_after_flat):
        flatness = flatness_statistics([(0, "a=", 0.0), (1, "a=", 0.0), (2, "b=", math.nan)], steps=3, parts=2)
        flatness["flat_after_flat"] = flat_after_flat
        curve = [(0, 0.0, 0.0, 0.1), (3, 10.0, 12.0, 0.5)]
        return {"side": side, "seed": seed, "curve": curve, "training_cpu_s": 10.0, "training_wall_s": 12.0,
                "step_times": [1.0], "logged": {}, "flatness": flatness}  # fmt: skip

    results = learning.summary([run("trl", 0, 0.5), run("trl", 1, 1.0), run("ext", 0, None)], ("trl", "ext"))
    assert results["summary"]["trl"]["flatness"]["flat_after_flat"] == pytest.approx(0.75)
    assert results["summary"]["ext"]["flatness"]["flat_after_flat"] is None
    assert results["summary"]["trl"]["flatness"]["zero_spread_by_part"] == [1.0, 0.0]
    text = learning.flatness_table(results)
    assert "| trl  | 3      | 0.67 (0.67, 0.00)" in text and "1.00, 0.00" in text and "| -" in text


@pytest.mark.slow
def test_the_learning_benchmark_trains_on_the_spread_task_and_records_every_group(tmp_path):
    import json
    import subprocess
    import sys

    from helpers import REPO

    out = tmp_path / "learning.json"
    command = [sys.executable, "-m", "benchmarks", "learning", "--quick", "--task", "spread", "--learning-sides", "",
               "--epoch-sides", "trl,ext_selective", "--skip-steps", "0", "--json", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "how well one visit of a prompt predicts the next" in result.stdout
    learned = json.loads(out.read_text())["learning"]
    assert learned["config"]["task"] == "spread"
    for run in learned["epoch_runs"]:
        # 4 steps, num_iterations=2: two generation batches of 16 prompts, one group each
        assert run["flatness"]["groups"] == 32 and run["train_prompts"] == 32
        assert run["generated_completions"] == 32 * 8


def test_the_learning_benchmark_refuses_an_unknown_task():
    with pytest.raises(ValueError, match="Unknown task 'math'"):
        learning.run(seeds=(0,), sides=(), task="math")
