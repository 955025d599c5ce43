"""vLLM's importance-sampling correction as TRL 1.16 builds it, on tensors: the raw log ratios of the trainer's and
the sampler's log-probs, the entries outside the correction's bounds, and the weights the correction applies.

The correction of the batch that trains (`sampling.sampler_cuts`) and the sampler-mismatch metrics
(`diagnostics.mismatch`) both start from `sampler_log_ratios`: one definition of the ratio TRL corrects with. The
definitions are TRL's (`trl/trainer/grpo_trainer.py`, `GRPOTrainer._generate_and_score_completions`), recorded in
`_compat.TRL_COPIES`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SamplerLogRatios", "correction_ratio", "outside_bounds", "sampler_log_ratios"]


class SamplerLogRatios(NamedTuple):
    """The raw log ratios `trainer_logp - sampler_logp` of a batch, before any truncation or masking.

    Attributes:
        log_ratio (`torch.Tensor` of shape `(N, T)`, or `(N, 1)` for the `sequence_*` modes): per token, or summed
            per sequence; 0 at tokens the sampler could not score (NaN log-prob), whose ratio TRL sets to 1.
        units (`torch.Tensor`, bool, same shape): the entries that count (the tokens of `mask`, or every sequence).
        token_log_ratio (`torch.Tensor` of shape `(N, T)`): per token, 0 where `scored` is False.
        scored (`torch.Tensor`, bool, `(N, T)`): the tokens of `mask` that the sampler scored.
    """

    log_ratio: torch.Tensor
    units: torch.Tensor
    token_log_ratio: torch.Tensor
    scored: torch.Tensor


def sampler_log_ratios(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str
) -> SamplerLogRatios:
    """The raw log ratios of TRL's correction.

    Args:
        trainer_logps, sampler_logps (`torch.Tensor` of shape `(N, T)`): the log-probs of the sampled tokens.
        mask (`torch.Tensor`, bool, `(N, T)`): the tokens that count (completion tokens outside tool output).
        mode (`str`): TRL's `vllm_importance_sampling_mode`; the `"sequence_*"` modes sum the log ratios per sequence.

    Returns:
        [`SamplerLogRatios`].
    """
    raw = trainer_logps - sampler_logps
    scored = mask & ~torch.isnan(raw)
    difference = torch.where(scored, raw, 0.0)  # tokens the sampler could not score: no correction (TRL)
    if mode.startswith("sequence"):
        return SamplerLogRatios(difference.sum(dim=-1, keepdim=True), torch.ones_like(mask[:, :1]), difference, scored)
    return SamplerLogRatios(difference, mask, difference, scored)


def outside_bounds(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """The entries of `ratio` below `clip_min` or above `clip_max` (a bound that is `None` does not act)."""
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        outside = outside | (ratio < clip_min)
    if clip_max is not None:
        outside = outside | (ratio > clip_max)
    return outside


def correction_ratio(log_ratio: torch.Tensor, mode: str, clip_min: float | None, clip_max: float | None):
    """The weights of TRL's vLLM importance-sampling correction (`importance_sampling_ratio`) from the raw log ratios.

    `exp(log_ratio)`, then, by `mode`: `*_truncate` clamps it into `[clip_min, clip_max]`, `*_mask` sets the entries
    outside the bounds to 0 (a bound that is `None` does not act).

    Args:
        log_ratio (`torch.Tensor`): `SamplerLogRatios.log_ratio`, `(N, T)` or `(N, 1)` for the `sequence_*` modes.
        mode (`str`): TRL's `vllm_importance_sampling_mode`.
        clip_min, clip_max (`float` or `None`): the bounds.

    Returns:
        `torch.Tensor` of the shape of `log_ratio`.
    """
    ratio = torch.exp(log_ratio)
    if mode.endswith("_truncate"):
        bounds = {"min": clip_min, "max": clip_max}
        bounds = {name: value for name, value in bounds.items() if value is not None}
        return torch.clamp(ratio, **bounds) if bounds else ratio
    if mode.endswith("_mask"):
        return ratio.masked_fill(outside_bounds(ratio, clip_min, clip_max), 0.0)
    raise ValueError(
        f"Unknown vllm_importance_sampling_mode {mode!r}: 'token_truncate', 'token_mask', 'sequence_truncate' or "
        "'sequence_mask'."
    )
