"""vLLM's importance-sampling correction as TRL 1.16 builds it in `GRPOTrainer._generate_and_score_completions` (each
piece recorded in `_compat.TRL_COPIES`): the raw log ratios of the trainer's and the sampler's log-probs, the entries
outside the bounds, the weights, and TRL's logged statistics of them. The truncation match and the mismatch metrics
both start from `sampler_log_ratios`: one definition of the ratio TRL corrects with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from trl.trainer.utils import nanmax, nanmin

from ...metrics import (
    IMPORTANCE_SAMPLING_RATIO_MAX,
    IMPORTANCE_SAMPLING_RATIO_MEAN,
    IMPORTANCE_SAMPLING_RATIO_MIN,
    SAMPLING_LOGP_DIFFERENCE_MAX,
    SAMPLING_LOGP_DIFFERENCE_MEAN,
)

__all__ = [
    "TRL_CORRECTION_METRICS",
    "SamplerLogRatios",
    "corrected_tokens",
    "correction_metrics",
    "correction_ratio",
    "outside_bounds",
    "sampler_log_ratios",
]

#: What TRL logs of its correction in `_generate_and_score_completions`.
TRL_CORRECTION_METRICS = (
    SAMPLING_LOGP_DIFFERENCE_MEAN,
    SAMPLING_LOGP_DIFFERENCE_MAX,
    IMPORTANCE_SAMPLING_RATIO_MIN,
    IMPORTANCE_SAMPLING_RATIO_MEAN,
    IMPORTANCE_SAMPLING_RATIO_MAX,
)


class SamplerLogRatios(NamedTuple):
    """The raw log ratios `trainer_logp - sampler_logp` of a batch, before any truncation or masking.

    Attributes:
        log_ratio (`torch.Tensor` of shape `(N, T)`, or `(N, 1)` summed per sequence in the `sequence_*` modes): 0 at
            tokens the sampler could not score (NaN log-prob), whose ratio TRL sets to 1.
        units (`torch.Tensor`, bool, same shape): the entries that count (the tokens of `mask`, or every sequence).
        token_log_ratio (`torch.Tensor` of shape `(N, T)`): per token, 0 where `scored` is False.
        scored (`torch.Tensor`, bool, `(N, T)`): the tokens of `mask` that the sampler scored.
    """

    log_ratio: torch.Tensor
    units: torch.Tensor
    token_log_ratio: torch.Tensor
    scored: torch.Tensor


def corrected_tokens(output: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's correction covers, `(N, T)` bool: a generated batch's completion tokens outside tool output."""
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask = mask & output["tool_mask"].bool()
    return mask


def sampler_log_ratios(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str
) -> SamplerLogRatios:
    """The raw log ratios of TRL's correction from the log-probs `(N, T)` of the sampled tokens, over the tokens of
    `mask` `(N, T)`, in TRL's `vllm_importance_sampling_mode` `mode`."""
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
    """The weights of TRL's correction (`importance_sampling_ratio`), of the shape of `log_ratio`
    (`SamplerLogRatios.log_ratio`): `exp(log_ratio)`, clamped into the bounds (`*_truncate`) or 0 outside them
    (`*_mask`)."""
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


def correction_metrics(
    accelerator, trainer_logps: torch.Tensor, output: dict[str, Any], ratio: torch.Tensor, sequence_level: bool
) -> dict[str, float]:
    """`TRL_CORRECTION_METRICS` of given trainer log-probs `(N, T)` and weights (`(N, T)`, or `(N, 1)` with
    `sequence_level`), as TRL logs them: per process over the corrected tokens, the mean and max of `|trainer_logp -
    sampler_logp|` and the min, mean and max of the weights; then pooled over the processes (one gather each)."""
    mask = corrected_tokens(output)
    zero = torch.tensor(0.0, device=ratio.device)
    delta = torch.abs(trainer_logps - output["sampling_per_token_logps"])
    delta = delta[mask & ~torch.isnan(delta)]
    weights = ratio.flatten() if sequence_level else ratio[mask]

    def gathered(values: torch.Tensor, reduce) -> torch.Tensor:
        return accelerator.gather(reduce(values) if values.numel() else zero)

    return {
        TRL_CORRECTION_METRICS[0]: gathered(delta, torch.mean).mean().item(),
        TRL_CORRECTION_METRICS[1]: gathered(delta, torch.max).max().item(),
        TRL_CORRECTION_METRICS[2]: nanmin(gathered(weights, torch.min)).item(),
        TRL_CORRECTION_METRICS[3]: gathered(weights, torch.mean).nanmean().item(),
        TRL_CORRECTION_METRICS[4]: nanmax(gathered(weights, torch.max)).item(),
    }
