"""The recipe's held-out scores: the mean of each reward function over one sampled completion per prompt.

The sampling is `trl_grpo_ext.extras.generation`'s (exactly as GRPO training samples; its names are re-exported
here); the evaluation during training, with k completions per prompt and pass@k, is `trl_grpo_ext.extras.heldout`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..extras.generation import SamplingSettings, eos_token_ids, generate_completions, tokenize_prompts
from ..extras.heldout_scoring import call_metric

__all__ = ["SamplingSettings", "eos_token_ids", "generate_completions", "sampled_reward_means", "tokenize_prompts"]


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
