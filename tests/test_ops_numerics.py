"""`ops.numerics`: the exponentials kept finite."""

import math

import pytest
import torch

from trl_grpo_ext.ops.numerics import (
    EXP_LINEAR_ABOVE,
    exp_linear_above,
    exp_linear_above_and_slope,
    kl_estimator,
    kl_estimator_and_slope,
)


@pytest.mark.parametrize("function", [exp_linear_above_and_slope, kl_estimator_and_slope])
def test_the_value_and_slope_are_the_exponential_s_below_the_threshold_and_its_tangent_s_above(function):
    x = torch.tensor([-40.0, -1.0, 0.0, 1e-30, 5.0, EXP_LINEAR_ABOVE, EXP_LINEAR_ABOVE + 3.0], dtype=torch.float64)
    value, slope = function(x)
    exp_minus = 0.0 if function is exp_linear_above_and_slope else 1.0  # the KL term's slope is exp'(d) - 1
    below = x <= EXP_LINEAR_ABOVE
    expected = torch.where(below, x.exp(), math.exp(EXP_LINEAR_ABOVE) * (1 + x - EXP_LINEAR_ABOVE))
    if exp_minus:  # exp'(d) - d - 1
        expected = torch.where(below, torch.expm1(x) - x, expected - x - 1)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-300)
    exponential = torch.expm1 if exp_minus else torch.exp
    torch.testing.assert_close(slope, exponential(x.clamp(max=EXP_LINEAR_ABOVE)), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize(
    ("function", "slope_at_threshold"),
    [(exp_linear_above, math.exp(EXP_LINEAR_ABOVE)), (kl_estimator, math.expm1(EXP_LINEAR_ABOVE))],
)
def test_the_slope_at_the_threshold_is_the_exponential_s_whatever_torch_s_clamp_subgradient(
    function, slope_at_threshold
):
    """The exponential and its tangent meet at the threshold: the slope there is `exp(20)` (the KL term's `expm1(20)`),
    from the left, the right and at the point itself. torch 2.14 gives `clamp(max=t)` a gradient of 0 at `t` (2.13: 1);
    a tangent's run written with another clamp than the exponential's doubled or zeroed the slope at the point."""
    for x0 in (EXP_LINEAR_ABOVE - 1e-3, EXP_LINEAR_ABOVE, EXP_LINEAR_ABOVE + 1e-3):
        x = torch.tensor([x0], dtype=torch.float64, requires_grad=True)
        function(x).sum().backward()
        assert x.grad.item() == pytest.approx(slope_at_threshold, rel=2e-3), x0


@pytest.mark.parametrize("function", [exp_linear_above, kl_estimator])
def test_minus_infinity_gives_the_exponential_s_value_there_and_a_finite_slope(function):
    """exp(-inf) = 0 (a ratio of 0); the tangent's run is 0 there, not `-inf - (-inf)` = NaN."""
    x = torch.tensor([-math.inf, 0.0], requires_grad=True)
    value = function(x)
    value.sum().backward()
    assert value[0].item() == (0.0 if function is exp_linear_above else math.inf)
    assert torch.isfinite(x.grad).all()
