"""From TRL's GRPO options to the inputs of `objectives.policy_objective`, as stock `trl.GRPOTrainer` defines them.

`objectives.py` holds the formulas; this module holds what they need from the trainer: the per-token weights that
TRL computes with its own helpers (`get_off_policy_mask`, `get_high_entropy_mask`, `get_gamma_weights`, the vLLM
importance-sampling ratio of the generation batch), the divisor of the window-level aggregations, the entropy bonus
with TRL's adaptive controller, and which clip metrics a loss type has.
"""

from __future__ import annotations

from typing import Any

import torch

from .objectives import LOSS_TYPES

__all__ = [
    "aggregation_denominator",
    "clip_metrics_of",
    "entropy_bonus",
    "is_window_aggregation",
    "policy_weights",
    "uses_grpo_loss",
]


def uses_grpo_loss(args) -> bool:
    """Whether the configured objective is exactly `grpo_loss`'s (so the fused kernel can compute it)."""
    return (
        args.loss_type == "grpo"
        and args.importance_sampling_level == "token"
        and args.delta is None
        and not (args.use_bias_correction_kl and args.beta != 0.0)
        and args.top_entropy_quantile == 1.0
        and args.off_policy_mask_threshold is None
        and not (args.use_vllm and args.vllm_importance_sampling_correction)
    )


def clip_metrics_of(loss_type: str) -> str:
    """The clip metrics TRL logs for a loss type (see `diagnostics.CLIP_METRICS`)."""
    term = LOSS_TYPES[loss_type][0]
    return {"clipped": "clip_ratio", "cispo": "cispo"}.get(term, "none")


# Loss types whose divisor counts the completion tokens of the accumulation window (so their loss is already scaled
# for gradient accumulation); dr_grpo's divisor, N * max_completion_length, is per micro-batch like the others'.
_WINDOW_NORMALISED = ("dapo", "cispo", "vespo")


def is_window_aggregation(loss_type: str) -> bool:
    """Whether the loss type divides by a window-level count (already scaled for gradient accumulation)."""
    return loss_type in _WINDOW_NORMALISED


def policy_weights(
    trainer, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The weights TRL applies to the policy term, from TRL's own helpers.

    Args:
        trainer: the `GRPOTrainer`.
        inputs: the micro-batch.
        logps (`torch.Tensor` of shape `(N, T)`): the policy's log-probs (with gradient).
        entropies (`torch.Tensor` of shape `(N, T)`): the policy's per-token entropies.
        mask (`torch.Tensor` of shape `(N, T)`): the completion (and tool) mask.

    Returns:
        `(token_weights, entropy_mask, sequence_weights)`: the product of the off-policy mask, the entropy mask and
        the vLLM correction ratio (`(N, T)`, `None` if none applies); the entropy mask alone (bool `(N, T)` or
        `None`), which the entropy bonus also uses; VESPO's gamma weights (`(N, 1)` or `None`).
    """
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old_logps = inputs.get("old_per_token_logps")
    old_logps = logps.detach() if old_logps is None else old_logps
    factors = []
    if trainer.off_policy_mask_threshold is not None:
        sampling_logps = inputs.get("sampling_per_token_logps", old_logps)
        factors.append(
            trainer.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=logps,
                sampling_per_token_logps=sampling_logps,
                mask=mask,
                off_policy_threshold=trainer.off_policy_mask_threshold,
            )
        )
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        factors.append(entropy_mask)
    vllm_correction = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    sequence_weights = None
    if trainer.loss_type == "vespo":
        keep = mask.bool()
        # Selected, so that values at masked positions cannot reach the sequence sum (TRL multiplies by the mask).
        log_ratio = torch.where(keep, logps.detach() - old_logps, 0.0)
        sequence_weights = trainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio") if vllm_correction else None,
            k_pos=trainer.args.vespo_k_pos,
            lambda_pos=trainer.args.vespo_lambda_pos,
            k_neg=trainer.args.vespo_k_neg,
            lambda_neg=trainer.args.vespo_lambda_neg,
        )
    elif vllm_correction:  # VESPO folds the correction into its gamma weights instead
        factors.append(inputs["importance_sampling_ratio"])
    token_weights = None
    for factor in factors:  # in float32 or wider, whatever the model's dtype (masks are bool or int)
        factor = factor.to(
            torch.promote_types(factor.dtype, torch.float32) if factor.is_floating_point() else torch.float32
        )
        token_weights = factor if token_weights is None else token_weights * factor
    return token_weights, entropy_mask, sequence_weights


def aggregation_denominator(trainer, inputs: dict[str, Any], num_rows: int, mode: str) -> torch.Tensor | float | None:
    """`D` of the `sum_over_denominator` aggregation, as TRL 1.16 defines it for each loss type."""
    if trainer.loss_type == "dr_grpo":
        return num_rows * trainer.max_completion_length
    if not is_window_aggregation(trainer.loss_type):
        return None
    # `num_items_in_batch` counts the completion tokens of the whole generation batch, over every process.
    denominator = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":  # one accumulation window of it (in eval there is neither splitting nor accumulation)
        denominator = denominator * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return denominator


def entropy_bonus(
    trainer, entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None, mode: str
) -> tuple[float, torch.Tensor]:
    """The entropy bonus `coef * H` of TRL's `entropy_coef` / `use_adaptive_entropy`, and the controller's update.

    `H` is the mean entropy over the tokens the policy term acts on (the entropy mask's, when one is used). With the
    adaptive controller, the coefficient of the previous optimizer step applies (0 while the entropy of the last
    window is above `entropy_target`); at each optimizer step the window's entropy, reduced over processes, moves
    the coefficient by `entropy_coef_delta` within `[entropy_coef_min, entropy_coef_max]`. The controller's state
    is TRL's own (`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`), which TRL checkpoints.

    Returns:
        `(coef, H)`: the coefficient applied and the 0-dim mean entropy; the loss gets `-coef * H` (scaled for
        gradient accumulation by the caller).
    """
    effective = mask.bool() if entropy_mask is None else mask.bool() & entropy_mask.bool()
    selected = torch.where(effective, entropies, 0.0)
    mean_entropy = selected.sum() / effective.sum().clamp(min=1)
    args = trainer.args
    if trainer.use_adaptive_entropy:
        coef = trainer.entropy_coef if trainer._last_world_entropy <= args.entropy_target else 0.0
    else:
        coef = trainer.entropy_coef
    if trainer.use_adaptive_entropy and mode == "train":
        window = torch.stack([selected.sum(), effective.sum().to(selected.dtype)]).detach()
        stats = trainer._entropy_window_stats
        trainer._entropy_window_stats = window if stats is None else stats + window
        if trainer.accelerator.sync_gradients:  # the last micro-batch of the optimizer step
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    return coef, mean_entropy
