"""The clipped-surrogate objective with its analytic gradient: one saved `(N, T)` buffer instead of autograd's dozen.

Autograd through `objective.py`'s reference path keeps every `(N, T)` intermediate alive for the backward pass.
Here `fused_terms` reduces the objective's terms to per-row sums and computes, in the same pass, the derivative of the
loss with respect to `logp`, which is all the backward pass needs. With `x = logp - old_logp`, `r = exp(x)`,
`D = ref_logp - logp`, the per-token objective `S - beta K` (the loss is `-J`, `S = -P`) and `c_i` the
aggregation's row weight:

    d(S_it - beta K_it) / dlogp_it = A_i * r'(x_it) * [unclipped]  +  beta * (exp'(D_it) - 1)
    d loss / dlogp_it              = -c_i * d(S_it - beta K_it) / dlogp_it

`r'` and `exp'` are the derivatives of the exponential continued linearly above `EXP_LINEAR_ABOVE`, i.e.
`exp(min(x, 20))`, computed with the values (`numerics.exp_linear_above_and_slope`, `kl_estimator_and_slope`). The
clipped surrogate is written as one clamp with per-row bounds, `S = A clip(r, l, u)` (see `_policy_part`), which is
`terms.clipped_term`'s value and flat region. The pass keeps `d(S - beta K) / dlogp` in the
computation dtype; the backward pass multiplies it in place by `-c_i` and the incoming gradient and rounds it to the
dtype of `logp` once, as autograd through the reference does.

`implementation="compiled"` runs `fused_terms` through `torch.compile` (one graph, `fullgraph=True`), which turns it
into one loop over memory with no intermediate buffer. The compiled kernel takes `epsilon_low`, `epsilon_high` and
`beta` as 0-dim tensors, not Python floats: depending on the torch version and `torch._dynamo.config.specialize_float`,
`torch.compile` bakes float arguments into the generated code as constants, so that every new value would compile
the kernel again, and a kernel loaded from the on-disk inductor cache for one set of values would silently compute
the loss of another. The row weights stay outside the kernel, so the aggregation, its denominator and the loss scale
compile nothing either.

`implementation="fused"` runs the same function eagerly, one block of rows at a time (`BLOCK_ELEMENTS`): without a
compiler every operation writes a fresh buffer, so over the whole `(N, T)` batch its temporaries would cost a dozen
buffers and a trip to main memory each. Block by block they cost a fraction of one buffer, and on a CPU they stay in
the cache. With `statistics` (what the trainer asks for while it logs its diagnostics) each block also sums its
ratios into `ratio_statistics.ratio_sums` (count, moments, extremes, histogram of the log ratio) while they are in
the cache, instead of writing per-token ratios for the diagnostics to read again; compiled, they are counted after
the kernel from its per-token values.

The kernel's domain is the clipped surrogate with token-level ratios, no two-sided clipping, no per-token weights and
a plain (not ratio-weighted) KL term, under any aggregation: `domain_problems` says what lies outside it. The backward
pass is first-order only and refuses `create_graph=True`: the saved tensor is the gradient itself, with no graph
behind it. `implementation="reference"` supports higher-order gradients.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch

from .numerics import EXP_LINEAR_ABOVE, all_at_most, exp_linear_above_and_slope, kl_estimator_and_slope
from .ratio_statistics import RatioStatistics, ratio_statistics, ratio_sums, statistics_of_sums

__all__ = ["BLOCK_ELEMENTS", "FusedLoss", "domain_problems", "fused_loss", "fused_terms"]

#: Elements `(rows x T)` of the blocks the eager kernel works on, per device type (others: `BLOCK_ELEMENTS[None]`).
#: A block's ~20 temporaries are freed before the next block is computed, so they cost a constant, whatever the batch:
#: about 5 MiB in float32 on a CPU. Each of its ~45 operations (with the ratio statistics) costs a few microseconds
#: on a CPU beyond its arithmetic; at 64 x 4096 float32 on the reference machine, blocks of 2**15 (8 blocks) took
#: 5.3 ms with the statistics, 2**16 (4 blocks) 3.9 ms, and 2**17 and 2**18 faster again but with two to four
#: times the temporaries (`python -m benchmarks kernel`; docs/performance.md). On a GPU every operation is a kernel
#: launch: blocks of 2**20 elements leave the common batch sizes in one block, and bound the temporaries of very
#: long batches.
BLOCK_ELEMENTS = {"cpu": 2**16, None: 2**20}


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


def fused_terms(
    logp, old_logp, ref_logp, advantages, mask, epsilon_low, epsilon_high, beta, use_ref, dtype, keep, statistics=False
):
    """Per-row sums of the objective's terms and `d(S - beta K) / dlogp`, for `n` rows (a block of them, or all).

    Args:
        logp, old_logp, ref_logp (`torch.Tensor` of shape `(n, T)`): detached; any values where `mask` is False.
        advantages (`torch.Tensor` of shape `(n, 1)` or `(n, T)`).
        mask (`torch.Tensor` of shape `(n, T)`, bool): the tokens that count.
        epsilon_low, epsilon_high, beta (`float` or `torch.Tensor` of shape `()`): 0-dim tensors when compiled (see
            the module docstring).
        use_ref (`bool`): whether `ref_logp` holds reference log-probs (else the KL terms are 0).
        dtype (`torch.dtype`): the computation dtype.
        keep (`bool`): also return the per-token values.
        statistics (`bool`): also return the ratios' sums (eager only: the compiled graph has no histogram scatter).

    Returns:
        `(tokens, policy_rows, kl_rows, low_rows, high_rows, grad, per_token, ratio_stats)`: `(n,)` sums over each
        row's completion tokens of 1, `P`, `K` and the low- and high-clipped indicators; `grad`, `(n, T)`,
        `d(S - beta K) / dlogp` (0 at masked positions); `per_token`, with `keep`, the `(n, T)` values `(log_ratio,
        ratio, per_token_kl, is_low_clipped, is_high_clipped, advantages)` (0 or False at masked positions), else
        `None`; `ratio_stats`, with `statistics`, the `ratio_statistics.ratio_sums` of the ratios, else `None`.
    """
    logp = logp.to(dtype)  # once, for both halves (a no-op when it is already in the computation dtype)
    # The mask as 0/1 values, for products whose factors are finite: on a CPU an eager select (torch.where) costs
    # several times a product, and so does converting a bool tensor; converting its bytes does not.
    weight = mask.view(torch.uint8).to(dtype)
    policy_rows, clipped, grad, log_ratio, ratio, advantages = _policy_part(
        logp, old_logp, advantages, mask, weight, epsilon_low, epsilon_high, dtype
    )
    below, above = advantages < 0, advantages > 0  # where a clipped token is low-clipped, where high-clipped
    if advantages.shape[-1] == 1:  # one advantage per row: its clipped tokens are all low- or all high-clipped
        clipped_rows = clipped.sum(dim=-1)
        low_rows, high_rows = clipped_rows * below.squeeze(-1), clipped_rows * above.squeeze(-1)
    else:
        low_rows, high_rows = (clipped * below).sum(dim=-1), (clipped * above).sum(dim=-1)
    is_clipped = clipped > 0 if keep else None
    del clipped  # freed before the statistics' and the KL half's temporaries are made, as are the ratios unless kept
    ratio_stats = ratio_sums(log_ratio, ratio, weight) if statistics else None
    if not keep:
        del log_ratio, ratio
    if use_ref:
        kl_rows, kl_minus_grad, per_token_kl = _kl_part(logp, ref_logp, mask, weight, dtype)
        # d(S - beta K)/dlogp = dS/dlogp - beta dK/dlogp
        grad = grad.add_(kl_minus_grad, alpha=beta) if isinstance(beta, float) else grad + beta * kl_minus_grad
    else:
        kl_rows = torch.zeros_like(policy_rows)
        per_token_kl = torch.zeros_like(grad) if keep else None
    per_token = None
    if keep:  # as returned, the ratio is 0 where masked; with A = 0 there, the term is the same with r = 0 or 1
        per_token = (
            log_ratio,
            torch.where(mask, ratio, 0.0),
            per_token_kl,
            is_clipped & below,
            is_clipped & above,
            advantages * weight,
        )
    # Completion tokens per row: a float sum of the weights, exact to 2**24, costs a tenth of a bool tensor's sum
    tokens = weight.sum(dim=-1).to(torch.int64)
    return tokens, policy_rows, kl_rows, low_rows, high_rows, grad, per_token, ratio_stats


# The two halves of `fused_terms`, each a function so that its `(n, T)` temporaries are freed when it returns (the
# eager kernel's peak memory); torch.compile inlines them.


def _policy_part(logp, old_logp, advantages, mask, weight, epsilon_low, epsilon_high, dtype):
    """`sum_t P_it`, where the term is clipped (1, else 0), `dS/dlogp`, the log ratio, the ratio and `A`.

    With `l_i = 1 - eps_low` where `A_i < 0` (else `-inf`) and `u_i = 1 + eps_high` where `A_i > 0` (else `+inf`),

        S_it = min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i) = A_i clip(r_it, l_i, u_i)

    (for `A > 0` the minimum is `A min(r, 1 + eps_high)`, for `A < 0` it is `A max(r, 1 - eps_low)`): one clamp and
    one product, and the term is flat (clipped: zero gradient) exactly where the clamp moves `r`, i.e. where
    `r < 1 - eps_low` with `A < 0` or `r > 1 + eps_high` with `A > 0`, the regions of `terms.clipped_term`. A product
    with `A > 0` (`A < 0`) keeps (reverses) the order of its factors after rounding too, so the values are that
    term's, not only to rounding.
    """
    # Masked positions may hold NaN or inf: `_masked_difference` sets x = 0 (r = 1) there, and A = 0, so P and its
    # derivative are 0 and no token is clipped; all that follows is finite.
    log_ratio, at_most_threshold = _masked_difference(logp, old_logp.to(dtype), mask, weight)
    ratio, ratio_slope = exp_linear_above_and_slope(log_ratio, at_most_threshold=at_most_threshold)  # r(x), r'(x)
    advantages = advantages.to(dtype)
    if advantages.shape[-1] != 1:  # per token: any values where masked
        advantages = torch.where(mask, advantages, 0.0)
    lower = torch.full_like(advantages, -math.inf).masked_fill_(advantages < 0, 1.0 - epsilon_low)
    upper = torch.full_like(advantages, math.inf).masked_fill_(advantages > 0, 1.0 + epsilon_high)
    # clamp(r, l, u) = min(max(r, l), u), in two steps: on a CPU a clamp between two broadcast tensors costs 4 times
    # a clamp to each
    clipped_ratio = ratio.clamp(min=lower).clamp_(max=upper)
    token_advantages = advantages * weight  # A_it, 0 where masked
    policy_rows = -(clipped_ratio * token_advantages).sum(dim=-1)  # sum_t P_it, P = -S
    # dS/dlogp = A r'(x) where the term is not clipped, 0 where it is
    slope = token_advantages * ratio_slope
    if torch.compiler.is_compiling():  # inductor fuses a comparison into the loop; it writes a sign to memory
        clipped = ((ratio < lower) | (ratio > upper)).to(dtype)  # 1 where the clamp moved r, else 0
        grad = slope * (1.0 - clipped)
    else:
        # Eagerly, in place (fewer temporaries alive at a block's peak), and a sign, three times cheaper than a
        # comparison that writes a bool tensor; sign(NaN) = 0: a NaN ratio is not clipped, as in the catalogue.
        clipped = clipped_ratio.sub_(ratio).abs_().sign_()  # 1 where the clamp moved r, else 0
        grad = slope.addcmul_(slope, clipped, value=-1.0)
    return policy_rows, clipped, grad, log_ratio, ratio, advantages


def _kl_part(logp, ref_logp, mask, weight, dtype):
    """`sum_t K_it`, `-dK/dlogp` and `K`."""
    d, at_most_threshold = _masked_difference(ref_logp.to(dtype), logp, mask, weight)
    # K and -dK/dlogp = exp'(D) - 1, both 0 where masked
    per_token_kl, minus_grad = kl_estimator_and_slope(d, at_most_threshold=at_most_threshold)
    return per_token_kl.sum(dim=-1), minus_grad, per_token_kl


def _masked_difference(a, b, mask, weight):
    """`(x, at_most_threshold)`: `x = a - b` where `mask` is True, 0 elsewhere, whatever `a` and `b` hold there (NaN
    and inf included), and `True` if no value of `x` is above `EXP_LINEAR_ABOVE` (`None`: not known).

    A select (`torch.where`) costs five products on a CPU. Where the product with the 0/1 `weight` is all finite it
    is the select's value (`x * 1 = x`, `x * 0 = 0`; -0 where `x < 0`, which counts as 0 everywhere below). Its
    maximum (`all_at_most`) tells both: a NaN (from a masked inf or NaN, or among the values themselves) is not at
    most the threshold, and then the select is made.
    """
    product = (a - b).mul_(weight)
    if all_at_most(product, EXP_LINEAR_ABOVE):
        return product, True
    return torch.where(mask, a - b, 0.0), None


def _blocks_of_rows(logp, old_logp, ref_logp, advantages, mask, *hyperparameters, use_ref, dtype, keep, statistics):
    """`fused_terms`, eagerly, one block of rows at a time (`BLOCK_ELEMENTS`), written into whole-batch tensors."""
    num_rows, num_tokens = mask.shape
    rows = max(1, BLOCK_ELEMENTS.get(mask.device.type, BLOCK_ELEMENTS[None]) // num_tokens)
    arguments = (*hyperparameters, use_ref, dtype, keep, statistics)
    if rows >= num_rows:
        *terms, block_sums = fused_terms(logp, old_logp, ref_logp, advantages, mask, *arguments)
        return (*terms, [block_sums] if statistics else None)
    grad = torch.empty(mask.shape, dtype=dtype, device=mask.device)
    sums = ([], [], [], [], [])
    per_token = None
    if keep:
        dtypes = (dtype, dtype, dtype, torch.bool, torch.bool, dtype)
        per_token = tuple(torch.empty(mask.shape, dtype=value_dtype, device=mask.device) for value_dtype in dtypes)
    ratio_sums_of_blocks = []
    for start in range(0, num_rows, rows):
        block = slice(start, start + rows)
        inputs = (logp[block], old_logp[block], ref_logp[block], advantages[block], mask[block])
        ratio_sums_of_blocks.append(_write_block(block, fused_terms(*inputs, *arguments), sums, grad, per_token))
    return (*(torch.cat(row_sums) for row_sums in sums), grad, per_token, ratio_sums_of_blocks if statistics else None)


def _write_block(block, terms, sums, grad, per_token):
    """Store one block's results, so that its temporaries are freed before the next block is computed; returns its
    `ratio_sums`."""
    *block_sums, block_grad, block_values, block_stats = terms
    for row_sums, block_row_sums in zip(sums, block_sums, strict=True):
        row_sums.append(block_row_sums)
    grad[block] = block_grad
    if per_token is not None:
        for values, block_value in zip(per_token, block_values, strict=True):
            values[block] = block_value
    return block_stats


def _fused_terms_of_mask_bytes(
    logp, old_logp, ref_logp, advantages, mask_bytes, epsilon_low, epsilon_high, beta, use_ref, dtype, keep
):
    """`fused_terms` for `torch.compile`, the mask given as the bytes of the bool tensor (`mask.view(torch.uint8)`).

    Compiled for a CPU, a bool tensor read from memory is slow to turn into a vector mask (about a quarter of the
    kernel's time at 64 x 4096); a byte converted to a float and compared is not. The values are the same.
    """
    mask = mask_bytes.to(dtype) > 0
    return fused_terms(
        logp, old_logp, ref_logp, advantages, mask, epsilon_low, epsilon_high, beta, use_ref, dtype, keep
    )


_compiled_terms = None
_compile_failed = False


@functools.lru_cache(maxsize=32)
def _hyperparameter_tensors(epsilon_low: float, epsilon_high: float, beta: float, device: torch.device, dtype):
    """The compiled kernel's hyper-parameters as 0-dim tensors, made once per value, device and dtype."""
    return tuple(torch.tensor(value, dtype=dtype, device=device) for value in (epsilon_low, epsilon_high, beta))


def _run_terms(compiled: bool, *arguments, use_ref: bool, dtype: torch.dtype, keep: bool, statistics: bool):
    """`fused_terms` through `torch.compile` when asked, else block by block; if compiling fails, warn once and run
    it eagerly. Compiled, the ratio statistics are counted after the kernel, from its per-token values."""
    global _compiled_terms, _compile_failed
    if not compiled or _compile_failed:
        return _blocks_of_rows(*arguments, use_ref=use_ref, dtype=dtype, keep=keep, statistics=statistics)
    if _compiled_terms is None:
        _compiled_terms = torch.compile(_fused_terms_of_mask_bytes, dynamic=True, fullgraph=True)
    *tensors, mask, epsilon_low, epsilon_high, beta = arguments
    hyperparameters = _hyperparameter_tensors(epsilon_low, epsilon_high, beta, mask.device, dtype)
    try:
        terms = _compiled_terms(*tensors, mask.view(torch.uint8), *hyperparameters, use_ref, dtype, keep or statistics)
    except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: fall back to the same code
        _compile_failed = True
        warnings.warn(f"torch.compile of the GRPO loss failed ({error}); using the eager kernel.", stacklevel=4)
        return _blocks_of_rows(*arguments, use_ref=use_ref, dtype=dtype, keep=keep, statistics=statistics)
    if not statistics:
        return terms
    *sums, grad, per_token, _ = terms
    log_ratio, ratio = per_token[:2]
    ratio_stats = ratio_statistics(log_ratio, torch.where(mask, ratio, 1.0), mask.to(dtype))
    return (*sums, grad, per_token if keep else None, ratio_stats)


class _FusedLoss(torch.autograd.Function):
    """The loss value, computed from the row sums, with the precomputed `d(S - beta K) / dlogp` and row weights."""

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
        # d loss / dlogp_it = -c_i * d(S_it - beta K_it) / dlogp_it, times the incoming gradient. In place: the saved
        # gradient is this call's own buffer, so no second (N, T) buffer is needed (nor a copy for `logp.grad` in
        # float32); it is rounded to the dtype of `logp` once, at the end, as autograd through the reference does.
        return grad.mul_((-row_weights * grad_output).unsqueeze(-1)).to(ctx.logp_dtype), None, None, None


class FusedLoss(NamedTuple):
    """What `fused_loss` returns, by name.

    Attributes:
        loss (`torch.Tensor` of shape `()`): differentiable with respect to `inputs.logps`.
        policy_loss, kl (`torch.Tensor` of shape `()`): the aggregated `P` and `K`, detached.
        tokens, policy_rows, kl_rows, low_rows, high_rows (`torch.Tensor` of shape `(N,)`): sums over each row's
            completion tokens of 1, `P`, `K` and the low- and high-clipped indicators.
        log_ratio, ratio, per_token_kl, is_low_clipped, is_high_clipped, advantages (`torch.Tensor` of shape
            `(N, T)`): the per-token values with `keep` (0 or `False` at masked positions), else `None`.
        ratio_statistics ([`RatioStatistics`]): the completion tokens' ratios summed up, with `statistics`, else
            `None`.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    tokens: torch.Tensor
    policy_rows: torch.Tensor
    kl_rows: torch.Tensor
    low_rows: torch.Tensor
    high_rows: torch.Tensor
    log_ratio: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    per_token_kl: torch.Tensor | None = None
    is_low_clipped: torch.Tensor | None = None
    is_high_clipped: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ratio_statistics: RatioStatistics | None = None


def fused_loss(
    inputs,
    row_weights_of,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    compiled: bool,
    keep: bool,
    statistics: bool = False,
) -> FusedLoss:
    """The objective of the clipped row through the fused kernel; arguments as validated by `policy_objective`.

    Args:
        inputs (`ValidatedInputs`): the checked tensors.
        row_weights_of (`Callable[[torch.Tensor], torch.Tensor]`): the aggregation's row weights `c_i`, `(N,)`, from
            the completion tokens per row.
        epsilon_low, epsilon_high, beta (`float`): the hyper-parameters.
        compiled (`bool`): run the kernel through `torch.compile`.
        keep (`bool`): also return the per-token values.
        statistics (`bool`): also return the ratios' statistics, summed where the ratios are computed (eagerly: in
            each block of rows, with no `(N, T)` tensor written for them).

    Returns:
        [`FusedLoss`].
    """
    detached = inputs.logps.detach()
    old = detached if inputs.old_logps is None else inputs.old_logps
    use_ref = inputs.ref_logps is not None
    ref = inputs.ref_logps if use_ref else detached
    terms = _run_terms(
        compiled, detached, old, ref, inputs.advantages, inputs.mask, float(epsilon_low), float(epsilon_high),
        float(beta), use_ref=use_ref, dtype=inputs.dtype, keep=keep, statistics=statistics,
    )  # fmt: skip
    tokens, policy_rows, kl_rows, low_rows, high_rows, grad, per_token, ratio_stats = terms
    low_rows, high_rows = low_rows.to(tokens.dtype), high_rows.to(tokens.dtype)  # counts, as the reference's
    if isinstance(ratio_stats, list):  # the eager kernel's blocks' sums
        ratio_stats = statistics_of_sums(ratio_stats, tokens.sum(), inputs.mask.numel())
    row_weights = row_weights_of(tokens.to(inputs.dtype))
    policy_loss = (policy_rows * row_weights).sum()
    kl = (kl_rows * row_weights).sum()
    loss = _FusedLoss.apply(inputs.logps, policy_loss + beta * kl, grad, row_weights)
    per_token = per_token or (None,) * 6
    return FusedLoss(loss, policy_loss, kl, tokens, policy_rows, kl_rows, low_rows, high_rows, *per_token, ratio_stats)
