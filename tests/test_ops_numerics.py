"""`ops.numerics`: the exponentials kept finite, and their CPU shortcuts equal to the path every device takes."""

import math

import pytest
import torch

from trl_grpo_ext.ops import numerics
from trl_grpo_ext.ops.numerics import (
    EXP_LINEAR_ABOVE,
    all_at_most,
    as_on_an_accelerator,
    exp_linear_above,
    exp_linear_above_and_slope,
    kl_estimator,
    kl_estimator_and_slope,
)


def test_all_at_most_reads_the_maximum_on_a_cpu_only():
    values = torch.tensor([-3.0, 0.5, 2.0])
    assert all_at_most(values, 2.0) and not all_at_most(values, 1.9)
    assert not all_at_most(torch.tensor([0.0, math.nan]), 10.0)  # NaN is never "at most"
    assert all_at_most(torch.tensor([1.0, math.inf]), math.inf)
    assert all_at_most(torch.empty(0), 0.0)
    with as_on_an_accelerator():
        assert not all_at_most(values, 2.0)  # the path that reads nothing on the host
    assert all_at_most(values, 2.0)  # and back on leaving


@pytest.mark.parametrize("function", [exp_linear_above_and_slope, kl_estimator_and_slope])
@pytest.mark.parametrize("largest", [5.0, EXP_LINEAR_ABOVE, 35.0])
def test_the_shortcut_gives_the_values_and_slopes_of_the_general_path(function, largest):
    x = torch.cat([torch.linspace(-40.0, largest, 997), torch.tensor([0.0, -0.0, 1e-30])])
    shortcut = function(x)
    with as_on_an_accelerator():
        general = function(x)
    for got, expected in zip(shortcut, general, strict=True):
        assert torch.equal(got, expected)


def test_the_shortcut_is_taken_exactly_when_no_value_is_above_the_threshold(monkeypatch):
    answers = []
    original = numerics.all_at_most

    def spy(x, threshold):
        answers.append(original(x, threshold))
        return answers[-1]

    monkeypatch.setattr(numerics, "all_at_most", spy)
    exp_linear_above_and_slope(torch.tensor([0.0, 19.0]))
    kl_estimator_and_slope(torch.tensor([0.0, 21.0]))
    assert answers == [True, False]
    # What autograd differentiates (the reference objective) is the general formula, rounded as before
    exp_linear_above_and_slope(torch.tensor([0.0, 19.0], requires_grad=True))
    assert answers == [True, False]


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
