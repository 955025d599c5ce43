"""The two exponentials of the objective, kept finite: the importance ratio and the `exp(d) - d - 1` KL term.

Shared by the policy terms (`terms.py`), the fused kernel (`fused.py`) and the diagnostics, which all need the same
threshold above which `exp` is continued linearly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

__all__ = [
    "EXP_LINEAR_ABOVE",
    "all_at_most",
    "as_on_an_accelerator",
    "exp_linear_above",
    "exp_linear_above_and_slope",
    "kl_estimator",
    "kl_estimator_and_slope",
    "log_of_exp_linear_above",
]

# Above this exponent, exp(x) is continued by its tangent line instead (see `exp_linear_above`).
# exp(20) ~ 4.9e8: every ratio or KL term with |log difference| <= 20 is computed exactly, and a sum of a billion
# such terms still fits comfortably in float32 (max ~3.4e38).
EXP_LINEAR_ABOVE = 20.0


def all_at_most(x: torch.Tensor, threshold: float) -> bool:
    """Whether every value of `x` is `<= threshold` (no NaN), when that is free to ask: on a CPU, eagerly.

    A CPU tensor's maximum is read on the host at the cost of one reduction, which lets the callers skip work that
    only values above the threshold need (the exponential's tangent, a select). On other devices the read would
    wait for the device, and under `torch.compile` it would break the graph: there the answer is `False`, and the
    callers take the path that is right for every value.
    """
    if x.device.type not in _HOST_READ_DEVICES or torch.compiler.is_compiling():
        return False
    return bool(x.detach().amax() <= threshold) if x.numel() else True


_HOST_READ_DEVICES = {"cpu"}


@contextlib.contextmanager
def as_on_an_accelerator() -> Iterator[None]:
    """Within it, `all_at_most` answers `False` on a CPU too: CPU tensors take the path of a GPU's, which reads
    nothing on the host (what a count of host reads on a CPU, standing in for a GPU's synchronisations, measures)."""
    saved = set(_HOST_READ_DEVICES)
    _HOST_READ_DEVICES.clear()
    try:
        yield
    finally:
        _HOST_READ_DEVICES.update(saved)


def exp_linear_above(x: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE) -> torch.Tensor:
    """`exp(x)` for `x <= threshold`, continued by its tangent line `exp(t) * (1 + x - t)` above it.

    Plain `exp` overflows float32 at x ~ 88.7 and turns the loss into `inf` (then NaN once multiplied by a zero
    advantage). Clamping `x` (as verl and OpenRLHF do) keeps it finite but zeroes the gradient of exactly the tokens
    that drifted furthest. The tangent keeps the value continuous, the gradient continuous, positive and bounded by
    `exp(threshold)`, and the function convex, so `exp(d) - d - 1` stays >= 0.

    Args:
        x (`torch.Tensor` of any shape): exponents.
        threshold (`float`): where the tangent takes over.

    Returns:
        `torch.Tensor` of the same shape and dtype.
    """
    return exp_linear_above_and_slope(x, threshold)[0]


def exp_linear_above_and_slope(
    x: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE, *, at_most_threshold: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(exp_linear_above(x), its derivative exp(min(x, threshold)))`, the exponential computed once for both.

    Under `torch.compile` the derivative is a second exponential: inductor computes it again in each loop that reads
    it, where a shared value is written to memory when two loops read it (the fused kernel's value and gradient).
    Where no exponent is above the threshold (`all_at_most`), the tangent's terms are 0 and are not computed: the
    same values, four operations fewer (for a tensor that requires no gradient: what autograd differentiates is the
    general formula, whose gradient is rounded differently). `at_most_threshold=True` says the caller has checked.
    """
    if not x.requires_grad and (at_most_threshold or all_at_most(x, threshold)):
        value = torch.exp(x)
        return value, value
    x_below = x.clamp(max=threshold)
    value = torch.exp(x_below)
    slope = torch.exp(x.clamp(max=threshold)) if torch.compiler.is_compiling() else value
    return value * (1.0 + _excess(x, x_below)), slope


def kl_estimator(d: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE) -> torch.Tensor:
    """`exp(d) - d - 1` with `exp` as in `exp_linear_above`.

    `exp(d) - 1` is computed as `expm1(d)`: for small `d`, `exp(d) - d - 1` in float32 cancels to rounding noise
    (and can come out negative), while `expm1(d) - d` keeps the value `d**2 / 2` it should have.

    Args:
        d (`torch.Tensor` of any shape): `ref_logp - logp`.
        threshold (`float`): where the exponential's tangent takes over.

    Returns:
        `torch.Tensor` of the same shape and dtype, >= 0.
    """
    return kl_estimator_and_slope(d, threshold)[0]


def kl_estimator_and_slope(
    d: torch.Tensor, threshold: float = EXP_LINEAR_ABOVE, *, at_most_threshold: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(kl_estimator(d), its derivative expm1(min(d, threshold)))`, the exponential computed once for both (under
    `torch.compile`, twice; the shortcut and `at_most_threshold`: see `exp_linear_above_and_slope`)."""
    if not d.requires_grad and (at_most_threshold or all_at_most(d, threshold)):  # the tangent's terms are 0
        exp_minus_one = torch.expm1(d)
        return exp_minus_one - d, exp_minus_one
    d_below = d.clamp(max=threshold)
    exp_minus_one = torch.expm1(d_below)
    # d/dd (exp'(d) - d - 1) = exp'(d) - 1
    slope = torch.expm1(d.clamp(max=threshold)) if torch.compiler.is_compiling() else exp_minus_one
    return exp_minus_one * (1.0 + _excess(d, d_below)) - d_below, slope


def _excess(x: torch.Tensor, x_below: torch.Tensor) -> torch.Tensor:
    """How far `x` lies above the threshold, `x - x_below` with `x_below = x.clamp(max=threshold)`: the tangent's run.

    The same clamp as the exponential's: the two gradients of the clamp at the threshold itself then cancel, whatever
    subgradient torch gives it there (torch 2.14 gives 0, 2.13 1), and the slope at the threshold is `exp(threshold)`.
    `-inf - (-inf)` is NaN at `x = -inf`, where the exponential is exactly 0 (a ratio of 0: the token lost all its
    probability, as TRL's plain `exp` computes it): the run is 0 there, with no gradient. A NaN `x` stays NaN
    through `exp(x_below)`.
    """
    return torch.nan_to_num(x - x_below, nan=0.0, posinf=math.inf)


def log_of_exp_linear_above(value: float, threshold: float = EXP_LINEAR_ABOVE) -> float:
    """Inverse of `exp_linear_above` for one number: `log(value)` up to `exp(threshold)`, linear above it."""
    if value <= 0:
        return -math.inf
    if value <= math.exp(threshold):
        return math.log(value)
    return threshold + value / math.exp(threshold) - 1.0
