"""The GRPO loss with its analytic gradient, in one pass over memory and one saved `(N, T)` buffer.

Autograd through `loss.py`'s readable formula keeps a dozen `(N, T)` intermediates alive for the backward pass.
Here one function, `fused_terms`, reduces the objective's terms to per-row sums and computes the derivative of the
loss with respect to `logp`, which is all the backward pass needs. With `r = exp(x)`, `x = logp - old_logp` and
`D = ref_logp - logp`:

    d loss / d logp_it = -(1 / (N |o_i|)) * (dS_it/dlogp_it - beta * dK_it/dlogp_it)
    dS_it / dlogp_it   = A_i * r'(x_it)   where the surrogate takes the unclipped branch, else 0
    dK_it / dlogp_it   = -(exp'(D_it) - 1)

`r'` and `exp'` are the derivatives of the exponential continued linearly above 20 (`EXP_LINEAR_ABOVE`), i.e.
`exp(min(x, 20))`. `fused_terms` is plain tensor code for `torch.compile`, which turns it into one loop over
memory; its clip indicators come from `sign` rather than comparisons because, compiled for CPUs, boolean
intermediates go through a byte buffer and cost more than the arithmetic. `fused_terms_eager` computes the same
values in place, for eager execution.

The compiled kernel takes `1 - eps_low`, `1 + eps_high` and `beta` as 0-dim tensors, not Python floats:
`torch.compile` bakes float arguments into the generated code as constants, and a kernel compiled (or loaded from
the on-disk inductor cache) for one set of values silently computed the loss of another.

The backward pass is first-order only and refuses `create_graph=True`: the saved tensor is the gradient itself,
with no graph behind it. `implementation="reference"` in `grpo_loss` supports higher-order gradients.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .numerics import EXP_LINEAR_ABOVE

__all__ = ["fused_grpo_loss", "fused_terms", "fused_terms_eager"]


def fused_terms(logp, old_logp, ref_logp, advantages, mask, low_bound, high_bound, beta, use_ref, dtype):
    """Per-row sums of the objective's terms and the per-token derivative of the loss.

    Args:
        logp, old_logp, ref_logp (`torch.Tensor` of shape `(N, T)`): detached; any values where `mask` is 0.
        advantages (`torch.Tensor` of shape `(N, 1)` or `(N, T)`).
        mask (`torch.Tensor` of shape `(N, T)`): non-zero at the tokens that count.
        low_bound, high_bound, beta (`torch.Tensor` of shape `()` or `float`): `1 - eps_low`, `1 + eps_high` and
            the KL coefficient (tensors when compiled, see the module docstring).
        use_ref (`bool`): whether `ref_logp` holds reference log-probs (else the KL terms are 0).
        dtype: the computation dtype.

    Returns:
        `(tokens, surrogate_rows, kl_rows, low_rows, high_rows, grad)`: `(N,)` sums over each row's completion
        tokens of 1, `S`, `K` and the low- and high-clipped indicators, and `grad`, `(N, T)`, d loss / d logp
        (0 at masked positions).
    """
    keep = mask != 0
    tokens = torch.where(keep, 1.0, 0.0).to(dtype).sum(dim=-1)
    logp = torch.where(keep, logp.to(dtype), 0.0)
    x = logp - torch.where(keep, old_logp.to(dtype), 0.0)
    x_below = x.clamp(max=EXP_LINEAR_ABOVE)
    slope = torch.exp(x_below)
    ratio = slope * (1.0 + (x - x_below))
    advantages = torch.where(keep, advantages.to(dtype), 0.0)
    # The surrogate is flat (clipped branch) below 1 - eps_low for A < 0 and above 1 + eps_high for A > 0.
    low = torch.relu(torch.sign(low_bound - ratio)) * torch.relu(-torch.sign(advantages))
    high = torch.relu(torch.sign(ratio - high_bound)) * torch.relu(torch.sign(advantages))
    flat = low + high
    # Selected, not blended: ratio + flat * (clipped - ratio) would cancel to noise for very large ratios.
    surrogate = advantages * torch.where(flat > 0, torch.clamp(ratio, low_bound, high_bound), ratio)
    grad = advantages * slope * (1.0 - flat)  # dS/dlogp
    if use_ref:
        d = torch.where(keep, ref_logp.to(dtype), 0.0) - logp
        d_below = d.clamp(max=EXP_LINEAR_ABOVE)
        expm1_below = torch.expm1(d_below)
        kl_rows = (expm1_below * (1.0 + (d - d_below)) - d_below).sum(dim=-1)
        grad = grad + beta * expm1_below  # - beta * dK/dlogp; 0 where masked (D = 0 there)
    else:
        kl_rows = torch.zeros_like(tokens)
    grad = grad * (-1.0 / (logp.shape[0] * tokens.clamp(min=1))).unsqueeze(-1)
    return tokens, surrogate.sum(dim=-1), kl_rows, low.sum(dim=-1), high.sum(dim=-1), grad


def fused_terms_eager(logp, old_logp, ref_logp, advantages, mask, low_bound, high_bound, beta, use_ref, dtype):
    """`fused_terms` for eager execution: the same values, computed in place in four reused `(N, T)` buffers.

    Without a compiler every operation is a pass over memory and a fresh buffer; reusing buffers in place keeps
    the peak at a handful of them and the time at about half of autograd's.
    """
    keep = mask if mask.dtype == torch.bool else mask != 0
    drop = ~keep
    tokens = keep.sum(dim=-1, dtype=dtype)
    per_token_advantages = advantages.shape[-1] != 1
    if per_token_advantages:
        advantages = torch.where(keep, advantages.to(dtype), 0.0)
    else:  # one advantage per row; a row without tokens contributes nothing, whatever its advantage
        advantages = torch.where(tokens.unsqueeze(-1) > 0, advantages.to(dtype), 0.0)

    selected = logp.to(dtype, copy=True).masked_fill_(drop, 0.0)  # logp, 0 where masked
    work = torch.sub(selected, old_logp.to(dtype)).masked_fill_(drop, 0.0)  # x
    slope = work.clamp(max=EXP_LINEAR_ABOVE)  # min(x, 20)
    work.sub_(slope)  # x - min(x, 20): 0 below the threshold
    slope.exp_()  # r'
    work.add_(1.0).mul_(slope)  # r (1 where masked)
    low = (work < low_bound) & (advantages < 0)
    high = (work > high_bound) & (advantages > 0)
    low_rows, high_rows = low.sum(dim=-1, dtype=dtype), high.sum(dim=-1, dtype=dtype)
    # S = A * r, with r replaced by its clip bound where the surrogate is flat
    work.masked_fill_(low, low_bound).masked_fill_(high, high_bound)
    if per_token_advantages:
        surrogate_rows = (work.mul_(advantages)).sum(dim=-1)
    else:  # sum_t A_i phi_it = A_i * (sum_t (phi_it - 1) + |o_i|): masked positions hold phi = 1 exactly
        surrogate_rows = advantages.squeeze(-1) * (work.sub_(1.0).sum(dim=-1) + tokens)
    grad = slope.masked_fill_(low | high, 0.0).mul_(advantages).masked_fill_(drop, 0.0)  # dS/dlogp
    if use_ref:
        work.copy_(ref_logp).sub_(selected).masked_fill_(drop, 0.0)  # D
        below = selected.copy_(work).clamp_(max=EXP_LINEAR_ABOVE)  # min(D, 20)
        work.sub_(below)  # D - min(D, 20)
        expm1_below = torch.expm1(below)
        kl_rows = (expm1_below - below).sum(dim=-1) + (expm1_below * work).sum(dim=-1)
        grad.add_(expm1_below, alpha=beta)  # - beta * dK/dlogp
    else:
        kl_rows = torch.zeros_like(tokens)
    grad.mul_((-1.0 / (logp.shape[0] * tokens.clamp(min=1))).unsqueeze(-1))
    return tokens, surrogate_rows, kl_rows, low_rows, high_rows, grad


_compiled_terms = None
_compile_failed = False


@functools.lru_cache(maxsize=32)
def _hyperparameter_tensors(low_bound: float, high_bound: float, beta: float, device: torch.device, dtype):
    """The compiled kernel's hyper-parameters as 0-dim tensors, made once per value, device and dtype."""
    return tuple(torch.tensor(value, dtype=dtype, device=device) for value in (low_bound, high_bound, beta))


def _terms(compiled: bool, logp, old_logp, ref_logp, advantages, mask, low_bound, high_bound, beta, use_ref, dtype):
    """`fused_terms`, through `torch.compile` when asked; if compiling fails, warn once and run it eagerly."""
    global _compiled_terms, _compile_failed
    arguments = (logp, old_logp, ref_logp, advantages, mask, low_bound, high_bound, beta, use_ref, dtype)
    if not compiled or _compile_failed:
        return fused_terms_eager(*arguments)
    if _compiled_terms is None:
        _compiled_terms = torch.compile(fused_terms, dynamic=True)
    low_t, high_t, beta_t = _hyperparameter_tensors(low_bound, high_bound, beta, logp.device, dtype)
    try:
        return _compiled_terms(logp, old_logp, ref_logp, advantages, mask, low_t, high_t, beta_t, use_ref, dtype)
    except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: fall back to the same code
        _compile_failed = True
        warnings.warn(f"torch.compile of the GRPO loss failed ({error}); using the eager kernel.", stacklevel=3)
        return fused_terms_eager(*arguments)


class _FusedGRPOLoss(torch.autograd.Function):
    """`-(1/N) sum_i (S_i - beta K_i) / |o_i|` from the row sums, with the precomputed d loss / d logp."""

    @staticmethod
    def forward(ctx, logp, surrogate_rows, kl_rows, tokens, grad, beta):
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        ctx.used = False
        return -((surrogate_rows - beta * kl_rows) / tokens.clamp(min=1)).mean()

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
        return grad.mul_(grad_output).to(ctx.logp_dtype), None, None, None, None, None


def fused_grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    dtype: torch.dtype,
    compiled: bool = False,
):
    """The loss and its parts from `fused_terms`; arguments as validated by `grpo_loss`.

    Returns:
        `(loss, policy_loss, kl, rows)` as `grpo_loss` needs them.
    """
    detached = logps.detach()
    old = detached if old_logps is None else old_logps.detach()
    use_ref = ref_logps is not None
    ref = ref_logps.detach() if use_ref else detached
    tokens, surrogate_rows, kl_rows, low_rows, high_rows, grad = _terms(
        compiled,
        detached,
        old,
        ref,
        advantages.detach(),
        completion_mask,
        1.0 - epsilon,
        1.0 + epsilon_high,
        float(beta),
        use_ref,
        dtype,
    )
    loss = _FusedGRPOLoss.apply(logps, surrogate_rows, kl_rows, tokens, grad, float(beta))
    per_row_tokens = tokens.clamp(min=1)
    policy_loss = -(surrogate_rows / per_row_tokens).mean()
    kl = (kl_rows / per_row_tokens).mean()
    rows = {"tokens": tokens, "kl": kl_rows, "low": low_rows, "high": high_rows}
    return loss, policy_loss, kl, rows
