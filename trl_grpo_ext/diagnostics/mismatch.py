"""The sampler/trainer mismatch with vLLM: the raw importance ratios, their KL and effective sample size.

With `use_vllm`, TRL 1.16's `GRPOTrainer._generate_and_score_completions` (`trl/trainer/grpo_trainer.py`) always
keeps the sampler's log-probs of the sampled tokens (`sampling_per_token_logps`). It computes the trainer's own
(`old_per_token_logps`) only for `vllm_importance_sampling_correction` or when generation and optimizer steps are
misaligned; from the two it builds the correction `exp(old_logp - sampler_logp)`, truncated or masked at
`vllm_importance_sampling_clip_min/max`, and it logs only the corrected values.

`sampler_mismatch` recomputes the raw ratios and which of them the bounds act on, as TRL defines them (a recorded
copy: `_compat.TRL_COPIES`, pinned by `tests/test_drift.py`). With the correction off and no `old_per_token_logps`,
`trainer_logps` computes the trainer's log-probs of the batch in one extra forward pass without gradient, with the
random state restored afterwards: the metrics cost that pass, and training is unchanged.

`truncation_warning` names the sampling settings that bias the correction: vLLM returns log-probs of the truncated,
renormalised distribution (`logprobs_mode="processed_logprobs"`) while the trainer's cover the whole vocabulary, so
with `top_p < 1`, `top_k > 0` or `min_p > 0` every ratio carries the kept probability mass `S <= 1` as a factor
that is no policy change (TRL issue #6789).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import FORWARD_KEYS
from ..sampling import preserved_rng

__all__ = ["SamplerMismatch", "sampler_mismatch", "trainer_logps", "truncation_warning"]


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
    ratio = torch.exp(log_ratio)
    outside = torch.zeros_like(units)
    if clip_min is not None:
        outside = outside | (ratio < clip_min)
    if clip_max is not None:
        outside = outside | (ratio > clip_max)
    return SamplerMismatch(log_ratio, units, outside, difference, scored, output.get("importance_sampling_ratio"))


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
    with torch.no_grad(), paused, preserved_rng():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([output["prompt_ids"], completion_ids], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            completion_ids.size(1),
            batch_size=batch_size,
            **{key: output[key] for key in FORWARD_KEYS if output.get(key) is not None},
        )
    return logps


#: The sampling fields that truncate the sampler's distribution, and the value of each that does not.
_TRUNCATING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}


def truncation_warning(args) -> str | None:
    """What biases vLLM's importance-sampling correction in `args`, or `None`.

    Args:
        args (`trl.GRPOConfig`): the training configuration; `top_p`, `top_k`, `min_p` and the same keys of
            `generation_kwargs` (which override them, as TRL passes them to vLLM) are read.

    Returns:
        `str`: the warning, naming the settings and what to do; `None` without vLLM or without the correction, or
        when nothing truncates.
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
        return None
    values = {name: getattr(args, name, None) for name in _TRUNCATING}
    values.update({name: value for name, value in (args.generation_kwargs or {}).items() if name in _TRUNCATING})
    truncating = [
        f"{name}={value}"
        for name, value in values.items()
        if value is not None and value != _TRUNCATING[name] and not (name == "top_k" and value < 0)
    ]
    if not truncating:
        return None
    return (
        f"vLLM samples from a truncated distribution ({', '.join(truncating)}) while "
        "vllm_importance_sampling_correction is on: vLLM's log-probs are renormalised over the tokens kept, the "
        "trainer's cover the whole vocabulary, so every importance ratio is scaled by the kept probability mass "
        "(<= 1) and the correction is biased (TRL issue #6789). Sample without truncation (top_p=1.0, top_k=0, "
        "min_p=None), or switch the correction off; sampling/importance_sampling_ratio_raw/mean below 1 shows the "
        "bias."
    )
