"""Every GRPO-family objective of TRL 1.16, as a small catalogue of named pieces.

A TRL `loss_type` is a per-token policy term and an aggregation, picked by name from `LOSS_TYPES`:

| loss_type | policy term | aggregation |
| --- | --- | --- |
| grpo | clipped | sequence_mean |
| bnpo | clipped | token_mean |
| dr_grpo | clipped | sum_over_denominator (N * max_completion_length) |
| dapo | clipped | sum_over_denominator (completion tokens of the accumulation window) |
| luspo | clipped | sequence_sum |
| cispo | cispo | sum_over_denominator (window tokens) |
| sapo | sapo | sequence_mean |
| vespo | vespo | sum_over_denominator (window tokens) |

With `r` the importance weight (`exp(logp - old_logp)` per token, or the exponential of the per-sequence mean log
ratio with `importance_sampling_level="sequence"`), `A` the advantage and `w` the product of the per-token weights
(off-policy mask, entropy mask, vLLM importance-sampling correction), the per-token loss is

    L_it = w_it * P_it + beta * K_it          (K_it * r_it with use_bias_correction_kl)

and the micro-batch loss is the aggregation of `L` over the completion tokens. `grpo_loss` (in `loss.py`) is the
row `grpo` with `w = 1`, token-level ratios and no bias correction, fused for speed; `policy_objective` below
computes every row with autograd. Both keep the same numerics: masked positions selected away (NaN or inf there
change nothing), exponentials continued linearly above 20, the KL term through `expm1`.

Weights that need TRL's trainer state (the VESPO gamma weights, the off-policy and entropy masks, the vLLM ratio)
are computed by the trainer with TRL's own helpers and passed in as tensors: nothing here imports TRL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .loss import GRPOLossOutput, _check_advantages, _check_tensor, _LossInputs, hyperparameter_problems
from .numerics import exp_linear_above, kl_estimator

__all__ = [
    "AGGREGATIONS",
    "LOSS_TYPES",
    "POLICY_TERMS",
    "policy_objective",
]


# ---------------------------------------------------------------------------------------------------------------
# Policy terms: the per-token loss P_it (to be minimised) and, where the variant has one, its "clipped" indicator.
# Each returns (P, low_clipped, high_clipped); the indicators are None for variants without a flat region.
# ---------------------------------------------------------------------------------------------------------------


def clipped_term(ratio, advantages, logp, *, epsilon_low, epsilon_high, delta=None, **_):
    """PPO's clipped surrogate, with TRL's optional two-sided clipping `delta`:

        P = -min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

    Clipped (flat, zero-gradient) where `r < 1 - eps_low` with `A < 0`, or `r > 1 + eps_high` with `A > 0`.
    """
    clipped_ratio = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    term = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    return term, low, high


def cispo_term(ratio, advantages, logp, *, epsilon_high, **_):
    """CISPO: the importance weight, capped and detached, scales a REINFORCE term:

        P = -sg(min(r, eps_high)) * A * logp

    "Clipped" where the cap binds for a positive advantage (`r > eps_high`, `A > 0`; TRL's `cispo_clip_ratio`).
    """
    weight = ratio.clamp(max=epsilon_high).detach()
    return -weight * advantages * logp, None, (ratio > epsilon_high) & (advantages > 0)


def sapo_term(ratio, advantages, logp, *, sapo_temperature_pos, sapo_temperature_neg, **_):
    """SAPO: a soft, temperature-controlled gate instead of a hard clip:

    P = -(4 / tau) * sigmoid(tau * (r - 1)) * A,   tau = tau_pos if A > 0 else tau_neg
    """
    temperature = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
    return -torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature * advantages, None, None


def vespo_term(ratio, advantages, logp, *, sequence_weights, **_):
    """VESPO: a detached gamma weight phi of the sequence's importance weight scales a REINFORCE term:

    P = -phi_i * A * logp     (phi from TRL's `GRPOTrainer.get_gamma_weights`, passed in)
    """
    return -sequence_weights.detach() * advantages * logp, None, None


POLICY_TERMS: dict[str, Callable] = {
    "clipped": clipped_term,
    "cispo": cispo_term,
    "sapo": sapo_term,
    "vespo": vespo_term,
}


# ---------------------------------------------------------------------------------------------------------------
# Aggregations: from per-token losses (0 at masked positions) to the micro-batch loss.
# ---------------------------------------------------------------------------------------------------------------


def sequence_mean(per_token, tokens_per_row, denominator=None):
    """`(1/N) sum_i (1/|o_i|) sum_t L_it`: each completion weighs the same (a row without tokens adds 0)."""
    return (per_token.sum(dim=-1) / tokens_per_row.clamp(min=1)).mean()


def token_mean(per_token, tokens_per_row, denominator=None):
    """`sum_it L_it / sum_i |o_i|`: each token of the micro-batch weighs the same."""
    return per_token.sum() / tokens_per_row.sum().clamp(min=1)


def sum_over_denominator(per_token, tokens_per_row, denominator):
    """`sum_it L_it / D`, with `D` fixed by the caller (all tokens of the window, or `N * max_length`)."""
    return per_token.sum() / denominator


def sequence_sum(per_token, tokens_per_row, denominator=None):
    """`(1/N) sum_i sum_t L_it`: longer completions weigh more (LUSPO)."""
    return per_token.sum(dim=-1).mean()


AGGREGATIONS: dict[str, Callable] = {
    "sequence_mean": sequence_mean,
    "token_mean": token_mean,
    "sum_over_denominator": sum_over_denominator,
    "sequence_sum": sequence_sum,
}

LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clipped", "sequence_mean"),
    "bnpo": ("clipped", "token_mean"),
    "dr_grpo": ("clipped", "sum_over_denominator"),
    "dapo": ("clipped", "sum_over_denominator"),
    "luspo": ("clipped", "sequence_sum"),
    "cispo": ("cispo", "sum_over_denominator"),
    "sapo": ("sapo", "sequence_mean"),
    "vespo": ("vespo", "sum_over_denominator"),
}


def policy_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.04,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    sequence_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> GRPOLossOutput:
    """The per-token loss `w * P + beta * K` of `loss_type`, aggregated as `loss_type` does, with autograd.

    Args:
        logps, old_logps, ref_logps, advantages, completion_mask: as in [`grpo_loss`]; `old_logps=None` is on-policy,
            `ref_logps` may be `None` only when `beta == 0`.
        loss_type (`str`): a key of `LOSS_TYPES`.
        importance_sampling_level (`str`): `"token"` (a ratio per token) or `"sequence"` (the exponential of each
            completion's mean log ratio, shared by its tokens).
        epsilon, epsilon_high (`float`): clipping widths (CISPO: `epsilon_high` is the cap of the weight).
        delta (`float`, *optional*): upper bound of the unclipped ratio (two-sided clipping).
        beta (`float`): KL coefficient.
        use_bias_correction_kl (`bool`): multiply `K` by the importance weight `r`.
        sapo_temperature_pos, sapo_temperature_neg (`float`): SAPO's temperatures.
        sequence_weights (`torch.Tensor` of shape `(N, 1)`, *optional*): VESPO's gamma weights (required for it).
        token_weights (`torch.Tensor` of shape `(N, T)` or `(N, 1)`, *optional*): weights multiplying the policy term
            (off-policy mask, entropy mask, vLLM correction ratio); NaN at masked positions is ignored.
        denominator (`float` or 0-dim `torch.Tensor`, *optional*): `D` of the `sum_over_denominator` aggregation
            (required for `dr_grpo`, `dapo`, `cispo`, `vespo`).

    Returns:
        [`GRPOLossOutput`]: `loss` (differentiable), `policy_loss` (the aggregated `w * P`) and `kl_penalty` (the
        aggregated `beta * K`), which add up to `loss`; `kl` is the aggregated `K` (bias-corrected if asked);
        per-row sums and per-token values for the diagnostics. `clip_units_per_row` is what the clip indicators
        count per row: completion tokens, or 1 per row with sequence-level weights (TRL's convention).

    Raises:
        ValueError: for an unknown `loss_type` or `importance_sampling_level`, bad hyper-parameters, missing
            `sequence_weights` or `denominator`, or inputs `grpo_loss` would refuse.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {tuple(LOSS_TYPES)}, got {loss_type!r}.")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"`importance_sampling_level` must be 'token' or 'sequence', got {importance_sampling_level!r}."
        )
    problems = hyperparameter_problems(epsilon, epsilon_high, beta)
    if delta is not None and not delta > 0:
        problems.append(f"`delta` must be > 0 (or None), got {delta!r}.")
    if problems:
        raise ValueError(" ".join(problems))
    term_name, aggregation_name = LOSS_TYPES[loss_type]
    if term_name == "vespo" and sequence_weights is None:
        raise ValueError("loss_type='vespo' needs `sequence_weights` (TRL's gamma weights).")
    if aggregation_name == "sum_over_denominator" and denominator is None:
        raise ValueError(f"loss_type={loss_type!r} needs `denominator` for its aggregation.")
    if ref_logps is None and beta > 0:
        raise ValueError(f"`ref_logps` is None but `beta` is {beta}; pass reference log-probs or set beta=0.")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high

    if not isinstance(logps, torch.Tensor) or logps.dim() != 2 or logps.numel() == 0 or not logps.is_floating_point():
        raise ValueError("`logps` must be a non-empty 2-dim (N, T) floating-point tensor.")
    shape, device = logps.shape, logps.device
    _check_tensor("completion_mask", completion_mask, shape, device)
    for name, tensor in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if tensor is not None:
            _check_tensor(name, tensor, shape, device)
    advantages = _check_advantages(advantages, shape, device)
    dtype = torch.promote_types(logps.dtype, torch.float32)
    mask = completion_mask if completion_mask.dtype == torch.bool else completion_mask != 0

    def select(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.to(dtype), 0.0)  # never x * mask: NaN * 0 is NaN

    logp = select(logps)
    old_logp = logp.detach() if old_logps is None else select(old_logps.detach())
    adv = select(advantages.detach().expand(shape))
    tokens = mask.sum(dim=-1)

    # r: per token, or per sequence from the mean log ratio of its completion tokens
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens.clamp(min=1).unsqueeze(-1)).expand(shape)
    ratio = exp_linear_above(log_ratio)

    # P_it, and the indicators of its flat region
    weights = None if sequence_weights is None else sequence_weights.to(dtype)
    term, low, high = POLICY_TERMS[term_name](
        ratio,
        adv,
        logp,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        sequence_weights=weights,
    )
    if token_weights is not None:
        term = term * select(token_weights.detach().expand(shape))
    policy_per_token = select(term)

    # K_it = exp(D) - D - 1 with D = ref - logp (times r with the bias correction)
    if ref_logps is not None:
        per_token_kl = kl_estimator(select(ref_logps.detach()) - logp)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_kl = select(per_token_kl)
    else:
        per_token_kl = torch.zeros_like(logp)

    aggregate = AGGREGATIONS[aggregation_name]
    policy_loss = aggregate(policy_per_token, tokens, denominator)
    kl = aggregate(per_token_kl, tokens, denominator)
    loss = policy_loss + beta * kl

    sequence_level = importance_sampling_level == "sequence"
    false = torch.zeros(shape, dtype=torch.bool, device=device)
    low = false if low is None else low & mask
    high = false if high is None else high & mask
    if sequence_level:  # one verdict per completion: count it once (TRL counts every row, tokens or not)
        low_rows, high_rows = low.any(dim=-1), high.any(dim=-1)
        clip_units = torch.ones_like(tokens)
    else:
        low_rows, high_rows = low.sum(dim=-1), high.sum(dim=-1)
        clip_units = tokens
    detached = {
        "log_ratio": select(log_ratio).detach(),
        "ratio": select(ratio).detach(),
        "per_token_kl": per_token_kl.detach(),
        "is_low_clipped": low,
        "is_high_clipped": high,
        "advantages": adv,
        "mask": mask,
    }
    rows = {
        "tokens": tokens,
        "kl": detached["per_token_kl"].sum(dim=-1),
        "low": low_rows,
        "high": high_rows,
        "clip_units": clip_units,
    }
    inputs = _LossInputs(logps.detach(), old_logps, ref_logps, advantages, completion_mask, dtype)
    return GRPOLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl=kl.detach(),
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        rows=rows,
        inputs=inputs,
        cache=detached,
    )
