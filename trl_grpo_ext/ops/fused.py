"""The clipped-surrogate objective with its analytic gradient: one saved `(N, T)` buffer instead of autograd's dozen.

Autograd through `objective.py`'s reference path keeps every `(N, T)` intermediate alive for the backward pass.
Here `fused_terms` reduces the objective's terms to per-row sums and computes, in the same pass, the derivative of the
per-token loss `P + beta * K` with respect to `logp`, which is all the backward pass needs. With `x = logp - old_logp`,
`r = exp(x)` and `D = ref_logp - logp`:

    d(P_it + beta K_it) / dlogp_it = -A_i * r'(x_it) * [unclipped]  -  beta * (exp'(D_it) - 1)
    d loss / dlogp_it              = c_i * d(P_it + beta K_it) / dlogp_it        (c_i: the aggregation's row weight)

`r'` and `exp'` are the derivatives of the exponential continued linearly above `EXP_LINEAR_ABOVE`, i.e.
`exp(min(x, 20))`. The values `P`, `K` and the clip indicators come from the catalogue (`terms.clipped_term`,
`numerics.kl_estimator`): the surrogate is written once, there.

`implementation="fused"` runs `fused_terms` eagerly; `"compiled"` runs it through `torch.compile`, which turns it into
one loop over memory. The compiled kernel takes `epsilon_low`, `epsilon_high` and `beta` as 0-dim tensors, not
Python floats: `torch.compile` bakes float arguments into the generated code as constants, and a kernel compiled (or
loaded from the on-disk inductor cache) for one set of values would silently compute the loss of another.

The kernel's domain is the clipped surrogate with token-level ratios, no two-sided clipping, no per-token weights and
a plain (not ratio-weighted) KL term, under any aggregation: `domain_problems` says what lies outside it. The backward
pass is first-order only and refuses `create_graph=True`: the saved tensor is the gradient itself, with no graph
behind it. `implementation="reference"` supports higher-order gradients.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .numerics import EXP_LINEAR_ABOVE, exp_linear_above, kl_estimator
from .terms import clipped_term

__all__ = ["domain_problems", "fused_loss", "fused_terms"]


def domain_problems(
    *,
    policy_term: str,
    importance_sampling_level: str,
    delta: float | None,
    token_weights: torch.Tensor | None,
    use_bias_correction_kl: bool,
    beta: float,
) -> list[str]:
    """Why the fused kernel cannot compute this objective, one reason each (empty: it can)."""
    problems = []
    if policy_term != "clipped":
        problems.append(f"it computes the clipped surrogate only (this loss type's term is {policy_term!r})")
    if importance_sampling_level != "token":
        problems.append("it takes token-level importance ratios only (importance_sampling_level='token')")
    if delta is not None:
        problems.append("it has no two-sided clipping (delta)")
    if token_weights is not None:
        problems.append("it takes no per-token weights (off-policy or entropy masks, vLLM's correction)")
    if use_bias_correction_kl and beta != 0.0:
        problems.append("its KL term is not multiplied by the ratio (use_bias_correction_kl)")
    return problems


def fused_terms(logp, old_logp, ref_logp, advantages, mask, epsilon_low, epsilon_high, beta, use_ref, dtype, keep):
    """Per-row sums of the objective's terms and the per-token derivative of `P + beta * K`.

    Args:
        logp, old_logp, ref_logp (`torch.Tensor` of shape `(N, T)`): detached; any values where `mask` is False.
        advantages (`torch.Tensor` of shape `(N, 1)` or `(N, T)`).
        mask (`torch.Tensor` of shape `(N, T)`, bool): the tokens that count.
        epsilon_low, epsilon_high, beta (`torch.Tensor` of shape `()` or `float`): tensors when compiled (see the
            module docstring).
        use_ref (`bool`): whether `ref_logp` holds reference log-probs (else the KL terms are 0).
        dtype: the computation dtype.
        keep (`bool`): also return the per-token values (else `None` in their places).

    Returns:
        `(tokens, policy_rows, kl_rows, low_rows, high_rows, grad, log_ratio, ratio, per_token_kl, low, high,
        advantages)`: `(N,)` sums over each row's completion tokens of 1, `P`, `K` and the low- and high-clipped
        indicators; `grad`, `(N, T)`, `d(P + beta K) / dlogp` (0 at masked positions); then the per-token values.
    """
    tokens = mask.sum(dim=-1).to(dtype)
    logp = torch.where(mask, logp.to(dtype), 0.0)
    log_ratio = logp - torch.where(mask, old_logp.to(dtype), 0.0)
    ratio = exp_linear_above(log_ratio)
    advantages = torch.where(mask, advantages.to(dtype), 0.0)
    policy, low, high = clipped_term(ratio, advantages, logp, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    # dP/dlogp = -A r'(x) where the surrogate is unclipped, 0 on its flat parts
    grad = torch.where(low | high, 0.0, -advantages * torch.exp(log_ratio.clamp(max=EXP_LINEAR_ABOVE)))
    if use_ref:
        d = torch.where(mask, ref_logp.to(dtype), 0.0) - logp
        per_token_kl = kl_estimator(d)
        # dK/dlogp = -(exp'(D) - 1); 0 where masked (D = 0 there)
        grad = grad - beta * torch.expm1(d.clamp(max=EXP_LINEAR_ABOVE))
    else:
        per_token_kl = torch.zeros_like(logp)
    rows = (tokens, policy.sum(dim=-1), per_token_kl.sum(dim=-1), low.sum(dim=-1), high.sum(dim=-1), grad)
    if not keep:
        return (*rows, None, None, None, None, None, None)
    return (*rows, log_ratio, torch.where(mask, ratio, 0.0), per_token_kl, low, high, advantages)


_compiled_terms = None
_compile_failed = False


@functools.lru_cache(maxsize=32)
def _hyperparameter_tensors(epsilon_low: float, epsilon_high: float, beta: float, device: torch.device, dtype):
    """The compiled kernel's hyper-parameters as 0-dim tensors, made once per value, device and dtype."""
    return tuple(torch.tensor(value, dtype=dtype, device=device) for value in (epsilon_low, epsilon_high, beta))


def _run_terms(compiled: bool, *arguments):
    """`fused_terms`, through `torch.compile` when asked; if compiling fails, warn once and run it eagerly."""
    global _compiled_terms, _compile_failed
    if not compiled or _compile_failed:
        return fused_terms(*arguments)
    if _compiled_terms is None:
        _compiled_terms = torch.compile(fused_terms, dynamic=True)
    logp, old, ref, advantages, mask, epsilon_low, epsilon_high, beta, use_ref, dtype, keep = arguments
    hyperparameters = _hyperparameter_tensors(epsilon_low, epsilon_high, beta, logp.device, dtype)
    try:
        return _compiled_terms(logp, old, ref, advantages, mask, *hyperparameters, use_ref, dtype, keep)
    except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: fall back to the same code
        _compile_failed = True
        warnings.warn(f"torch.compile of the GRPO loss failed ({error}); using the eager kernel.", stacklevel=4)
        return fused_terms(*arguments)


class _FusedLoss(torch.autograd.Function):
    """The loss value, computed from the row sums, with the precomputed `d loss / d logp`."""

    @staticmethod
    def forward(ctx, logp, value, grad):
        ctx.save_for_backward(grad)
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
        (grad,) = ctx.saved_tensors
        # In place: the saved gradient is this call's own buffer, so no second (N, T) buffer is needed.
        return grad.mul_(grad_output).to(ctx.logp_dtype), None, None


def fused_loss(inputs, row_weights_of, *, epsilon_low, epsilon_high, beta, compiled, keep):
    """The objective of the clipped row through the fused kernel; arguments as validated by `policy_objective`.

    Args:
        inputs (`ValidatedInputs`): the checked tensors.
        row_weights_of (`Callable[[torch.Tensor], torch.Tensor]`): the aggregation's row weights `c_i`, `(N,)`, from
            the completion tokens per row.
        epsilon_low, epsilon_high, beta (`float`): the hyper-parameters.
        compiled (`bool`): run the kernel through `torch.compile`.
        keep (`bool`): also return the per-token values.

    Returns:
        `(loss, policy_loss, kl, terms)`: `loss` differentiable w.r.t. `inputs.logps`, the detached aggregated `P`
        and `K`, and the kernel's outputs.
    """
    detached = inputs.logps.detach()
    old = detached if inputs.old_logps is None else inputs.old_logps
    use_ref = inputs.ref_logps is not None
    ref = inputs.ref_logps if use_ref else detached
    terms = _run_terms(
        compiled, detached, old, ref, inputs.advantages, inputs.mask, float(epsilon_low), float(epsilon_high),
        float(beta), use_ref, inputs.dtype, keep,
    )  # fmt: skip
    tokens, policy_rows, kl_rows, grad = terms[0], terms[1], terms[2], terms[5]
    row_weights = row_weights_of(tokens)
    grad.mul_(row_weights.unsqueeze(-1))  # d loss / d logp_it = c_i * d(P_it + beta K_it) / d logp_it
    policy_loss = (policy_rows * row_weights).sum()
    kl = (kl_rows * row_weights).sum()
    loss = _FusedLoss.apply(inputs.logps, policy_loss + beta * kl, grad)
    return loss, policy_loss, kl, terms
