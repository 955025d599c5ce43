"""The offline demo task: reverse a string of 3-6 letters from a-j (`"abc=" -> "cba"`).

A tiny model first learns the task partly by a short supervised warm-up, then GRPO with an exact-match reward
improves it. This module makes the data, runs the warm-up and measures sampled accuracy; `recipes/tiny/` uses it.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .evaluation import SamplingSettings, generate_completions

__all__ = ["ALPHABET", "SEPARATOR", "make_splits", "sampled_accuracy", "warm_up"]

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
