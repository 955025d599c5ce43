"""The progress alarms (`guardrails/alarms/progress.py`): a reward that stops improving (a plateau, whether logged
every 1, 10 or 50 steps) or gives back its gain, and a held-out metric that falls beyond its evaluation's noise
while the reward rises."""

import random

import pytest
from helpers import noisy_run

from trl_grpo_ext.guardrails import AnomalyMonitor
from trl_grpo_ext.tools.report.health import assess


def heldout_run(heldout: list[float], size: int | None, rewards: list[float] | None = None) -> list[dict]:
    """A run evaluated every 50 steps: the training reward (rising by default) and, where `size` is given, the
    number of completions behind each held-out mean (`heldout/acc/scored@1`)."""
    rewards = rewards or [0.1 + 0.05 * index for index in range(len(heldout))]
    entries = []
    for index, (value, reward) in enumerate(zip(heldout, rewards, strict=True)):
        entry = {"loss": 0.1, "step": 50 * index, "reward": reward, "grad_norm": 1.0, "heldout/acc/mean@1": value}
        if size is not None:
            entry["heldout/acc/scored@1"] = size
        entries.append(entry)
    return entries


#: Held-out accuracies of rising runs that raised reward_vs_heldout on their evaluation's noise, with the number of
#: completions each evaluation scored: GSM8K recipes (200 test prompts), the demo (eval_samples 50).
NOISY_HELDOUT = {
    "best 0.214 -> 0.183 over 200": ([0.15, 0.214, 0.2, 0.183, 0.205], 200),
    "best 0.19 -> 0.154 over 200": ([0.12, 0.17, 0.19, 0.154, 0.18], 200),
    "demo over 50": ([0.2, 0.26, 0.3, 0.34, 0.26, 0.3], 50),
}


@pytest.mark.parametrize("scenario", NOISY_HELDOUT)
def test_a_held_out_drop_within_the_evaluation_s_noise_raises_no_alarm(scenario):
    values, size = NOISY_HELDOUT[scenario]
    monitor = AnomalyMonitor()
    monitor.replay(heldout_run(values, size))
    assert "reward_vs_heldout" in monitor.judged and not monitor.episodes
    assert assess(heldout_run(values, size)).signals[-1].verdict == "ok"
    # Without the sample size (a stock or older run's log) the series' own spread is the noise: no alarm either.
    monitor.replay(heldout_run(values, None))
    assert not monitor.episodes


def test_without_a_sample_size_the_held_out_series_own_spread_is_the_noise():
    # the drop of rl-doctor's healthy run (0.214 -> 0.183 at its 5th evaluation): too few evaluations to know the
    # noise yet, not judged; the same drop after steady evaluations whose differences scatter by 0.01: an alarm
    early = heldout_run([0.151, 0.176, 0.197, 0.214, 0.183], None)
    assert not assess(early).episodes and "reward_vs_heldout" not in AnomalyMonitor().judged
    steady = [0.10, 0.13, 0.15, 0.19, 0.21, 0.24, 0.26, 0.30, 0.18]
    (episode,) = assess(heldout_run(steady, None)).episodes
    assert episode.start == 400 and "more than the evaluation's noise (3 standard deviations" in episode.message
    noisy = [0.10, 0.18, 0.12, 0.22, 0.16, 0.26, 0.20, 0.30, 0.22]  # the same drop within its own scatter
    assert not assess(heldout_run(noisy, None)).episodes


def test_a_held_out_drop_beyond_the_evaluation_s_noise_raises_the_alarm_live_and_in_the_report():
    history = heldout_run([0.5, 0.6, 0.3], 200)  # 0.3 below the best: 6.3 standard errors of the difference
    monitor = AnomalyMonitor()
    started = [message for entry in history for message in monitor.check(entry, warn=False)]
    assert len(started) == 1 and "heldout/acc/mean@1 fell from its best 0.6 (step 50) to 0.3" in started[0]
    assert "more than the evaluation's noise (3 standard errors: 0.142)" in started[0]
    held_out = assess(history).signals[-1]
    assert held_out.verdict == "ALARM" and "reward_vs_heldout at step 100" in held_out.detail


def test_the_noise_allowance_is_3_standard_errors_of_the_difference():
    # 0.6 -> 0.45 over 200 completions each: se = sqrt(0.6 * 0.4 / 200 + 0.45 * 0.55 / 200) = 0.0494; 0.15 = 3.04 se
    assert [e.name for e in assess(heldout_run([0.6, 0.45], 200)).episodes] == ["reward_vs_heldout"]
    assert not assess(heldout_run([0.6, 0.46], 200)).episodes  # 2.83 se
    evaluations = [
        {key.replace("heldout/", "eval_heldout/"): v for key, v in e.items()} for e in heldout_run([0.6, 0.46], 200)
    ]
    assert not assess(evaluations).episodes  # an evaluate()'s entry: its eval_heldout/acc/scored@1 is read alike
    # A metric on another scale than [0, 1] has no binomial noise: its series' own spread is its noise.
    assert [e.name for e in assess(heldout_run([6.0, 6.2, 6.1, 6.3, 6.2, 6.25, 4.0], 200)).episodes] == [
        "reward_vs_heldout"
    ]
    assert not assess(heldout_run([6.0, 4.0], 200)).episodes  # two evaluations: no noise known yet


def test_a_run_that_learns_nothing_is_never_ok_however_noisy_its_held_out_metric():
    history = heldout_run([0.2, 0.22, 0.19, 0.21, 0.2], 50, rewards=[0.3] * 5)
    for entry in history:
        entry.update({"grad_norm": 0.0, "reward_std/frac_zero_groups": 1.0})
    health = assess(history)
    assert not health.ok and {"no_spread", "no_gradient"} <= set(health.alarms)


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
    monitor = AnomalyMonitor({"plateau": 20})
    monitor.replay(history)
    assert [e.name for e in monitor.episodes] == ["plateau"] and monitor.episodes[0].start <= 40
    monitor = AnomalyMonitor({"plateau": None})
    monitor.replay(noisy_run(lambda step: 0.3))
    assert "plateau" not in monitor.counts


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


def logged_every(interval: int, curve, steps: int = 400, noise: float = 0.03, seed: int = 0) -> list[dict]:
    """A run logged every `interval` steps as TRL logs it: each entry holds the mean of its `interval` steps' values
    (`curve(step)` plus normal noise), at the step it ends."""
    rng = random.Random(seed)
    history = []
    for end in range(interval, steps + 1, interval):
        rewards = [curve(step) + rng.gauss(0, noise) for step in range(end - interval + 1, end + 1)]
        history.append({"step": end, "loss": 0.1, "grad_norm": 1.0, "reward": sum(rewards) / interval})
    return history


def test_a_reward_that_never_improves_is_a_plateau_whether_logged_every_1_10_or_50_steps():
    # 400 steps: 400 or 40 log entries (800 steps logged every 50: 16); the plateau's length (its threshold, 150)
    # counts training steps
    for interval, steps in ((1, 400), (10, 400), (50, 800)):
        for seed in range(5):
            health = assess(logged_every(interval, lambda step: 0.3, steps=steps, seed=seed))
            assert "plateau" in health.alarms and not health.ok, (interval, seed)
            (episode, *_) = [e for e in health.episodes if e.name == "plateau"]
            assert episode.start <= steps and "has not improved for" in episode.message
    # 400 steps logged every 50 are 8 entries: too short to tell, never "ok"
    for seed in range(5):
        health = assess(logged_every(50, lambda step: 0.3, seed=seed))
        assert health.signals[0].verdict == "short" and not health.ok


def test_a_reward_that_rises_is_no_plateau_whether_logged_every_1_10_or_50_steps():
    for interval in (1, 10, 50):
        for seed in range(5):
            health = assess(logged_every(interval, lambda step: 0.2 + step / 1000, steps=800, seed=seed))
            reward = health.signals[0]
            assert "plateau" not in health.alarms and reward.verdict == "ok", (interval, seed, reward)
            assert "no alarm (plateau" in reward.detail


def test_a_run_too_short_to_judge_says_so_and_is_not_ok():
    # the README's example: 10 steps logged every 5, a reward that moves a little, a KL of 1e-9
    history = [
        {"step": step, "loss": 0.0, "grad_norm": 0.5, "reward": reward, "kl": 1e-9, "entropy": 1.2}
        for step, reward in ((5, -2.1), (10, -1.9))
    ]
    health = assess(history)
    reward = health.signals[0]
    assert reward.verdict == "short" and reward.detail.startswith("too short to judge")
    assert reward.severity == "note" and not health.ok
    # a flat reward over 100 steps is not long enough for a plateau of 150, and learned nothing: not ok either
    flat = assess(logged_every(1, lambda step: 0.3, steps=100))
    assert flat.signals[0].verdict == "short" and not flat.ok
