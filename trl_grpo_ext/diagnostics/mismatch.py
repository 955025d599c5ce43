"""The raw sampler/trainer importance ratios behind vLLM's importance-sampling correction.

TRL 1.16's `GRPOTrainer._generate_and_score_completions` (`trl/trainer/grpo_trainer.py`) computes the correction from
`old_per_token_logps - sampling_per_token_logps` and truncates or masks it at `vllm_importance_sampling_clip_min/max`;
it logs only the corrected values. `sampler_mismatch` recomputes the raw ratios and which of them the bounds act on,
as TRL defines them (a recorded copy: `_compat.TRL_COPIES`, pinned by `tests/test_drift.py`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sampler_mismatch"]


def sampler_mismatch(
    output: dict[str, Any], mode: str, clip_min: float | None, clip_max: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw log ratios, the entries that count and those outside the bounds, for `add_sampler_mismatch`.

    Args:
        output (`dict`): the batch `_generate_and_score_completions` returned (with `old_per_token_logps` and
            `sampling_per_token_logps`, `(N, T)`).
        mode (`str`): TRL's `vllm_importance_sampling_mode`; `"sequence_*"` modes sum the log ratios per sequence.
        clip_min, clip_max (`float` or `None`): the correction's bounds.

    Returns:
        `(log_ratio, units, outside)`: `(N, T)` (or `(N, 1)` per sequence) each; `units` and `outside` bool.
    """
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask = mask & output["tool_mask"].bool()
    difference = torch.where(mask, output["old_per_token_logps"] - output["sampling_per_token_logps"], 0.0)
    difference = torch.nan_to_num(difference, nan=0.0)  # tokens the sampler could not score: no correction
    if mode.startswith("sequence"):
        difference, units = difference.sum(dim=-1, keepdim=True), torch.ones_like(mask[:, :1])
    else:
        units = mask
    ratio = torch.exp(difference)
    outside = torch.zeros_like(units)
    if clip_min is not None:
        outside = outside | (ratio < clip_min)
    if clip_max is not None:
        outside = outside | (ratio > clip_max)
    return difference, units, outside
