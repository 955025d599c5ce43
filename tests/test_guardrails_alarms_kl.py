"""The KL alarms (`guardrails/alarms/kl.py`): a KL that keeps growing, faster and faster, and one that does not."""

import math
import random

from helpers import resumed_at

from trl_grpo_ext.guardrails import ALARMS, AnomalyMonitor
from trl_grpo_ext.tools.report.health import assess


def kl_run(curve, steps: int = 400, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """One log entry per step: the KL `curve(step)`, times 1 plus normal noise of relative size `noise`."""
    rng = random.Random(seed)
    return [
        {"step": step, "loss": 0.1, "kl": max(curve(step) * (1.0 + rng.gauss(0, noise)), 0.0)}
        for step in range(1, steps + 1)
    ]


def doubling_kl(step: int) -> float:
    """A KL that doubles every 40 log steps: 2.38x over the rule's 50, from 0.01 at step 0."""
    return 0.01 * 2 ** (step / 40)


def test_a_kl_that_keeps_doubling_is_flagged_once_its_running_median_reaches_the_floor():
    history = kl_run(doubling_kl)
    (episode,) = [e for e in assess(history).episodes if e.name == "kl_growth"]
    # The median of the last 20 values of a rising series is the mean of the 10th and 11th from the end: at step 143
    # (kl(134) + kl(133)) / 2 = 0.101 reaches the floor (0.0993 at step 142), 2.4x its value 50 steps earlier.
    assert episode.start == 143 and episode.end == 400
    assert (
        "kl keeps growing: its median over the last 20 log steps is 0.101, up from 0.0655 25 and 0.0425 50 log steps "
        "earlier (2.4x)" in (episode.message)
    )
    assert "raise beta" in episode.message
    assert "[alarms/kl_growth; alarm_thresholds['kl_growth']=2, None switches it off]" in episode.message
    (kl,) = [signal for signal in assess(history).signals if signal.signal.name == "KL to the reference"]
    assert kl.verdict == "ALARM" and kl.onset == 143
    # Before kl_high's level (1.0, about step 266) and with no single jump for kl_jump.
    assert assess(history).alarms == ["kl_growth", "kl_high"]
    assert [e.start for e in assess(history).episodes if e.name == "kl_high"] == [266]


def test_a_kl_growing_slower_than_the_threshold_or_below_the_floor_or_only_at_the_start_is_not_flagged():
    runs = {
        # rl-doctor's healthy KL: linear from 0.02 to 0.37 over 400 steps; it doubles over 50 only below 0.086
        "linear": kl_run(lambda step: 0.02 + 0.00086 * step, noise=0.1),
        # doubling every 40 log steps, but 0.001 to 0.08 over the run: below the floor
        "small": kl_run(lambda step: 0.001 * 2 ** (step / 40), steps=250),
        # the demo's shape logged at every step: from 0 to 0.2 over its first 20 steps (0.17 at its step 17), then
        # noisy and slowly rising to 0.35: the first median of 20 takes in most of the rise, which then stops
        "start": kl_run(lambda step: min(step, 20) / 100 + 0.15 * max(step - 20, 0) / 380, noise=0.3),
        # from 0 to 0.25 over 40 steps, then flat: 4x over 50 log steps at step 70, but no longer growing (1.1x over
        # the last 25)
        "stopped": kl_run(lambda step: min(step, 40) / 160),
        "flat": kl_run(lambda step: 0.3, noise=0.3),
    }
    for name, history in runs.items():
        assert "kl_growth" not in assess(history).alarms, name
    # a doubling every 40 log steps is no threefold growth over 50
    monitor = AnomalyMonitor({"kl_growth": 3.0})
    monitor.replay(kl_run(doubling_kl))
    assert "kl_growth" not in monitor.counts


def test_a_kl_rise_that_stopped_is_no_growth():
    """Every run's KL rises from 0 as the policy leaves the reference; a rise that ends, however late in the first
    100 log steps, and at whatever level, is none (the rule waits for 70 logged values: most of such a rise is in its
    windows when it first judges)."""

    def rise(end: int, level: float):  # from 0 to `level` over `end` log steps, then held
        return lambda step: level * min(step, end) / end

    # the case found in review: a rise that stopped at step 60, judged from step 70
    assert "kl_growth" not in assess(kl_run(rise(60, 0.5), steps=300)).alarms
    flagged = {}
    for noise in (0.1, 0.3):
        for end in (50, 60, 70, 80, 90, 100):
            for level in (0.2, 0.5):
                runs = [kl_run(rise(end, level), steps=300, noise=noise, seed=seed) for seed in range(20)]
                flagged[noise, end, level] = sum("kl_growth" in assess(history).alarms for history in runs)
    assert max(flagged.values()) == 0, flagged


def test_kl_growth_carries_its_window_across_a_resume_and_none_switches_it_off():
    history = kl_run(doubling_kl, noise=0.05)
    whole = AnomalyMonitor()
    whole.replay(history)
    for cut in (60, 141, 200):  # before the rule is judged, the entry before its onset (step 142), in its episode
        assert resumed_at(history, cut, whole, "kl_growth") == (1 if cut < 142 else 0)
    off = AnomalyMonitor({"kl_growth": None})
    off.replay(history)
    assert "kl_growth" not in off.counts and "kl_growth" not in [rule.name for rule in off.rules]


def test_a_kl_that_is_not_a_number_is_skipped_by_kl_growth():
    clean, gappy = ALARMS["kl_growth"]("kl_growth", 2.0), ALARMS["kl_growth"]("kl_growth", 2.0)
    for entry in kl_run(doubling_kl, steps=200):
        # NaN (TRL's "no value"), infinite (kl_high's to flag), missing: the entry does not tell
        for skipped in ({"kl": math.nan}, {"kl": math.inf}, {"kl": None}, {}):
            assert gappy.judge(skipped) is None
        assert bool(gappy.judge(entry)) == bool(clean.judge(entry))
    assert gappy.values == clean.values
