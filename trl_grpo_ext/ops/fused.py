"""The opt-in kernel: the clipped-surrogate rows of the objective with their analytic gradient.

`policy_objective(..., implementation="fused")` computes the per-token loss `L = P + beta K` of the formula
(`objective.py`, with the catalogue's `clipped_term`) and, in the same pass, `dL/dlogp`: the one `(N, T)` tensor the
backward pass keeps, where autograd through the formula keeps a dozen. `"compiled"` runs the same function through
`torch.compile`. With `r = exp'(x)`, `x = logp - old_logp`, `D = ref_logp - logp` and `c_i` the aggregation's row
weight:

    dL_it / dlogp_it   = -A_i * r'(x_it) * [not clipped]  -  beta * (exp'(D_it) - 1)
    d loss / dlogp_it  = c_i * dL_it / dlogp_it

The backward pass is first-order only. Measurements: docs/performance.md ("The loss kernel").
"""

from __future__ import annotations

import functools
import warnings

import torch

from .loss_types import loss_type_record
from .numerics import exp_linear_above_and_slope, kl_estimator_and_slope
from .terms import clipped_term

__all__ = ["domain_problems", "kernel_loss", "kernel_terms"]


def domain_problems(options, token_weights: bool) -> list[str]:
    """Why the kernel cannot compute the objective of `options` (an `ObjectiveOptions`, or a configuration with its
    fields) with per-token weights or without, one reason each (empty: it can)."""
    problems = []
    policy_term = loss_type_record(options.loss_type).policy_term
    if policy_term != "clipped":
        problems.append(f"it computes the clipped surrogate only (this loss type's term is {policy_term!r})")
    if options.importance_sampling_level != "token":
        problems.append("it takes token-level importance ratios only (importance_sampling_level='token')")
    if options.delta is not None:
        problems.append("it has no two-sided clipping (delta)")
    if token_weights:
        problems.append("it takes no per-token weights (off-policy or entropy masks, vLLM's correction)")
    if options.use_bias_correction_kl and options.beta != 0.0:
        problems.append("its KL term is not multiplied by the ratio (use_bias_correction_kl)")
    return problems


def kernel_terms(logp, old_logp, ref_logp, advantages, mask, epsilon_low, epsilon_high, beta, use_ref: bool, dtype):
    """The per-token terms of the clipped-surrogate objective and `dL/dlogp`.

    Args:
        logp, old_logp, ref_logp (`torch.Tensor` of shape `(N, T)`): detached; any values where `mask` is False.
        advantages (`torch.Tensor` of shape `(N, 1)` or `(N, T)`).
        mask (`torch.Tensor` of shape `(N, T)`, bool): the tokens that count.
        epsilon_low, epsilon_high, beta (`float`, or `torch.Tensor` of shape `()` when compiled: a float would be baked
            into the generated code, and a kernel from the on-disk cache would compute the loss of other values).
        use_ref (`bool`): whether `ref_logp` holds reference log-probs (else the KL terms are 0).
        dtype (`torch.dtype`): the computation dtype.

    Returns:
        `(policy_rows, per_token_kl, grad, log_ratio, ratio, is_low_clipped, is_high_clipped)`: `sum_t P_it`, `(N,)`;
        `K`, `dL/dlogp`, `x`, `r` and the flat regions of `P`, `(N, T)`, 0 or `False` where masked.
    """
    # Selected, not multiplied: the masked positions may hold NaN or inf.
    logp = torch.where(mask, logp.to(dtype), 0.0)
    policy_rows, grad, log_ratio, ratio, low, high = _policy_terms(
        logp, old_logp, advantages, mask, epsilon_low, epsilon_high, dtype
    )
    if use_ref:
        per_token_kl, kl_slope = kl_estimator_and_slope(torch.where(mask, ref_logp.to(dtype), 0.0) - logp)
        grad = grad - beta * kl_slope  # beta dK/dlogp = -beta (exp'(D) - 1)
    else:
        per_token_kl = torch.zeros_like(grad)
    return policy_rows, per_token_kl, grad, log_ratio, ratio, low, high


def _policy_terms(logp, old_logp, advantages, mask, epsilon_low, epsilon_high, dtype):
    """`sum_t P_it`, `dP/dlogp`, `x`, `r` and the flat regions of `P`: a function of its own, so that its temporaries
    are freed before the KL term's are made (the eager kernel's peak memory)."""
    log_ratio = logp - torch.where(mask, old_logp.to(dtype), 0.0)
    ratio, ratio_slope = exp_linear_above_and_slope(log_ratio)
    advantages = torch.where(mask, advantages.to(dtype), 0.0)
    policy, low, high = clipped_term(ratio, advantages, logp, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    # dP/dlogp = -A r'(x) where the term is not clipped, 0 where it is
    grad = torch.where(low | high, 0.0, -advantages * ratio_slope)
    return policy.sum(dim=-1), grad, log_ratio, torch.where(mask, ratio, 0.0), low, high


def kernel_loss(inputs, row_weights_of, *, epsilon_low: float, epsilon_high: float, beta: float, compiled: bool):
    """The objective of a clipped-surrogate row through the kernel; arguments as `policy_objective` validated them.

    Args:
        inputs (`ValidatedInputs`): the checked tensors.
        row_weights_of (`Callable[[torch.Tensor], torch.Tensor]`): the aggregation's row weights `c_i`, `(N,)`, from
            the completion tokens per row.
        epsilon_low, epsilon_high, beta (`float`): the hyper-parameters.
        compiled (`bool`): run the kernel through `torch.compile`.

    Returns:
        `(loss, policy_loss, kl, per_token_kl, log_ratio, ratio, is_low_clipped, is_high_clipped)`: `loss` (0-dim)
        differentiable with respect to `inputs.logps`, the aggregated `P` and `K` (0-dim), the rest `(N, T)`.
    """
    detached = inputs.logps.detach()
    old = detached if inputs.old_logps is None else inputs.old_logps
    use_ref = inputs.ref_logps is not None
    tensors = (detached, old, inputs.ref_logps if use_ref else detached, inputs.advantages, inputs.mask)
    hyperparameters = (float(epsilon_low), float(epsilon_high), float(beta))
    terms = _run_compiled(tensors, hyperparameters, use_ref, inputs.dtype) if compiled else None
    if terms is None:
        terms = kernel_terms(*tensors, *hyperparameters, use_ref, inputs.dtype)
    policy_rows, per_token_kl, grad, log_ratio, ratio, low, high = terms
    row_weights = row_weights_of(inputs.mask.sum(dim=-1).to(inputs.dtype))
    policy_loss = (policy_rows * row_weights).sum()
    kl = (per_token_kl.sum(dim=-1) * row_weights).sum()
    loss = _KernelLoss.apply(inputs.logps, policy_loss + beta * kl, grad, row_weights)
    return loss, policy_loss, kl, per_token_kl, log_ratio, ratio, low, high


_compiled_terms = None
_compile_failed = False


@functools.lru_cache(maxsize=32)
def _hyperparameter_tensors(epsilon_low: float, epsilon_high: float, beta: float, device: torch.device, dtype):
    """The compiled kernel's hyper-parameters as 0-dim tensors, made once per value, device and dtype."""
    return tuple(torch.tensor(value, dtype=dtype, device=device) for value in (epsilon_low, epsilon_high, beta))


def _run_compiled(tensors, hyperparameters, use_ref: bool, dtype):
    """`kernel_terms` through `torch.compile` (one graph for every shape and hyper-parameter value); `None` where
    compiling failed (warned once: the eager kernel computes the same)."""
    global _compiled_terms, _compile_failed
    if _compile_failed:
        return None
    if _compiled_terms is None:
        _compiled_terms = torch.compile(kernel_terms, dynamic=True, fullgraph=True)
    hyperparameter_tensors = _hyperparameter_tensors(*hyperparameters, tensors[0].device, dtype)
    try:
        return _compiled_terms(*tensors, *hyperparameter_tensors, use_ref, dtype)
    except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: fall back to the same code
        _compile_failed = True
        warnings.warn(f"torch.compile of the GRPO loss failed ({error}); using the eager kernel.", stacklevel=4)
        return None


class _KernelLoss(torch.autograd.Function):
    """The loss value, with the precomputed `dL/dlogp` and row weights for the backward pass."""

    @staticmethod
    def forward(ctx, logp, value, grad, row_weights):
        ctx.save_for_backward(grad, row_weights)
        ctx.logp_dtype = logp.dtype
        ctx.used = False
        return value

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # backward(create_graph=True): a differentiable gradient is being asked for
            raise RuntimeError(
                "The fused GRPO loss has a first-order gradient only (it is precomputed, with no graph behind it): "
                "create_graph=True and higher-order derivatives are not supported; use implementation='reference'."
            )
        if ctx.used:
            raise RuntimeError(
                "The fused GRPO loss scales its saved gradient in place and cannot run backward twice "
                "(retain_graph=True); use implementation='reference' for that."
            )
        ctx.used = True
        grad, row_weights = ctx.saved_tensors
        # In place on the saved buffer (no second (N, T) one), rounded to the dtype of `logp` once, at the end, as
        # autograd through the formula rounds it.
        return grad.mul_((row_weights * grad_output).unsqueeze(-1)).to(ctx.logp_dtype), None, None, None
