"""The sampler/trainer mismatch with vLLM: the raw importance ratios of each generated batch, before TRL's correction
truncates or masks them, for the diagnostics (their distribution, k3 KL and effective sample size).

TRL 1.16 keeps the sampler's log-probs of the sampled tokens and computes the trainer's (`old_per_token_logps`) only
for its correction or misaligned steps; without them, one forward pass without gradient computes them
(`truncation_match.trainer_logps`). This only observes: what trains is TRL's correction, or the truncation match's.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from .correction import corrected_tokens, outside_bounds, sampler_log_ratios
from .truncation_match import TruncationMatch, trainer_logps, truncation_warning

__all__ = ["SamplerMismatch", "VllmBatches", "sampler_mismatch"]


class SamplerMismatch(NamedTuple):
    """One generation batch's sampler/trainer mismatch, for `DiagnosticsAccumulator.add_sampler_mismatch`: the
    fields of `correction.SamplerLogRatios`, then

    Attributes:
        outside (`torch.Tensor`, bool, the shape of `log_ratio`): entries whose ratio lies outside the bounds.
        applied (`torch.Tensor`, the shape of `log_ratio`, *optional*): the weights TRL's correction applies; `None`
            when it is off.
    """

    log_ratio: torch.Tensor
    units: torch.Tensor
    token_log_ratio: torch.Tensor
    scored: torch.Tensor
    outside: torch.Tensor
    applied: torch.Tensor | None = None


def sampler_mismatch(
    output: dict[str, Any],
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    trainer_logps: torch.Tensor | None = None,
) -> SamplerMismatch:
    """The mismatch of a generated batch (`sampling_per_token_logps` `(N, T)`) in TRL's `vllm_importance_sampling_mode`
    `mode` and bounds, against `trainer_logps` `(N, T)` (default: the batch's `old_per_token_logps`)."""
    if trainer_logps is None:
        trainer_logps = output["old_per_token_logps"]
    ratios = sampler_log_ratios(trainer_logps, output["sampling_per_token_logps"], corrected_tokens(output), mode)
    outside = outside_bounds(torch.exp(ratios.log_ratio), clip_min, clip_max)
    return SamplerMismatch(*ratios, outside, output.get("importance_sampling_ratio"))


class VllmBatches:
    """What a trainer with `use_vllm` does with each batch vLLM generated: the truncation match where it acts (the
    correction's weights rebuilt), then the mismatch, where measured (`log_sampler_mismatch`). Built with the trainer,
    where it warns about truncated sampling left unmatched."""

    def __init__(self, trainer, measure: bool):
        warning = truncation_warning(trainer.args)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=3)  # at the trainer's construction
        self.trainer, self.measure = trainer, measure
        self.match = TruncationMatch.for_trainer(trainer)

    def mark(self, mode: str) -> dict[str, int] | None:
        """Taken before a generation batch is generated."""
        return self.match.mark(mode) if self.match is not None else None

    def finish(self, output: dict[str, Any], mode: str, mark: dict[str, int] | None) -> SamplerMismatch | None:
        """For the batch that trains, on every process: the truncation match applied to `output`; its mismatch, or
        `None` where not measured."""
        measured = self.measure and output.get("sampling_per_token_logps") is not None
        logps = self.match.apply(output, mode, mark, for_metrics=measured) if self.match is not None else None
        if not measured:
            return None
        trainer = self.trainer
        if logps is None and "old_per_token_logps" not in output:
            logps = trainer_logps(trainer, output)
        return sampler_mismatch(
            output,
            trainer.vllm_importance_sampling_mode,
            trainer.vllm_importance_sampling_clip_min,
            trainer.vllm_importance_sampling_clip_max,
            trainer_logps=logps,
        )
