"""DeepSeekMath's GRPO objective, and every GRPO-family objective of TRL, as the formula that trains.

For one prompt with G sampled completions o_1..o_G (token t of completion i):

    r_it = exp(logp_it - old_logp_it)                              importance ratio
    S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    D_it = ref_logp_it - logp_it
    K_it = exp(D_it) - D_it - 1                                    "k3" KL estimator, >= 0
    J    = (1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it)
    loss = -J

`grpo_loss` is this block: the `grpo` loss type, whose policy term is `P = -S` (`terms.clipped_term`) and whose
aggregation is `sequence_mean` (row weights `1 / (G |o_i|)`). `policy_objective` computes any loss type the same way:
the per-token loss `L_it = w_it * P_it + beta * K_it` (`K_it * r_it` with the bias correction; `w` the per-token
weights), aggregated as the loss type does, with autograd (`_formula`). The kernel of `fused.py` is an opt-in second
implementation of the clipped-surrogate rows. Nothing here imports TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import domain_problems, kernel_loss
from .loss_types import LossType, loss_type_record
from .numerics import exp_linear_above, kl_estimator
from .terms import AGGREGATIONS, POLICY_TERMS, aggregate
from .validation import (
    IMPLEMENTATIONS,
    ValidatedInputs,
    hyperparameter_problems,
    implementation_problem,
    kernel_refusal,
    raise_problems,
    validate_inputs,
)

__all__ = ["IMPLEMENTATIONS", "GRPOLossOutput", "ObjectiveOptions", "grpo_loss", "policy_objective", "total_loss"]


@dataclass(frozen=True)
class ObjectiveOptions:
    """A loss type and its hyper-parameters: what stays the same for every micro-batch of a run. Checked when made.

    Attributes:
        loss_type (`str`, defaults to `"grpo"`): a key of `LOSS_TYPES`.
        importance_sampling_level (`str`, defaults to `"token"`): `"token"` or `"sequence"` (the exponential of each
            completion's mean log ratio, shared by its tokens).
        epsilon, epsilon_high (`float`): clipping widths; `epsilon_high=None` becomes `epsilon` (CISPO: its cap).
        delta (`float`, *optional*): upper bound of the unclipped ratio (two-sided clipping).
        beta (`float`, defaults to `0.04`): KL coefficient.
        use_bias_correction_kl (`bool`): multiply `K` by the importance weight `r`.
        sapo_temperature_pos, sapo_temperature_neg (`float`): SAPO's temperatures.

    Raises:
        ValueError: naming the field, for an unknown loss type or level, or a bad hyper-parameter.
    """

    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.04
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def __post_init__(self):
        loss_type_record(self.loss_type)
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"`importance_sampling_level` must be 'token' or 'sequence', got {self.importance_sampling_level!r}."
            )
        raise_problems(hyperparameter_problems(self.epsilon, self.epsilon_high, self.beta, self.delta))
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)

    @property
    def record(self) -> LossType:
        return loss_type_record(self.loss_type)


@dataclass
class GRPOLossOutput:
    """What `policy_objective` and `grpo_loss` computed. Per-token values are detached, in the computation dtype, and
    0 or `False` at masked positions.

    Attributes:
        loss (`torch.Tensor` of shape `()`): differentiable with respect to `logps`; `policy_loss + kl_penalty`.
        policy_loss (`torch.Tensor` of shape `()`): the aggregated `w * P` (`grpo_loss`: `-(1/N) sum_i (1/|o_i|)
            sum_t S_it`), detached.
        kl, kl_penalty (`torch.Tensor` of shape `()`): the aggregated `K` and `beta * kl`, detached (0 without
            `ref_logps`).
        mask (`torch.Tensor` of shape `(N, T)`, bool): the completion tokens that count.
        log_ratio, ratio, per_token_kl (`torch.Tensor` of shape `(N, T)`): `x = logp - old_logp` (sequence level: the
            completion's mean, on each token), `r = exp(x)`, `K`.
        is_low_clipped, is_high_clipped (`torch.Tensor` of shape `(N, T)`, bool): the tokens in the flat region of the
            policy term (TRL's clip metrics).
        low_clipped_per_row, high_clipped_per_row (`torch.Tensor` of shape `(N,)`): their count per row (with
            sequence-level ratios, whether the row has any).
        clip_units_per_row (`torch.Tensor` of shape `(N,)`): what those count: the row's tokens (or 1 per row).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    kl_penalty: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    per_token_kl: torch.Tensor
    is_low_clipped: torch.Tensor
    is_high_clipped: torch.Tensor
    low_clipped_per_row: torch.Tensor
    high_clipped_per_row: torch.Tensor
    clip_units_per_row: torch.Tensor

    @property
    def is_region_clipped(self) -> torch.Tensor:
        """Tokens in either flat (zero-gradient) region, `(N, T)` bool."""
        return self.is_low_clipped | self.is_high_clipped


def _formula(inputs: ValidatedInputs, options: ObjectiveOptions, row_weights_of, sequence_weights, token_weights):
    """The objective with autograd: `(loss, policy_loss, kl, log_ratio, ratio, per_token_kl, low, high)`."""
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
    if options.importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens.clamp(min=1).unsqueeze(-1)).expand(mask.shape)
    ratio = exp_linear_above(log_ratio)

    # P_it (grpo: -S_it), with the indicators of its flat region
    policy, low, high = POLICY_TERMS[options.record.policy_term](
        ratio,
        advantages,
        logp,
        epsilon_low=options.epsilon,
        epsilon_high=options.epsilon_high,
        delta=options.delta,
        sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg,
        sequence_weights=None if sequence_weights is None else sequence_weights.to(dtype),
    )
    if token_weights is not None:
        policy = policy * select(token_weights.detach().expand(mask.shape))
    policy = select(policy)

    # K_it = exp(D_it) - D_it - 1, D_it = ref_logp_it - logp_it (times r_it with the bias correction)
    per_token_kl = torch.zeros_like(logp)
    if inputs.ref_logps is not None:
        per_token_kl = kl_estimator(select(inputs.ref_logps) - logp)
        if options.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_kl = select(per_token_kl)

    # loss = sum_i c_i sum_t (P_it + beta K_it)   (grpo: c_i = 1/(G |o_i|), i.e. -J)
    row_weights = row_weights_of(tokens.to(dtype))
    policy_loss = aggregate(policy, row_weights)
    kl = aggregate(per_token_kl, row_weights)
    loss = policy_loss + options.beta * kl

    no_region = torch.zeros_like(mask)
    low = no_region if low is None else low & mask
    high = no_region if high is None else high & mask
    return loss, policy_loss, kl, select(log_ratio.detach()), select(ratio.detach()), per_token_kl.detach(), low, high


def policy_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    options: ObjectiveOptions | None = None,
    *,
    sequence_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    loss_scale: float = 1.0,
    batch_rows: int | None = None,
    batch_tokens: float | torch.Tensor | None = None,
    implementation: str = "reference",
) -> GRPOLossOutput:
    """The loss of a loss type: the per-token loss `w * P + beta * K`, aggregated as that loss type does.

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
        options ([`ObjectiveOptions`], *optional*): the loss type and its hyper-parameters; default: `grpo`'s.
        sequence_weights (`torch.Tensor` of shape `(N, 1)`, *optional*): VESPO's gamma weights (required for it).
        token_weights (`torch.Tensor` of shape `(N, T)` or `(N, 1)`, *optional*): weights `w` multiplying the
            policy term (off-policy mask, entropy mask, vLLM correction ratio).
        denominator (`float` or 0-dim `torch.Tensor`, *optional*): `D` of the `sum_over_denominator` aggregation
            (required for `dr_grpo`, `dapo`, `cispo`, `vespo`).
        loss_scale (`float`, defaults to `1.0`): multiplies the aggregation's row weights, so that `loss`,
            `policy_loss` and `kl` come out in the caller's units (a trainer: divided by the accumulation steps).
        batch_rows (`int`, *optional*), batch_tokens (`float` or 0-dim `torch.Tensor`, *optional*): the rows and
            completion tokens of the whole micro-batch when the rows passed are only part of it and the others add
            exactly 0 (row skipping): each row passed keeps its weight in the whole micro-batch. Default: those passed.
        implementation (`str`, defaults to `"reference"`): `"reference"`, the formula with autograd; `"fused"` or
            `"compiled"`, the kernel of `fused.py` (clipped-surrogate rows only, first-order gradients only).

    Returns:
        [`GRPOLossOutput`].

    Raises:
        ValueError: naming the offending argument, for an implementation that is unknown or asked for outside its
            domain, a missing `sequence_weights` or `denominator`, a `batch_rows` below the rows passed, a shape or
            device mismatch, or an empty batch.
    """
    options = ObjectiveOptions() if options is None else options
    record = options.record
    problem = implementation_problem(implementation)
    if problem is not None:
        raise ValueError(problem)
    if record.needs_sequence_weights and sequence_weights is None:
        raise ValueError(f"loss_type={record.name!r} needs `sequence_weights` (TRL's gamma weights).")
    if record.aggregation == "sum_over_denominator" and denominator is None:
        raise ValueError(f"loss_type={record.name!r} needs `denominator` for its aggregation.")
    inputs = validate_inputs(
        logps,
        old_logps,
        ref_logps,
        advantages,
        completion_mask,
        beta=options.beta,
        optional={"sequence_weights": sequence_weights, "token_weights": token_weights},
    )
    num_rows = inputs.mask.size(0)
    if batch_rows is not None and not (isinstance(batch_rows, int) and batch_rows >= num_rows):
        raise ValueError(
            f"`batch_rows` must be an int >= the {num_rows} rows passed (the whole micro-batch's rows), "
            f"got {batch_rows!r}."
        )

    def row_weights_of(tokens: torch.Tensor) -> torch.Tensor:
        return AGGREGATIONS[record.aggregation](tokens, denominator, batch_rows, batch_tokens) * loss_scale

    if implementation == "reference":
        terms = _formula(inputs, options, row_weights_of, sequence_weights, token_weights)
        loss, policy_loss, kl, log_ratio, ratio, per_token_kl, low, high = terms
    else:
        outside = domain_problems(options, token_weights is not None)
        if outside:
            raise ValueError(kernel_refusal(implementation, outside))
        kernel = kernel_loss(
            inputs,
            row_weights_of,
            epsilon_low=options.epsilon,
            epsilon_high=options.epsilon_high,
            beta=options.beta,
            compiled=implementation == "compiled",
        )
        loss, policy_loss, kl, per_token_kl, log_ratio, ratio, low, high = kernel
    tokens = inputs.mask.sum(dim=-1)
    if options.importance_sampling_level == "sequence":  # one verdict per completion, every row counted (TRL)
        low_rows, high_rows, units = low.any(dim=-1), high.any(dim=-1), torch.ones_like(tokens)
    else:
        low_rows, high_rows, units = low.sum(dim=-1), high.sum(dim=-1), tokens
    policy_loss, kl = policy_loss.detach(), kl.detach()
    return GRPOLossOutput(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        kl_penalty=options.beta * kl,
        mask=inputs.mask,
        log_ratio=log_ratio,
        ratio=ratio,
        per_token_kl=per_token_kl,
        is_low_clipped=low,
        is_high_clipped=high,
        low_clipped_per_row=low_rows,
        high_clipped_per_row=high_rows,
        clip_units_per_row=units,
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
    implementation: str = "reference",
) -> GRPOLossOutput:
    """DeepSeekMath's GRPO loss `-J`: per-sequence length normalisation and the `exp(d) - d - 1` KL estimator.

    The `grpo` loss type of `policy_objective` (the formula: see the module docstring).

    Args:
        logps, old_logps, ref_logps, advantages, completion_mask: as in [`policy_objective`]; `old_logps=None` is
            on-policy, `ref_logps=None` only with `beta == 0`.
        epsilon (`float`, defaults to `0.2`): lower clipping width, > 0.
        epsilon_high (`float`, *optional*): upper clipping width, >= 0; `None` means `epsilon`.
        beta (`float`, defaults to `0.04`): KL coefficient, >= 0.
        implementation (`str`, defaults to `"reference"`): the formula with autograd, or the opt-in kernel
            (`"fused"`, `"compiled"`: first-order gradients only); all agree to rounding.

    Returns:
        [`GRPOLossOutput`]: `loss` (0-dim, differentiable), `policy_loss` and `kl` (0-dim, detached, with
        `loss == policy_loss + beta * kl`), and the per-token ratios, KL terms and clip masks.

    `old_logps`, `ref_logps` and `advantages` are constants. The arithmetic is in float32 (or the inputs' dtype if
    wider); the gradient comes back in the dtype of `logps`. The exponentials are exact for log differences up to
    `EXP_LINEAR_ABOVE` (20) and linear above, so extreme ratios give a large but finite loss; a log ratio of `-inf`
    is a ratio of 0. Other non-finite values at unmasked positions (NaN, `+inf` log-probs) make the loss non-finite.

    Raises:
        ValueError: naming the offending argument, for a shape or device mismatch, an empty batch, `epsilon <= 0`,
            `epsilon_high < 0`, `beta < 0`, `ref_logps=None` with `beta > 0`, or an unknown `implementation`.
    """
    options = ObjectiveOptions(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)
    return policy_objective(
        logps, old_logps, ref_logps, advantages, completion_mask, options, implementation=implementation
    )


def total_loss(
    objective_loss: torch.Tensor,
    *,
    scale: float,
    entropy_bonus: tuple[float, torch.Tensor] | None = None,
    router: tuple[float, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss a step backpropagates: the objective's loss with TRL's terms outside it, each in the units of the
    backward loss (`scale`: TRL's division by the accumulation steps where the objective's own divisor does not make
    it):

        loss = objective_loss - c_H * mean_entropy * scale + c_router * router_loss * scale

    Args:
        objective_loss (`torch.Tensor` of shape `()`): `policy_objective(...).loss`.
        scale (`float`): the accumulation scale of the terms below.
        entropy_bonus (`tuple[float, torch.Tensor]`, *optional*): `(c_H, mean_entropy)` (0-dim, with gradient).
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
