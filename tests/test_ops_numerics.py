"""`ops.numerics`: the exponentials kept finite, and their CPU shortcuts equal to the path every device takes."""

import math

import pytest
import torch

from trl_grpo_ext.ops import numerics
from trl_grpo_ext.ops.numerics import (
    EXP_LINEAR_ABOVE,
    all_at_most,
    as_on_an_accelerator,
    exp_linear_above_and_slope,
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
