"""The alarms added for the peers' checks, on synthetic runs that fail and on healthy ones: a reward that stops
improving, or never improves, is a plateau (a noisy but rising one is not); groups that stay flat, too easy or too
hard; a gradient that vanishes without reaching 0; clipping on one side of the clip range."""

import random

from trl_grpo_ext.guardrails import AnomalyMonitor
from trl_grpo_ext.guardrails.progress_rules import slope_t
from trl_grpo_ext.report.health import assess


def noisy_run(curve, steps: int = 400, noise: float = 0.03, seed: int = 0) -> list[dict]:
    """One log entry per step: `curve(step)` plus normal noise, with a gradient norm and a loss."""
    rng = random.Random(seed)
    return [
        {"step": step, "loss": 0.1, "grad_norm": 1.0, "reward": curve(step) + rng.gauss(0, noise)}
        for step in range(1, steps + 1)
    ]


def test_a_reward_that_never_improves_is_a_plateau_and_never_ok():
    for seed in range(5):
        health = assess(noisy_run(lambda step: 0.3, seed=seed))
        assert "plateau" in health.alarms and not health.ok
        reward = health.signals[0]
        assert reward.verdict == "ALARM" and reward.severity == "note" and reward.onset is not None


def test_a_reward_that_stops_improving_is_a_plateau_150_log_steps_after_its_last_gain():
    for seed in range(5):
        history = noisy_run(lambda step: min(step, 100) / 200, steps=450, seed=seed)
        episodes = [e for e in assess(history).episodes if e.name == "plateau"]
        # the running median reaches its level about 5 log steps after the rise ends; chance bests delay it a little
        # (or end an episode: a flat reward's median beats its best by 1.5 standard errors now and then)
        assert episodes and 255 <= episodes[0].start <= 450, episodes


def test_a_noisy_reward_that_keeps_rising_slowly_is_no_plateau():
    # 0.13 over 400 log steps under noise of 0.03 per step: each 150-step span gains about 1.6 noise widths
    for seed in range(5):
        history = noisy_run(lambda step: 0.2 + step / 3000, seed=seed)
        assert "plateau" not in assess(history).alarms


def test_the_plateau_threshold_counts_log_steps_and_can_be_switched_off():
    history = noisy_run(lambda step: 0.3, steps=60)
    monitor = AnomalyMonitor(plateau_steps=20)
    monitor.replay(history)
    assert [e.name for e in monitor.episodes] == ["plateau"] and monitor.episodes[0].start <= 40
    monitor = AnomalyMonitor(plateau_steps=None)
    monitor.replay(noisy_run(lambda step: 0.3))
    assert "plateau" not in monitor.counts


def test_slope_t_is_large_on_a_trend_and_small_on_noise():
    rng = random.Random(0)
    assert slope_t([0.01 * i + rng.gauss(0, 0.01) for i in range(20)]) > 5
    assert abs(slope_t([rng.gauss(0, 0.01) for _ in range(20)])) < 3
    assert slope_t([1.0] * 20) == 0.0 and slope_t([0.0, 1.0]) == 0.0


def flat_run(share: float, reward: float, steps: int = 30) -> list[dict]:
    return [
        {"step": s, "reward": reward, "frac_reward_zero_std": share, "grad_norm": 1.0} for s in range(1, steps + 1)
    ]


def test_flat_groups_say_too_easy_too_hard_or_unknown():
    # 80% flat at a mean reward of 0.85: at least 65% of the groups all at the maximum; at 0.1, at least 70% all at the
    # minimum; every group flat at 0.5: half each way, named as too easy (the tie)
    cases = {(0.8, 0.85): "at least 65% of the groups scored the maximum", (0.8, 0.1): "mostly too hard"}
    cases[1.0, 0.5] = "mostly too easy"
    for (share, reward), words in cases.items():
        monitor = AnomalyMonitor()
        monitor.replay(flat_run(share, reward))
        (episode,) = [e for e in monitor.episodes if e.name == "flat_groups"]
        assert episode.start == 10 and words in episode.message and episode.severity == "note"
    monitor = AnomalyMonitor()
    monitor.replay(flat_run(0.8, 2.5))  # a reward outside [0, 1]: the side is not known
    (episode,) = [e for e in monitor.episodes if e.name == "flat_groups"]
    assert "Too easy if the mean reward is near its maximum" in episode.message


def test_a_healthy_share_of_flat_groups_raises_nothing():
    for share in (0.2, 0.44, 0.59):
        health = assess(flat_run(share, 0.5))
        assert "flat_groups" not in health.alarms


def test_a_gradient_that_shrinks_to_a_tenth_is_flagged_and_a_decaying_healthy_one_is_not():
    shrinking = [{"step": s, "grad_norm": 1.0 * 0.95**s} for s in range(1, 80)]  # 0.2 of its start near step 33
    (episode,) = [e for e in assess(shrinking).episodes if e.name == "vanishing_gradient"]
    assert 33 <= episode.start <= 40 and "19.4% of its start (0.857)" in episode.message
    healthy = [{"step": s, "grad_norm": 0.55 * (0.6 + 0.4 * 0.99**s)} for s in range(1, 400)]  # to 60% of start
    assert "vanishing_gradient" not in assess(healthy).alarms
    zero = [{"step": s, "grad_norm": 0.0 if s > 5 else 1.0} for s in range(1, 20)]  # exactly 0: no_gradient's
    assert "vanishing_gradient" not in assess(zero).alarms and "no_gradient" in assess(zero).alarms


def test_clipping_on_one_side_is_flagged_naming_the_side_and_even_clipping_is_not():
    def clipped(low, high, steps=10):
        return [{"step": s, "clip_ratio/low_mean": low, "clip_ratio/high_mean": high} for s in range(1, steps + 1)]

    (low,) = [e for e in assess(clipped(0.15, 0.03)).episodes if e.name == "clip_asymmetry"]
    assert low.start == 5 and "clip_ratio/low_mean 0.15 against high_mean 0.03" in low.message
    (high,) = [e for e in assess(clipped(0.0, 0.08)).episodes if e.name == "clip_asymmetry"]
    assert "epsilon_high (clip-higher" in high.message
    assert "clip_asymmetry" not in assess(clipped(0.05, 0.04)).alarms  # even
    assert "clip_asymmetry" not in assess(clipped(0.03, 0.0)).alarms  # lopsided, but too little clipped to matter


def test_a_reward_that_gives_back_its_gain_is_a_drop_and_one_that_rises_or_holds_is_not():
    def curve(step):  # learns to 0.6 by step 100, then collapses back towards 0.25 by step 200
        return 0.2 + 0.4 * min(step, 100) / 100 - (0.35 * min(step - 100, 100) / 100 if step > 100 else 0.0)

    for seed in range(5):
        (episode,) = [e for e in assess(noisy_run(curve, steps=250, seed=seed)).episodes if e.name == "reward_drop"]
        assert 130 <= episode.start <= 175 and "giving back" in episode.message
        holds = noisy_run(lambda step: 0.2 + 0.4 * min(step, 100) / 100, steps=250, seed=seed)
        flat = noisy_run(lambda step: 0.3, steps=250, seed=seed)
        rising = noisy_run(lambda step: 0.2 + step / 3000, seed=seed)
        for history in (holds, flat, rising):
            assert "reward_drop" not in assess(history).alarms
