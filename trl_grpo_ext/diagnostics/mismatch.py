"""The sampler/trainer mismatch with vLLM: the raw importance ratios, their KL and effective sample size.

With `use_vllm`, TRL 1.16's `GRPOTrainer._generate_and_score_completions` (`trl/trainer/grpo_trainer.py`) always
keeps the sampler's log-probs of the sampled tokens (`sampling_per_token_logps`). It computes the trainer's own
(`old_per_token_logps`) only for `vllm_importance_sampling_correction` or when generation and optimizer steps are
misaligned; from the two it builds the correction `exp(old_logp - sampler_logp)`, truncated or masked at
`vllm_importance_sampling_clip_min/max`, and it logs only the corrected values.

`sampler_mismatch` recomputes the raw ratios and which of them the bounds act on, and `correction_ratio` the weights
TRL's correction applies, as TRL defines them (one recorded copy of TRL's bounds and modes: `_compat.TRL_COPIES`,
pinned by `tests/test_drift.py` and `tests/test_sampling_truncation.py`). With the correction off and no
`old_per_token_logps`, `trainer_logps` computes the trainer's log-probs of the batch in one extra forward pass without
gradient, with the random state restored afterwards: the metrics cost that pass, and training is unchanged.

`sampler_cuts` reads the sampling cuts vLLM applies (`top_k`, `top_p`, `min_p`, overridden by `generation_kwargs` as
TRL passes them). vLLM returns log-probs of the truncated, renormalised distribution
(`logprobs_mode="processed_logprobs"`) while the trainer's cover the whole vocabulary, so with a cut every ratio
carries the kept probability mass `S <= 1` as a factor that is no policy change (TRL issue #6789).
`match_sampler_truncation` (`sampling.truncation`) removes it; `truncation_warning` names the cuts where that option
is off.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import FORWARD_KEYS
from ..config import option
from ..ops.truncation import SamplerCuts
from ..sampling import preserved_rng

__all__ = [
    "SamplerMismatch",
    "correction_ratio",
    "sampler_cuts",
    "sampler_mismatch",
    "trainer_logps",
    "truncation_warning",
]


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
            when the batch has no `old_per_token_logps` (see `trainer_logps`).

    Returns:
        [`SamplerMismatch`].
    """
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask = mask & output["tool_mask"].bool()
    if trainer_logps is None:
        trainer_logps = output["old_per_token_logps"]
    raw = trainer_logps - output["sampling_per_token_logps"]
    scored = mask & ~torch.isnan(raw)
    difference = torch.where(scored, raw, 0.0)  # tokens the sampler could not score: no correction (TRL)
    if mode.startswith("sequence"):
        log_ratio, units = difference.sum(dim=-1, keepdim=True), torch.ones_like(mask[:, :1])
    else:
        log_ratio, units = difference, mask
    outside = _outside(torch.exp(log_ratio), clip_min, clip_max)
    return SamplerMismatch(log_ratio, units, outside, difference, scored, output.get("importance_sampling_ratio"))


def _outside(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
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
        log_ratio (`torch.Tensor`): `SamplerMismatch.log_ratio`, `(N, T)` or `(N, 1)` for the `sequence_*` modes.
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
        return ratio.masked_fill(_outside(ratio, clip_min, clip_max), 0.0)
    raise ValueError(
        f"Unknown vllm_importance_sampling_mode {mode!r}: 'token_truncate', 'token_mask', 'sequence_truncate' or "
        "'sequence_mask'."
    )


def trainer_logps(trainer, output: dict[str, Any]) -> torch.Tensor:
    """The trainer's per-token log-probs `(N, T)` of a generated batch, as TRL computes `old_per_token_logps`.

    One forward pass of `trainer.model` without gradient (gradient checkpointing paused, as TRL does), under the
    random state it found, which is restored afterwards: dropout (e.g. LoRA's) draws the same numbers in training
    as without this pass. Call it on every process (sharded weights gather in the forward).
    """
    try:
        from trl.models.utils import disable_gradient_checkpointing

        paused = disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
    except ImportError:  # an older TRL without the helper: nothing to pause
        paused = nullcontext()
    args = trainer.args
    batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
    completion_ids = output["completion_ids"]
    # TRL's padded forward (`GRPOTrainerExt` keeps it beside the padding-free one): the truncation match reads the
    # backbone's hidden states in that layout (sampling.truncation).
    forward = getattr(trainer, "_stock_logps_and_entropies", trainer._get_per_token_logps_and_entropies)
    with torch.no_grad(), paused, preserved_rng():
        logps, _, _ = forward(
            trainer.model,
            torch.cat([output["prompt_ids"], completion_ids], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            completion_ids.size(1),
            batch_size=batch_size,
            **{key: output[key] for key in FORWARD_KEYS if output.get(key) is not None},
        )
    return logps


#: The sampling fields that truncate the sampler's distribution.
_CUTS = ("top_k", "top_p", "min_p")


def sampler_cuts(args) -> SamplerCuts:
    """The cuts vLLM samples with under `args`: `top_k`, `top_p` and `min_p`, each overridden by the same key of
    `generation_kwargs` (TRL passes those to vLLM's `SamplingParams` after the fields). `None` means off."""
    values = {name: getattr(args, name, None) for name in _CUTS}
    values.update({name: value for name, value in (args.generation_kwargs or {}).items() if name in _CUTS})
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return SamplerCuts(**{name: off[name] if value is None else value for name, value in values.items()})


def truncation_warning(args) -> str | None:
    """What biases vLLM's importance-sampling correction in `args`, or `None`.

    Args:
        args (`trl.GRPOConfig`): the training configuration; `top_p`, `top_k`, `min_p` and the same keys of
            `generation_kwargs` (which override them, as TRL passes them to vLLM) are read.

    Returns:
        `str`: the warning, naming the settings and what to do; `None` without vLLM or without the correction, when
        nothing truncates, or with `match_sampler_truncation` on (which removes the bias).
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
        return None
    if option(args, "match_sampler_truncation"):
        return None
    cuts = sampler_cuts(args)
    off = SamplerCuts()
    truncating = [
        f"{name}={getattr(cuts, name)}"
        for name in ("top_p", "top_k", "min_p")
        if (getattr(cuts, name) > 0 if name == "top_k" else getattr(cuts, name) != getattr(off, name))
    ]
    if not truncating:
        return None
    return (
        f"vLLM samples from a truncated distribution ({', '.join(truncating)}) while "
        "vllm_importance_sampling_correction is on: vLLM's log-probs are renormalised over the tokens kept, the "
        "trainer's cover the whole vocabulary, so every importance ratio is scaled by the kept probability mass "
        "(<= 1) and the correction is biased (TRL issue #6789). Set match_sampler_truncation=True (GRPOConfigExt) "
        "to compare the trainer's log-probs of the same truncated distribution, sample without truncation "
        "(top_p=1.0, top_k=0, min_p=None), or switch the correction off; "
        "sampling/importance_sampling_ratio_raw/mean below 1 shows the bias."
    )
