"""What the alarm families share (`guardrails/alarms/rule.py`): the correlation and the curvature statistic."""

import math
import random

import pytest

from trl_grpo_ext.guardrails.alarms.rule import curvature_t, pearson


def test_pearson_correlation():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None and pearson([1], [2]) is None


def test_curvature_t_is_large_on_an_acceleration_near_0_on_a_line_and_negative_where_a_rise_stops():
    rng = random.Random(0)
    assert curvature_t([0.01 * 1.05**i * (1 + rng.gauss(0, 0.05)) for i in range(70)]) > 5
    assert abs(curvature_t([0.01 * i * (1 + rng.gauss(0, 0.05)) for i in range(70)])) < 3
    assert curvature_t([min(i, 40) * (1 + rng.gauss(0, 0.05)) for i in range(70)]) < -5
    assert curvature_t([0.5 * i for i in range(70)]) == 0.0 and curvature_t([1.0, 2.0, 4.0]) == 0.0
    assert curvature_t([i * i for i in range(10)]) == math.inf
