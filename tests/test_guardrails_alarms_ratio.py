"""The clipping alarms (`guardrails/alarms/ratio.py`): clipping on one side of the clip range."""

from trl_grpo_ext.tools.report.health import assess


def test_clipping_on_one_side_is_flagged_naming_the_side_and_even_clipping_is_not():
    def clipped(low, high, steps=10):
        return [{"step": s, "clip_ratio/low_mean": low, "clip_ratio/high_mean": high} for s in range(1, steps + 1)]

    (low,) = [e for e in assess(clipped(0.15, 0.03)).episodes if e.name == "clip_asymmetry"]
    assert low.start == 5 and "clip_ratio/low_mean 0.15 against high_mean 0.03" in low.message
    (high,) = [e for e in assess(clipped(0.0, 0.08)).episodes if e.name == "clip_asymmetry"]
    assert "epsilon_high (clip-higher" in high.message
    assert "clip_asymmetry" not in assess(clipped(0.05, 0.04)).alarms  # even
    assert "clip_asymmetry" not in assess(clipped(0.03, 0.0)).alarms  # lopsided, but too little clipped to matter
