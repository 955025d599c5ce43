"""The sampler/trainer mismatch with vLLM: the raw importance ratios, their KL and effective sample size.

With `use_vllm`, TRL 1.16's `GRPOTrainer._generate_and_score_completions` (`trl/trainer/grpo_trainer.py`) always
keeps the sampler's log-probs of the sampled tokens (`sampling_per_token_logps`). It computes the trainer's own
(`old_per_token_logps`) only for `vllm_importance_sampling_correction` or when generation and optimizer steps are
misaligned; from the two it builds the correction `exp(old_logp - sampler_logp)`, truncated or masked at
`vllm_importance_sampling_clip_min/max`, and it logs only the corrected values.

`sampler_mismatch` recomputes the raw ratios and which of them the bounds act on, as TRL defines them
(`ops.correction`, the one recorded copy of TRL's bounds and modes, pinned by `tests/test_compat_drift.py` and
`tests/test_extras_vllm_truncation_match.py`). Without `old_per_token_logps`, the trainer computes its log-probs of the
batch
in one extra forward pass without gradient (`sampling.sampler_cuts.trainer_logps`) and passes them in: the metrics cost
that pass, and training is unchanged. This module only observes: the correction that trains is
`sampling.sampler_cuts`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .correction import outside_bounds, sampler_log_ratios
from .truncation_match import TruncationMatch, trainer_logps, truncation_warning

__all__ = ["SamplerMismatch", "VllmBatches", "sampler_mismatch"]


@dataclass(frozen=True)
class SamplerMismatch:
    """One generation batch's sampler/trainer mismatch, for `DiagnosticsAccumulator.add_sampler_mismatch`.

    Attributes:
        log_ratio (`torch.Tensor` of shape `(N, T)`, or `(N, 1)` per sequence): `trainer_logp - sampler_logp`,
            summed per sequence for the `sequence_*` modes, before any truncation or masking; 0 at tokens the sampler
            could not score (NaN log-prob), whose ratio TRL sets to 1.
        units (`torch.Tensor`, bool, same shape): the entries that count (completion tokens, or every sequence).
        outside (`torch.Tensor`, bool, same shape): entries whose ratio lies outside the correction's bounds.
        token_log_ratio (`torch.Tensor` of shape `(N, T)`): `trainer_logp - sampler_logp` per token, 0 where
            `scored` is False.
        scored (`torch.Tensor`, bool, `(N, T)`): completion tokens (outside tool output) that the sampler scored.
        applied (`torch.Tensor`, same shape as `log_ratio`, *optional*): the weights TRL's correction applies (after
            truncation or masking); `None` when the correction is off.
    """

    log_ratio: torch.Tensor
    units: torch.Tensor
    outside: torch.Tensor
    token_log_ratio: torch.Tensor
    scored: torch.Tensor
    applied: torch.Tensor | None = None


def sampler_mismatch(
    output: dict[str, Any],
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    trainer_logps: torch.Tensor | None = None,
) -> SamplerMismatch:
    """The raw log ratios, the entries that count and those outside the bounds, as TRL's correction defines them.

    Args:
        output (`dict`): the batch `_generate_and_score_completions` returned, with `sampling_per_token_logps`
            `(N, T)` and, unless `trainer_logps` is given, `old_per_token_logps` `(N, T)`.
        mode (`str`): TRL's `vllm_importance_sampling_mode`; `"sequence_*"` modes sum the log ratios per sequence.
        clip_min, clip_max (`float` or `None`): the correction's bounds.
        trainer_logps (`torch.Tensor` of shape `(N, T)`, *optional*): the trainer's log-probs of the sampled tokens
            when the batch has no `old_per_token_logps` (see `sampling.sampler_cuts.trainer_logps`).

    Returns:
        [`SamplerMismatch`].
    """
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask = mask & output["tool_mask"].bool()
    if trainer_logps is None:
        trainer_logps = output["old_per_token_logps"]
    ratios = sampler_log_ratios(trainer_logps, output["sampling_per_token_logps"], mask, mode)
    outside = outside_bounds(torch.exp(ratios.log_ratio), clip_min, clip_max)
    return SamplerMismatch(
        ratios.log_ratio,
        ratios.units,
        outside,
        ratios.token_log_ratio,
        ratios.scored,
        output.get("importance_sampling_ratio"),
    )


class VllmBatches:
    """What a trainer with `use_vllm` does with each batch vLLM generated: the truncation match, where on
    (`truncation_match.TruncationMatch`: the correction's weights rebuilt), then the sampler/trainer mismatch.

    Built with the trainer; warns there about truncated sampling with the correction on and the match off.

    Args:
        trainer (`GRPOTrainer`): a trainer with `use_vllm`.
        measure (`bool`): measure the mismatch (`log_sampler_mismatch`).
    """

    def __init__(self, trainer, measure: bool):
        warning = truncation_warning(trainer.args)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=3)  # at the trainer's construction
        self.trainer, self.measure = trainer, measure
        #: `None` unless the option is on and vLLM's sampling truncates.
        self.match = TruncationMatch.for_trainer(trainer)

    def mark(self, mode: str) -> dict[str, int] | None:
        """Taken before a generation batch is generated (`TruncationMatch.mark`)."""
        return self.match.mark(mode) if self.match is not None else None

    def finish(self, output: dict[str, Any], mode: str, mark: dict[str, int] | None) -> SamplerMismatch | None:
        """After the batch that trains is assembled (on every process: it gathers): the truncation match applied to
        `output`, and the batch's mismatch, or `None` where it is not measured."""
        measured = self.measure and output.get("sampling_per_token_logps") is not None
        logps = self.match.apply(output, mode, mark, for_metrics=measured) if self.match is not None else None
        if not measured:
            return None
        trainer = self.trainer
        # TRL computes the trainer's log-probs at generation only for the correction (or misaligned steps)
        if logps is None and "old_per_token_logps" not in output:
            logps = trainer_logps(trainer, output)
        return sampler_mismatch(
            output,
            trainer.vllm_importance_sampling_mode,
            trainer.vllm_importance_sampling_clip_min,
            trainer.vllm_importance_sampling_clip_max,
            trainer_logps=logps,
        )
