"""DeepSeekMath's GRPO objective, and every GRPO-family objective of TRL, as pure tensor code.

For one prompt with G sampled completions o_1..o_G (token t of completion i):

    r_it = exp(logp_it - old_logp_it)                              importance ratio
    S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    D_it = ref_logp_it - logp_it
    K_it = exp(D_it) - D_it - 1                                    "k3" KL estimator, >= 0
    J    = (1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it)
    loss = -J

`grpo_loss` is this block: the `grpo` row of the catalogue (`loss_types.py`), where the policy term is `P = -S`
(`terms.clipped_term`) and the aggregation `sequence_mean` (row weights `1 / (G |o_i|)`). `policy_objective` computes
any row: the per-token loss `L_it = w_it * P_it + beta * K_it` (`K_it * r_it` with the bias correction; `w` the
product of per-token weights), aggregated as the loss type does.

Implementations: `"reference"` is the formula with autograd, line by line in `_reference_objective`; `"fused"` and
`"compiled"` are the kernel of `fused.py` (the same terms and their analytic gradient), for the rows in its domain;
`"auto"` takes the fused kernel where it applies and the reference elsewhere. An implementation asked for outside its
domain is refused, never silently replaced. Nothing here imports TRL: the functions work on any device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import domain_problems, fused_loss
from .loss_types import loss_type_record
from .numerics import exp_linear_above, kl_estimator
from .ratio_statistics import RatioStatistics, ratio_statistics
from .terms import AGGREGATIONS, POLICY_TERMS, aggregate
from .validation import ValidatedInputs, hyperparameter_problems, kernel_refusal, raise_problems, validate_inputs

__all__ = ["IMPLEMENTATIONS", "GRPOLossOutput", "grpo_loss", "policy_objective", "total_loss"]

IMPLEMENTATIONS = ("auto", "fused", "reference", "compiled")


@dataclass
class GRPOLossOutput:
    """What `policy_objective` and `grpo_loss` computed.

    Scalars are 0-dim tensors, per-row values `(N,)`, per-token values `(N, T)` (detached, in the computation dtype,
    0 or `False` at masked positions).

    Attributes:
        loss: differentiable with respect to `logps`; equals `policy_loss + kl_penalty`.
        policy_loss: the aggregated `w * P` (`grpo_loss`: `-(1/N) sum_i (1/|o_i|) sum_t S_it`), detached.
        kl: the aggregated `K`, detached (0 when `beta == 0` and no `ref_logps` were given).
        kl_penalty: `beta * kl`, detached.
        beta, epsilon, epsilon_high: the hyper-parameters used.
        implementation: the implementation that ran (`"fused"`, `"compiled"` or `"reference"`).
        mask: the completion tokens that count, bool.
        tokens_per_row: completion tokens of each row.
        kl_per_row: `sum_t K_it` of each row.
        low_clipped_per_row, high_clipped_per_row: what each row has in the flat region of the term.
        clip_units_per_row: what those two count per row: its completion tokens (or 1 with sequence-level ratios).
        advantages, log_ratio, ratio, per_token_kl, is_low_clipped, is_high_clipped: per-token values, present when
            asked for with `per_token=True` (else `None`).
        ratio_statistics: the completion tokens' importance ratios summed up (count, moments, extremes, histogram of
            the log ratio: [`RatioStatistics`]), present when asked for with `ratio_statistics=True` (else `None`).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    kl_penalty: torch.Tensor
    beta: float
    epsilon: float
    epsilon_high: float
    implementation: str
    mask: torch.Tensor
    tokens_per_row: torch.Tensor
    kl_per_row: torch.Tensor
    low_clipped_per_row: torch.Tensor
    high_clipped_per_row: torch.Tensor
    clip_units_per_row: torch.Tensor
    advantages: torch.Tensor | None = None
    log_ratio: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    per_token_kl: torch.Tensor | None = None
    is_low_clipped: torch.Tensor | None = None
    is_high_clipped: torch.Tensor | None = None
    ratio_statistics: RatioStatistics | None = None

    @property
    def is_region_clipped(self) -> torch.Tensor | None:
        """Tokens in either flat (zero-gradient) region, `(N, T)` bool (with `per_token=True`)."""
        if self.is_low_clipped is None:
            return None
        return self.is_low_clipped | self.is_high_clipped


def _reference_objective(
    inputs: ValidatedInputs, record, row_weights_of, options: dict, keep: bool, statistics: bool = False
):
    """The objective with autograd. Returns `(loss, policy_loss, kl, per-row sums, per-token values)`; the
    per-token values hold `ratio_statistics` with `statistics`."""
    mask, dtype = inputs.mask, inputs.dtype

    def select(x: torch.Tensor) -> torch.Tensor:
        # torch.where, not x * mask: NaN * 0 is NaN, and its gradient would be NaN too.
        return torch.where(mask, x.to(dtype), 0.0)

    logp = select(inputs.logps)
    old_logp = logp.detach() if inputs.old_logps is None else select(inputs.old_logps)
    advantages = select(inputs.advantages.expand(mask.shape))
    tokens = mask.sum(dim=-1)

    # r_it = exp(logp_it - old_logp_it); sequence level: the exponential of each completion's mean log ratio
    log_ratio = logp - old_logp
    if options["importance_sampling_level"] == "sequence":
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens.clamp(min=1).unsqueeze(-1)).expand(mask.shape)
    ratio = exp_linear_above(log_ratio)

    # P_it (for `grpo`: -S_it), with the indicators of its flat region
    sequence_weights = options["sequence_weights"]
    policy, low, high = POLICY_TERMS[record.policy_term](
        ratio,
        advantages,
        logp,
        epsilon_low=options["epsilon"],
        epsilon_high=options["epsilon_high"],
        delta=options["delta"],
        sapo_temperature_pos=options["sapo_temperature_pos"],
        sapo_temperature_neg=options["sapo_temperature_neg"],
        sequence_weights=None if sequence_weights is None else sequence_weights.to(dtype),
    )
    if options["token_weights"] is not None:
        policy = policy * select(options["token_weights"].detach().expand(mask.shape))
    policy = select(policy)

    # K_it = exp(D_it) - D_it - 1, D_it = ref_logp_it - logp_it (times r_it with the bias correction)
    if inputs.ref_logps is not None:
        per_token_kl = kl_estimator(select(inputs.ref_logps) - logp)
        if options["use_bias_correction_kl"]:
            per_token_kl = per_token_kl * ratio
        per_token_kl = select(per_token_kl)
    else:
        per_token_kl = torch.zeros_like(logp)

    # loss = sum_i c_i sum_t (P_it + beta K_it)   (grpo: c_i = 1/(G |o_i|), i.e. -J)
    row_weights = row_weights_of(tokens.to(dtype))
    policy_loss = aggregate(policy, row_weights)
    kl = aggregate(per_token_kl, row_weights)
    loss = policy_loss + options["beta"] * kl

    false = torch.zeros_like(mask)
    low = false if low is None else low & mask
    high = false if high is None else high & mask
    if options["importance_sampling_level"] == "sequence":  # one verdict per completion (TRL counts every row)
        rows = (low.any(dim=-1), high.any(dim=-1), torch.ones_like(tokens))
    else:
        rows = (low.sum(dim=-1), high.sum(dim=-1), tokens)
    per_token_kl = per_token_kl.detach()
    per_row = {"tokens": tokens, "kl": per_token_kl.sum(dim=-1), "low": rows[0], "high": rows[1], "units": rows[2]}
    per_token = {}
    if keep:
        per_token = {
            "advantages": advantages,
            "log_ratio": select(log_ratio).detach(),
            "ratio": select(ratio).detach(),
            "per_token_kl": per_token_kl,
            "is_low_clipped": low,
            "is_high_clipped": high,
        }
    if statistics:  # the ratios where masked as the kernel has them: log ratio 0, ratio 1
        log_ratio, ratio = select(log_ratio).detach(), torch.where(mask, ratio.detach(), 1.0)
        per_token["ratio_statistics"] = ratio_statistics(log_ratio, ratio, mask.to(dtype))
    return loss, policy_loss.detach(), kl.detach(), per_row, per_token


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
    loss_scale: float = 1.0,
    batch_rows: int | None = None,
    batch_tokens: float | torch.Tensor | None = None,
    implementation: str = "auto",
    per_token: bool = True,
    ratio_statistics: bool = False,
) -> GRPOLossOutput:
    """The loss of `loss_type`: the per-token loss `w * P + beta * K`, aggregated as that loss type does.

    Args:
        logps (`torch.Tensor` of shape `(N, T)`):
            Log-probabilities of the sampled completion tokens under the policy being trained; the gradient flows
            into this tensor only. `N = B * G` rows, the G completions of a prompt consecutive.
        old_logps (`torch.Tensor` of shape `(N, T)` or `None`):
            Log-probabilities under the policy that sampled the completions; `None` means on-policy (ratios 1).
        ref_logps (`torch.Tensor` of shape `(N, T)` or `None`):
            Log-probabilities under the reference policy; `None` only when `beta == 0`.
        advantages (`torch.Tensor` of shape `(N,)`, `(N, 1)` or `(N, T)`): one per completion (or token).
        completion_mask (`torch.Tensor` of shape `(N, T)`, bool, int or float):
            Non-zero at the completion tokens that count. Every other position is ignored, even NaN or infinity.
        loss_type (`str`, defaults to `"grpo"`): a key of `LOSS_TYPES`.
        importance_sampling_level (`str`, defaults to `"token"`): `"token"` or `"sequence"` (the exponential of
            each completion's mean log ratio, shared by its tokens).
        epsilon, epsilon_high (`float`): clipping widths; `epsilon_high=None` means `epsilon` (CISPO: the cap).
        delta (`float`, *optional*): upper bound of the unclipped ratio (two-sided clipping).
        beta (`float`, defaults to `0.04`): KL coefficient.
        use_bias_correction_kl (`bool`): multiply `K` by the importance weight `r`.
        sapo_temperature_pos, sapo_temperature_neg (`float`): SAPO's temperatures.
        sequence_weights (`torch.Tensor` of shape `(N, 1)`, *optional*): VESPO's gamma weights (required for it).
        token_weights (`torch.Tensor` of shape `(N, T)` or `(N, 1)`, *optional*): weights `w` multiplying the
            policy term (off-policy mask, entropy mask, vLLM correction ratio).
        denominator (`float` or 0-dim `torch.Tensor`, *optional*): `D` of the `sum_over_denominator` aggregation
            (required for `dr_grpo`, `dapo`, `cispo`, `vespo`).
        loss_scale (`float`, defaults to `1.0`): multiplies the aggregation's row weights, so that `loss`,
            `policy_loss` and `kl` come out in the caller's units (a trainer: divided by the accumulation steps).
        batch_rows (`int`, *optional*), batch_tokens (`float` or 0-dim `torch.Tensor`, *optional*): the rows `N` and
            completion tokens `sum_j |o_j|` of the whole micro-batch, when the rows passed are only part of it and the
            others add exactly 0 (`trl_grpo_ext.extras.skipping`): `sequence_mean` and `sequence_sum` divide by
            `batch_rows`, `token_mean` by `batch_tokens`, so that each row keeps its weight in the whole micro-batch.
            Default: the rows and tokens passed.
        implementation (`str`, defaults to `"auto"`): one of `IMPLEMENTATIONS` (see the module docstring).
        per_token (`bool`, defaults to `True`): also return the per-token values (ratios, KL terms, clip masks).
        ratio_statistics (`bool`, defaults to `False`): also return the importance ratios' statistics
            (`GRPOLossOutput.ratio_statistics`: what the diagnostics log about them), summed where the ratios are
            computed: the fused kernel adds them up block by block and writes no per-token tensor for them.

    Returns:
        [`GRPOLossOutput`].

    Raises:
        ValueError: naming the offending argument, for an unknown `loss_type`, `importance_sampling_level` or
            `implementation`, an implementation asked for outside its domain, bad hyper-parameters, a missing
            `sequence_weights` or `denominator`, a `batch_rows` below the rows passed, a shape or device mismatch, or
            an empty batch.
    """
    record = loss_type_record(loss_type)
    want_statistics = ratio_statistics
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"`importance_sampling_level` must be 'token' or 'sequence', got {importance_sampling_level!r}."
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"`implementation` must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
    raise_problems(hyperparameter_problems(epsilon, epsilon_high, beta, delta))
    if record.needs_sequence_weights and sequence_weights is None:
        raise ValueError(f"loss_type={loss_type!r} needs `sequence_weights` (TRL's gamma weights).")
    if record.aggregation == "sum_over_denominator" and denominator is None:
        raise ValueError(f"loss_type={loss_type!r} needs `denominator` for its aggregation.")
    inputs = validate_inputs(
        logps,
        old_logps,
        ref_logps,
        advantages,
        completion_mask,
        beta=beta,
        optional={"sequence_weights": sequence_weights, "token_weights": token_weights},
    )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if batch_rows is not None and not (isinstance(batch_rows, int) and batch_rows >= inputs.mask.size(0)):
        raise ValueError(
            f"`batch_rows` must be an int >= the {inputs.mask.size(0)} rows passed (the whole micro-batch's rows), "
            f"got {batch_rows!r}."
        )

    def row_weights_of(tokens: torch.Tensor) -> torch.Tensor:
        weights = AGGREGATIONS[record.aggregation](tokens, denominator, batch_rows, batch_tokens)
        return weights * loss_scale

    outside = domain_problems(
        policy_term=record.policy_term,
        importance_sampling_level=importance_sampling_level,
        delta=delta,
        token_weights=token_weights,
        use_bias_correction_kl=use_bias_correction_kl,
        beta=beta,
    )
    if implementation in ("fused", "compiled") and outside:
        raise ValueError(kernel_refusal(implementation, outside))
    if implementation == "auto":
        implementation = "reference" if outside else "fused"

    if implementation == "reference":
        options = {
            "importance_sampling_level": importance_sampling_level,
            "epsilon": epsilon,
            "epsilon_high": epsilon_high,
            "delta": delta,
            "beta": beta,
            "use_bias_correction_kl": use_bias_correction_kl,
            "sapo_temperature_pos": sapo_temperature_pos,
            "sapo_temperature_neg": sapo_temperature_neg,
            "sequence_weights": sequence_weights,
            "token_weights": token_weights,
        }
        loss, policy_loss, kl, rows, values = _reference_objective(
            inputs, record, row_weights_of, options, per_token, want_statistics
        )
    else:
        fused = fused_loss(
            inputs,
            row_weights_of,
            epsilon_low=epsilon,
            epsilon_high=epsilon_high,
            beta=beta,
            compiled=implementation == "compiled",
            keep=per_token,
            statistics=want_statistics,
        )
        loss, policy_loss, kl = fused.loss, fused.policy_loss, fused.kl
        rows = {"tokens": fused.tokens, "kl": fused.kl_rows, "low": fused.low_rows, "high": fused.high_rows}
        rows["units"] = fused.tokens
        values = {"ratio_statistics": fused.ratio_statistics}
        if per_token:
            names = ("advantages", "log_ratio", "ratio", "per_token_kl", "is_low_clipped", "is_high_clipped")
            values.update({name: getattr(fused, name) for name in names})
    return GRPOLossOutput(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        kl_penalty=beta * kl,
        beta=float(beta),
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        implementation=implementation,
        mask=inputs.mask,
        tokens_per_row=rows["tokens"],
        kl_per_row=rows["kl"],
        low_clipped_per_row=rows["low"],
        high_clipped_per_row=rows["high"],
        clip_units_per_row=rows["units"],
        **values,
    )


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    implementation: str = "fused",
) -> GRPOLossOutput:
    """DeepSeekMath's GRPO loss `-J`: per-sequence length normalisation and the `exp(d) - d - 1` KL estimator.

    The `grpo` row of `policy_objective` (see the module docstring for the formula).

    Args:
        logps, old_logps, ref_logps, advantages, completion_mask: as in [`policy_objective`]; `old_logps=None` is
            on-policy, `ref_logps=None` only with `beta == 0`.
        epsilon (`float`, defaults to `0.2`): lower clipping width, > 0.
        epsilon_high (`float`, *optional*): upper clipping width, >= 0; `None` means `epsilon`.
        beta (`float`, defaults to `0.04`): KL coefficient, >= 0.
        implementation (`str`, defaults to `"fused"`): `"fused"` (the terms and their analytic gradient, little extra
            memory), `"reference"` (the formula with autograd; higher-order gradients) or `"compiled"` (the fused
            kernel through `torch.compile`; falls back to `"fused"`, with a warning, where compilation fails). All
            agree to rounding.

    Returns:
        [`GRPOLossOutput`]: `loss` (0-dim, differentiable), `policy_loss` and `kl` (0-dim, detached, with
        `loss == policy_loss + beta * kl`), per-row sums, and per-token ratios, KL terms and clip masks.

    `old_logps`, `ref_logps` and `advantages` are constants: no gradient flows into them. All arithmetic is done in
    float32 (or in the inputs' dtype if it is wider); the gradient comes back in the dtype of `logps`. Exponentials
    are exact for log differences up to `EXP_LINEAR_ABOVE` (20) and continue linearly above it, so extreme ratios
    give a large but finite loss and gradient instead of `inf`/NaN; a log ratio of `-inf` is a ratio of 0, on every
    implementation. Other non-finite values at unmasked positions (NaN, `+inf` log-probs) are bad input and make the
    loss non-finite.

    Raises:
        ValueError: naming the offending argument, for a shape or device mismatch, an empty batch, `epsilon <= 0`,
            `epsilon_high < 0`, `beta < 0`, `ref_logps=None` with `beta > 0`, or an unknown `implementation`.
    """
    return policy_objective(
        logps,
        old_logps,
        ref_logps,
        advantages,
        completion_mask,
        loss_type="grpo",
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        implementation=implementation,
    )


def total_loss(
    objective_loss: torch.Tensor,
    *,
    scale: float,
    entropy_bonus: tuple[float, torch.Tensor] | None = None,
    router: tuple[float, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss a step backpropagates: the policy objective's (`policy_objective(...).loss`) with TRL's terms outside
    it, each in the units of the backward loss (`scale`: TRL's division by the accumulation steps where the objective's
    own divisor does not make it):

        loss = objective_loss - c_H * mean_entropy * scale + c_router * router_loss * scale

    Args:
        objective_loss (`torch.Tensor` of shape `()`): the policy objective's loss.
        scale (`float`): the accumulation scale of the terms below.
        entropy_bonus (`tuple[float, torch.Tensor]`, *optional*): `(c_H, mean_entropy)`, the entropy bonus's
            coefficient and the mean entropy (0-dim, with gradient).
        router (`tuple[float, torch.Tensor]`, *optional*): `(c_router, router_loss)`, a Mixture-of-Experts model's
            router loss and its coefficient.

    Returns:
        `(loss, terms)`: the loss (0-dim) and the added terms as they enter it, detached (`"entropy_bonus"`,
        `"router"`), for the loss decomposition's metrics.
    """
    loss, terms = objective_loss, {}
    if entropy_bonus is not None:
        coefficient, mean_entropy = entropy_bonus
        loss = loss - coefficient * mean_entropy * scale
        terms["entropy_bonus"] = -coefficient * mean_entropy.detach() * scale
    if router is not None:
        coefficient, router_loss = router
        loss = loss + coefficient * router_loss * scale
        terms["router"] = coefficient * router_loss.detach() * scale
    return loss, terms
