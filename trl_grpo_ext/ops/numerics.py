"""The two exponentials of the objective, kept finite: the importance ratio and the `exp(d) - d - 1` KL term.

Both are exact up to `EXP_LINEAR_ABOVE` and continue along their tangent line above it (why: docs/objective.md,
"Numerics").
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "EXP_LINEAR_ABOVE",
    "exp_linear_above",
    "exp_linear_above_and_slope",
    "kl_estimator",
    "kl_estimator_and_slope",
    "log_of_exp_linear_above",
]

# exp(20) ~ 4.9e8: every ratio or KL term with |log difference| <= 20 is exact, and a sum of a billion of them still
# fits in float32.
EXP_LINEAR_ABOVE = 20.0


def exp_linear_above(x: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE) -> torch.Tensor:
    """`exp(x)` for `x <= threshold`, continued by its tangent line `exp(t) * (1 + x - t)` above it.

    The value and the gradient stay continuous and finite, the gradient positive and at most `exp(threshold)`, the
    function convex (so `exp(d) - d - 1 >= 0`); `exp(-inf)` is 0.

    Args:
        x (`torch.Tensor` of any shape): exponents.
        threshold (`float`): where the tangent takes over.

    Returns:
        `torch.Tensor` of the same shape and dtype.
    """
    return exp_linear_above_and_slope(x, threshold)[0]


def exp_linear_above_and_slope(
    x: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(exp_linear_above(x), its derivative exp(min(x, threshold)))`, the exponential computed once for both."""
    x_below = x.clamp(max=threshold)
    value = torch.exp(x_below)
    # Under torch.compile a second exponential is cheaper than a shared buffer that two loops read.
    slope = torch.exp(x.clamp(max=threshold)) if torch.compiler.is_compiling() else value
    return value * (1.0 + _excess(x, x_below)), slope


def kl_estimator(d: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE) -> torch.Tensor:
    """`exp(d) - d - 1` with `exp` as in `exp_linear_above`, `>= 0`.

    `exp(d) - 1` is `expm1(d)`: in float32 `exp(d) - d - 1` cancels to rounding noise for small `d` (even below 0),
    `expm1(d) - d` keeps its value `d**2 / 2`.

    Args:
        d (`torch.Tensor` of any shape): `ref_logp - logp`.
        threshold (`float`): where the exponential's tangent takes over.

    Returns:
        `torch.Tensor` of the same shape and dtype.
    """
    return kl_estimator_and_slope(d, threshold)[0]


def kl_estimator_and_slope(d: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE) -> tuple[torch.Tensor, torch.Tensor]:
    """`(kl_estimator(d), its derivative expm1(min(d, threshold)))`, the exponential computed once for both."""
    d_below = d.clamp(max=threshold)
    exp_minus_one = torch.expm1(d_below)
    slope = torch.expm1(d.clamp(max=threshold)) if torch.compiler.is_compiling() else exp_minus_one
    return exp_minus_one * (1.0 + _excess(d, d_below)) - d_below, slope


def _excess(x: torch.Tensor, x_below: torch.Tensor) -> torch.Tensor:
    """The tangent's run `x - x_below`, with the exponential's own clamp (so that the clamp's two gradients cancel at
    the threshold, whatever subgradient torch gives it there); 0 at `x = -inf`, where `-inf - (-inf)` is NaN."""
    return torch.nan_to_num(x - x_below, nan=0.0, posinf=math.inf)


def log_of_exp_linear_above(value: float, threshold: float = EXP_LINEAR_ABOVE) -> float:
    """Inverse of `exp_linear_above` for one number: `log(value)` up to `exp(threshold)`, linear above it."""
    if value <= 0:
        return -math.inf
    if value <= math.exp(threshold):
        return math.log(value)
    return threshold + value / math.exp(threshold) - 1.0
