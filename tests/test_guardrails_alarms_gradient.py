"""The gradient-norm alarms (`guardrails/alarms/gradient.py`): a gradient that vanishes without reaching 0, a NaN norm
of a step the non-finite guard skipped."""

from trl_grpo_ext.guardrails import AnomalyMonitor
from trl_grpo_ext.tools.report.health import assess


def test_a_nan_grad_norm_of_a_step_the_guard_skipped_is_no_spike():
    nan = float("nan")
    norms, skipped = [1.0, 1.1, 0.9, 1.0, 1.05, nan, 1.0, nan], [0, 0, 0, 0, 0, 1, 1, 2]
    history = [
        {"loss": 0.1, "step": step, "grad_norm": norm, "nonfinite/skipped_steps": count}
        for step, (norm, count) in enumerate(zip(norms, skipped, strict=True), start=1)
    ]
    monitor = AnomalyMonitor()
    monitor.replay(history)
    assert not monitor.episodes
    signals = {signal.signal.name: signal for signal in assess(history).signals}
    gradient, skips = signals["gradient norm"], signals["skipped non-finite steps"]
    assert gradient.verdict == "ok"
    assert skips.verdict == "note" and skips.onset == 6  # the skips are reported by the guard's own count
    # With the guard off (no count logged) the NaN norm was applied to the weights: an alarm, as before.
    monitor.replay(
        [{key: value for key, value in entry.items() if key != "nonfinite/skipped_steps"} for entry in history]
    )
    assert [(episode.name, episode.start) for episode in monitor.episodes] == [
        ("grad_norm_spike", 6),
        ("grad_norm_spike", 8),
    ]


def test_a_gradient_that_shrinks_to_a_tenth_is_flagged_and_a_decaying_healthy_one_is_not():
    shrinking = [{"step": s, "grad_norm": 1.0 * 0.95**s} for s in range(1, 80)]  # 0.2 of its start near step 33
    (episode,) = [e for e in assess(shrinking).episodes if e.name == "vanishing_gradient"]
    assert 33 <= episode.start <= 40 and "19.4% of its start (0.857)" in episode.message
    healthy = [{"step": s, "grad_norm": 0.55 * (0.6 + 0.4 * 0.99**s)} for s in range(1, 400)]  # to 60% of start
    assert "vanishing_gradient" not in assess(healthy).alarms
    zero = [{"step": s, "grad_norm": 0.0 if s > 5 else 1.0} for s in range(1, 20)]  # exactly 0: no_gradient's
    assert "vanishing_gradient" not in assess(zero).alarms and "no_gradient" in assess(zero).alarms
