"""The offline demo's task: reverse a string of 3-6 letters from a-j (`"abc=" -> "cba"`).

A tiny model first learns the task partly by a short supervised warm-up, then GRPO with an exact-match reward
improves it. This module makes the data, runs the warm-up and measures sampled accuracy and sampled reward means
(`recipes/tiny/make_base_model.py` built the shipped model with it; the learning and spread benchmarks use it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trl_grpo_ext.extras.generation import SamplingSettings, generate_completions
from trl_grpo_ext.extras.heldout_scoring import call_metric

__all__ = ["ALPHABET", "SEPARATOR", "make_splits", "sampled_accuracy", "sampled_reward_means", "warm_up"]

ALPHABET = "abcdefghij"
SEPARATOR = "="


def make_splits(
    num_train: int, num_test: int, *, seed: int = 0, min_length: int = 3, max_length: int = 6
) -> tuple[list[dict], list[dict]]:
    """Disjoint train and test rows `{"prompt": "abc=", "solution": "cba"}`, the same for the same seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < num_train + num_test:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_length, max_length)))
        if word in seen:
            continue
        seen.add(word)
        rows.append({"prompt": word + SEPARATOR, "solution": word[::-1]})
    return rows[:num_train], rows[num_train:]


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    *,
    seed: int = 0,
    settings: SamplingSettings | None = None,
) -> float:
    """Share of rows whose sampled completion equals their solution exactly (by default: temperature 1, up to 10
    tokens, the demo config's sampling)."""
    settings = settings or SamplingSettings(max_completion_length=10)
    completions = generate_completions(model, tokenizer, [row["prompt"] for row in rows], settings, seed=seed)
    return sum(c.strip() == row["solution"] for c, row in zip(completions, rows, strict=True)) / len(rows)


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_rows: list[dict],
    eval_rows: list[dict],
    *,
    target_accuracy: float = 0.2,
    learning_rate: float = 3e-3,
    batch_size: int = 64,
    max_steps: int = 1000,
    eval_every: int = 10,
    seed: int = 0,
    log=print,
) -> dict:
    """Supervised training on `prompt -> solution<eos>` until the sampled accuracy on `eval_rows` reaches the target.

    The loss covers the solution and the end-of-sequence token only. Accuracy is measured every `eval_every` steps
    by sampling, so the model stops partly right, leaving GRPO something to learn.

    Returns:
        `dict` with `steps` taken and the last measured `accuracy`.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    eos = tokenizer.eos_token
    accuracy = 0.0
    model.train()
    for step in range(1, max_steps + 1):
        batch_rows = rng.sample(train_rows, batch_size)
        texts = [row["prompt"] + row["solution"] + eos for row in batch_rows]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = encoded["input_ids"].clone()
        labels[encoded["attention_mask"] == 0] = -100
        for index, row in enumerate(batch_rows):
            # Left padding: the prompt starts after the pads; mask it so only the answer is learnt.
            prompt_end = labels.shape[1] - len(tokenizer(row["prompt"] + row["solution"] + eos).input_ids)
            prompt_end += len(tokenizer(row["prompt"]).input_ids)
            labels[index, :prompt_end] = -100
        loss = model(**encoded, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % eval_every == 0:
            accuracy = sampled_accuracy(model, tokenizer, eval_rows, seed=seed + step)
            log(f"warm-up step {step}: loss {loss.item():.3f}, sampled accuracy {accuracy:.3f}")
            if accuracy >= target_accuracy:
                return {"steps": step, "accuracy": accuracy}
    return {"steps": max_steps, "accuracy": accuracy}


def sampled_reward_means(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    reward_funcs: list[Callable],
    settings: SamplingSettings | None = None,
    *,
    batch_size: int = 256,
    seed: int = 0,
    reward_kwargs: dict | None = None,
) -> dict[str, float]:
    """Mean of each reward function over one sampled completion per row.

    Reward functions are called as TRL calls them: `prompts`, `completions`, `completion_ids`, one list per extra
    column, and `trainer_state`, `log_extra`, `log_metric` (the last two do nothing here: held-out rewards are not
    logged to the run).

    Args:
        rows: dataset rows with a `prompt` and the columns the reward functions read (e.g. `solution`).
        reward_funcs: TRL-style reward functions (async ones too).
        settings, batch_size, seed: see `generate_completions`.
        reward_kwargs: more keyword arguments for the reward functions, e.g. `{"trainer_state": trainer.state}`.

    Returns:
        `dict` reward function name -> mean reward (`None` or NaN rewards, i.e. unscored completions, are left
        out).
    """
    prompts = [row["prompt"] for row in rows]
    completions, completion_ids = generate_completions(
        model, tokenizer, prompts, settings, batch_size=batch_size, seed=seed, return_ids=True
    )
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    means = {}
    for func in reward_funcs:
        rewards = call_metric(func, prompts, completions, completion_ids, columns, **(reward_kwargs or {}))
        scored = [reward for reward in rewards if reward is not None and not math.isnan(reward)]
        means[getattr(func, "__name__", type(func).__name__)] = sum(scored) / len(scored) if scored else float("nan")
    return means
