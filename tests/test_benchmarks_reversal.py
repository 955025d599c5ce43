"""The demo task: data, warm-up, sampled accuracy, and the shipped base model."""

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.reversal import ALPHABET, SEPARATOR, make_splits, sampled_accuracy, warm_up
from trl_grpo_ext.extras.generation import SamplingSettings, generate_completions
from trl_grpo_ext.testing import build_char_tokenizer, build_tiny_model
from trl_grpo_ext.tools.recipes.demo import DEMO_DIR

BASE_MODEL = os.path.join(DEMO_DIR, "base_model")


def test_splits_are_disjoint_deterministic_and_correct():
    train, test = make_splits(300, 50, seed=3)
    assert (train, test) == make_splits(300, 50, seed=3)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in test}
    for row in train + test:
        word = row["prompt"][:-1]
        assert row["prompt"].endswith(SEPARATOR) and 3 <= len(word) <= 6 and set(word) <= set(ALPHABET)
        assert row["solution"] == word[::-1]


def test_warm_up_lowers_the_loss_and_stops_at_the_target():
    tokenizer = build_char_tokenizer(ALPHABET + SEPARATOR)
    model = build_tiny_model(tokenizer, hidden_size=32, seed=0)
    train, held_out = make_splits(500, 16, seed=0)
    logged = []
    result = warm_up(
        model,
        tokenizer,
        train,
        held_out,
        max_steps=20,
        eval_every=10,
        target_accuracy=1.1,
        batch_size=16,
        log=logged.append,
    )
    assert result["steps"] == 20 and len(logged) == 2
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in logged]
    assert losses[1] < losses[0]
    reached = warm_up(
        model,
        tokenizer,
        train,
        held_out,
        max_steps=20,
        eval_every=10,
        target_accuracy=0.0,
        batch_size=16,
        log=logged.append,
    )
    assert reached["steps"] == 10  # stops at the first measurement that meets the target


def test_extras_is_seeded_and_leaves_the_global_rng_alone():
    tokenizer = build_char_tokenizer(ALPHABET + SEPARATOR)
    model = build_tiny_model(tokenizer, hidden_size=32, seed=0)
    prompts = ["abc=", "hij=", "aaaa="]
    torch.manual_seed(5)
    expected_next = torch.rand(1)
    torch.manual_seed(5)
    settings = SamplingSettings(max_completion_length=6)
    first = generate_completions(model, tokenizer, prompts, settings, seed=1)
    assert torch.rand(1) == expected_next
    assert first == generate_completions(model, tokenizer, prompts, settings, seed=1)
    assert all(len(completion) <= 6 for completion in first)


def test_the_shipped_base_model_is_partly_right():
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL)
    with open(os.path.join(BASE_MODEL, "warm_up.json")) as handle:
        recorded = json.load(handle)
    test_rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(BASE_MODEL), "data", "test.jsonl"))]
    accuracy = sampled_accuracy(model, tokenizer, test_rows, seed=recorded["seed"])
    assert accuracy == recorded["test_accuracy"]  # the same weights and sampling give the same figure
    assert 0.1 <= accuracy <= 0.35
