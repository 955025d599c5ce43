"""TRL's batch as the objective's inputs: from TRL's state to the arguments of `ops.policy_objective`, as stock
`trl.GRPOTrainer` 1.16 defines them.

`ops/` holds the formulas; this module holds what they need from a training run, in one dataclass already in final
units (`ObjectiveInputs`): the loss type's options, the per-token weights that TRL computes with its own helpers
(`get_off_policy_mask`, `get_high_entropy_mask`, `get_gamma_weights`, the vLLM importance-sampling ratio of the
generation batch), the divisor of the window-level aggregations, and the scales that put the loss in the units TRL
backpropagates. It also holds TRL's entropy bonus with its adaptive controller (`entropy_bonus`), which TRL offers
no hook for: a copy recorded in `_compat.TRL_COPIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._compat import FORWARD_KEYS
from .ops.loss_types import LOSS_TYPES, LossType
from .ops.objective import ObjectiveOptions

__all__ = [
    "ObjectiveInputs",
    "entropy_bonus",
    "gather_objective_inputs",
    "objective_options",
    "policy_logps_and_entropies",
]


@dataclass
class ObjectiveInputs:
    """Everything `policy_objective` and the extra loss terms take for one micro-batch, in final units: with these
    `policy_objective` returns the loss that TRL would backpropagate for the objective; the entropy bonus and the
    router loss are scaled by `accumulation_scale`.

    Attributes:
        options ([`ObjectiveOptions`]): the loss type and its hyper-parameters, TRL's resolved ones.
        logps (`torch.Tensor` of shape `(N, T)`): the policy's log-probs, with gradient.
        old_logps, ref_logps (`torch.Tensor` of shape `(N, T)` or `None`): sampling and reference log-probs.
        advantages (`torch.Tensor` of shape `(N,)` or `(N, T)`).
        mask (`torch.Tensor` of shape `(N, T)`): completion tokens (and tool mask).
        token_weights (`torch.Tensor` of shape `(N, T)` or `None`): product of the off-policy mask, the entropy mask
            and the vLLM correction ratio, in float32 or wider.
        entropy_mask (`torch.Tensor` of shape `(N, T)` or `None`): the entropy mask alone (the bonus uses it too).
        sequence_weights (`torch.Tensor` of shape `(N, 1)` or `None`): VESPO's gamma weights.
        denominator (`torch.Tensor` of shape `()`, `float` or `None`): `D` of `sum_over_denominator`.
        loss_scale (`float`): multiplies the aggregation: `1 / accumulation steps` for losses normalised per
            micro-batch in training, 1 for window-normalised ones and in evaluation.
        accumulation_scale (`float`): `1 / accumulation steps` in training, 1 in evaluation.
    """

    options: ObjectiveOptions
    logps: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    token_weights: torch.Tensor | None
    entropy_mask: torch.Tensor | None
    sequence_weights: torch.Tensor | None
    denominator: torch.Tensor | float | None
    loss_scale: float
    accumulation_scale: float


def _policy_weights(trainer, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor, mask):
    """`(token_weights, entropy_mask, sequence_weights)` from TRL's own helpers, as TRL's `_compute_loss` applies
    them."""
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old_logps = inputs.get("old_per_token_logps")
    old_logps = logps.detach() if old_logps is None else old_logps
    factors = []
    if trainer.off_policy_mask_threshold is not None:
        factors.append(
            trainer.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logps),
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
    if LOSS_TYPES[trainer.loss_type].needs_sequence_weights:
        # Selected, so that values at masked positions cannot reach the sequence sum (TRL multiplies by the mask).
        log_ratio = torch.where(mask.bool(), logps.detach() - old_logps, 0.0)
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


def _denominator(trainer, record: LossType, inputs: dict[str, Any], num_rows: int, mode: str):
    """`D` of `sum_over_denominator`, as TRL 1.16 defines it for the loss type."""
    if record.divisor == "rows_times_max_length":
        return num_rows * trainer.max_completion_length
    if record.divisor != "window_tokens":
        return None
    # `num_items_in_batch` counts the completion tokens of the whole generation batch, over every process.
    denominator = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":  # one accumulation window of it (in eval there is neither splitting nor accumulation)
        denominator = denominator * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return denominator


def objective_options(trainer) -> ObjectiveOptions:
    """The loss type and its hyper-parameters as TRL's `GRPOTrainer` resolved them (`epsilon_low`, `epsilon_high`)."""
    args = trainer.args
    return ObjectiveOptions(
        loss_type=trainer.loss_type,
        importance_sampling_level=trainer.importance_sampling_level,
        epsilon=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        beta=trainer.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
    )


def policy_logps_and_entropies(trainer, model, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The policy's side of the objective for TRL's micro-batch `inputs`, through the trainer's log-prob hook
    (`_get_per_token_logps_and_entropies`), called as TRL's `_compute_loss` calls it.

    Returns:
        Per-token log-probs `(N, T)` (with gradient) and entropies `(N, T)` of the completion tokens, and the
        Mixture-of-Experts router loss (0-dim, `None` unless `aux_loss_enabled`).
    """
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return trainer._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
        **{key: inputs.get(key) for key in FORWARD_KEYS},
    )


def gather_objective_inputs(
    trainer,
    inputs: dict[str, Any],
    logps: torch.Tensor,
    entropies: torch.Tensor,
    mode: str,
    num_rows: int | None = None,
) -> ObjectiveInputs:
    """The objective's inputs for one micro-batch of TRL's batch `inputs`, in final units.

    Args:
        trainer (`GRPOTrainer`): read only: its options and TRL's helpers.
        inputs (`dict`): the micro-batch TRL prepared (or the rows of it that train, see `num_rows`).
        logps, entropies (`torch.Tensor` of shape `(N, T)`): the policy's log-probs (with gradient) and entropies.
        mode (`str`): `"train"` or `"eval"`.
        num_rows (`int`, *optional*): the rows of the whole micro-batch when `inputs` holds only some of them
            (`sampling.skipping`): `dr_grpo`'s divisor counts them all. Default: the rows of `inputs`.
    """
    record = LOSS_TYPES[trainer.loss_type]
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    token_weights, entropy_mask, sequence_weights = _policy_weights(trainer, inputs, logps, entropies, mask)
    # TRL sets `loss_is_scaled_for_ga`: the trainer, not Trainer, divides by the accumulation steps.
    accumulation_scale = 1.0 / trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    return ObjectiveInputs(
        options=objective_options(trainer),
        logps=logps,
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None,
        advantages=inputs["advantages"],
        mask=mask,
        token_weights=token_weights,
        entropy_mask=entropy_mask,
        sequence_weights=sequence_weights,
        denominator=_denominator(trainer, record, inputs, logps.size(0) if num_rows is None else num_rows, mode),
        loss_scale=1.0 if record.window_normalised else accumulation_scale,
        accumulation_scale=accumulation_scale,
    )


def entropy_bonus(trainer, entropies, mask, entropy_mask, mode: str) -> tuple[float, torch.Tensor]:
    """TRL's entropy bonus (`entropy_coef`, `use_adaptive_entropy`) of one micro-batch: `(coef, H)`, the coefficient
    applied and the 0-dim mean entropy over the tokens the policy term acts on (the entropy mask's, when one is used);
    the loss gets `-coef * H` (times the accumulation scale).

    With the adaptive controller, the coefficient of the previous optimizer step applies (0 while the entropy
    of the last window is above `entropy_target`); at each optimizer step the window's entropy, reduced over
    processes, moves the coefficient by `entropy_coef_delta` within `[entropy_coef_min, entropy_coef_max]`.

    Copy of the entropy-bonus block of TRL 1.16's `GRPOTrainer._compute_loss` (`trl/trainer/grpo_trainer.py`),
    which has no hook of its own. The controller's state is TRL's (`entropy_coef`, `_last_world_entropy`,
    `_entropy_window_stats`), which TRL checkpoints.
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
