"""The reward make-up alarms (`guardrails/alarms/rewards.py`): an auxiliary reward function that takes over the
reward's variation, how auxiliary functions are told, a reward whose scale jumps."""

import math
import random

import pytest
from helpers import resumed_at

from trl_grpo_ext.guardrails import ALARMS, AnomalyMonitor
from trl_grpo_ext.metrics import reward_function_metric
from trl_grpo_ext.tools.report.health import assess


def composed_run(format_curve, task_curve, steps: int = 400, samples: int = 128, seed: int = 0, **functions):
    """One log entry per step: the per-step means of 0/1 scores of `samples` completions, a format reward scored with
    probability `format_curve(step)` and a task reward with `task_curve(step)` (`functions`: other names -> curves)."""
    rng = random.Random(seed)
    curves = {"format": format_curve, "correctness": task_curve, **functions}
    return [
        {
            "step": step,
            "loss": 0.1,
            **{
                reward_function_metric(name): sum(rng.random() < curve(step) for _ in range(samples)) / samples
                for name, curve in curves.items()
                if curve is not None
            },
        }
        for step in range(1, steps + 1)
    ]


def saturating(steps: int, top: float = 0.98):
    """A format reward learned from 0.05 to `top` over its first `steps` steps, then held."""
    return lambda step: min(top, 0.05 + (top - 0.05) * step / steps)


def test_a_format_reward_that_takes_over_is_flagged_and_one_that_saturates_early_is_not():
    def stalled(step):  # the task learned to 0.4 by step 150, then stalled
        return 0.1 + 0.3 * min(step, 150) / 150

    def gaming(step):  # the format reward at 0.2 until step 200, then rising to 1.0 by step 350
        return min(1.0, 0.2 + 0.8 * max(step - 200, 0) / 150)

    for seed in range(5):
        takeover = composed_run(gaming, stalled, seed=seed)
        # until the format reward holds at 1.0: then it no longer varies
        episode, *_ = [e for e in assess(takeover).episodes if e.name == "reward_composition"]
        assert 250 <= episode.start <= 330 and episode.end <= 400, episode
        assert "the auxiliary reward function format carries" in episode.message
        assert (
            "[alarms/reward_composition; alarm_thresholds['reward_composition']=0.8, None switches it off]"
            in episode.message
        )
        # the task scores near 0 throughout, the format reward is learned to 0.85 (a mean of 0/1 scores near 0.02
        # and one near 0.98 are as noisy: then the share is about 0.5)
        dominated = composed_run(saturating(60, 0.85), lambda step: 0.02, seed=seed)
        # from its 150th entry (the share near 0.85 may dip below 0.8 and end an episode for a while)
        assert [e.start for e in assess(dominated).episodes if e.name == "reward_composition"][0] == 150
        healthy = {
            "saturated by step 60": composed_run(saturating(60), lambda step: 0.2 + 0.4 * step / 400, seed=seed),
            "saturated by step 100": composed_run(saturating(100), lambda step: 0.1 + 0.2 * step / 400, seed=seed),
            "both rising": composed_run(lambda step: 0.1 + 0.2 * step / 400, lambda step: 0.2 + 0.4 * step / 400),
        }
        for name, history in healthy.items():
            assert "reward_composition" not in assess(history).alarms, (name, seed)


def test_reward_composition_needs_an_auxiliary_and_a_task_function():
    near_zero = lambda step: 0.02  # noqa: E731
    runs = {
        "one function": composed_run(saturating(60), None),
        "none auxiliary": composed_run(None, near_zero, answer=saturating(60)),
        "all auxiliary": composed_run(saturating(60), None, xml_tags=near_zero),
    }
    for name, history in runs.items():
        assert "reward_composition" not in assess(history).alarms, name
    # a threshold of 1 asks the auxiliary functions for all of the variation
    monitor = AnomalyMonitor({"reward_composition": 1.0})
    monitor.replay(composed_run(saturating(60, 0.85), near_zero))
    assert "reward_composition" not in monitor.counts


def test_reward_composition_carries_its_windows_across_a_resume_and_none_switches_it_off():
    history = composed_run(saturating(60, 0.85), lambda step: 0.02)
    whole = AnomalyMonitor()
    whole.replay(history)
    assert [e.start for e in whole.episodes if e.name == "reward_composition"][0] == 150
    for cut in (100, 149, 155):  # before the rule is judged, the entry before its onset, in its episode
        given = len([e for e in whole.episodes if e.name == "reward_composition" and e.start > cut])
        assert resumed_at(history, cut, whole, "reward_composition") == given
    off = AnomalyMonitor({"reward_composition": None})
    off.replay(history)
    assert "reward_composition" not in off.counts and "reward_composition" not in [rule.name for rule in off.rules]


def test_a_reward_function_mean_that_is_not_a_number_is_skipped_by_reward_composition():
    clean, gappy = (ALARMS["reward_composition"]("reward_composition", 0.8) for _ in range(2))
    task = reward_function_metric("correctness")
    for entry in composed_run(saturating(60, 0.85), lambda step: 0.02, steps=200):
        for skipped in ({reward_function_metric("format"): math.nan, task: math.nan}, {task: None}, {"loss": 0.1}):
            assert gappy.judge(skipped) is None
        gappy.judge({**entry, task: math.inf})  # the format's mean still counts
        clean.judge(entry)
    assert gappy.means["format"] == clean.means["format"] and "correctness" not in gappy.means


def test_auxiliary_reward_functions_are_told_by_whole_words_of_their_names():
    from trl_grpo_ext.guardrails.alarms.rewards import is_auxiliary

    auxiliary = ["format_reward", "soft_format_reward_func", "xmlcount_reward_func", "XMLTagReward", "thinkLength"]
    auxiliary += ["language_consistency", "reward-len-2", "json_schema", "tags", "formatting_bonus", "style"]
    task = ["information_gain", "stage_bonus", "percentage_correct", "accuracy", "correctness_reward_func"]
    task += ["voltage_error", "contagious", "sql_exec", "slang_judge", "platform_success"]
    assert [name for name in auxiliary if not is_auxiliary(name)] == []
    assert [name for name in task if is_auxiliary(name)] == []


def gaming(step):  # the format reward at 0.2 until step 200, then rising to 1.0 by step 350
    return min(1.0, 0.2 + 0.8 * max(step - 200, 0) / 150)


def stalled(step):  # the task learned to 0.4 by step 150, then stalled
    return 0.1 + 0.3 * min(step, 150) / 150


def test_a_task_reward_whose_name_contains_a_hint_is_not_taken_for_an_auxiliary_one():
    # `information` holds "format": with both functions taken as auxiliary the alarm could never fire
    history = composed_run(gaming, None, information_gain=stalled)
    assert "reward_composition" in assess(history).alarms


def test_the_auxiliary_reward_functions_can_be_named():
    history = composed_run(None, stalled, brevity=gaming)  # `brevity` carries no hint in its name
    assert "reward_composition" not in assess(history).alarms
    named = AnomalyMonitor(auxiliary_rewards=["brevity"])
    named.replay(history)
    (episode, *_) = [e for e in named.episodes if e.name == "reward_composition"]
    assert "the auxiliary reward function brevity carries" in episode.message
    # named, they replace the names' words: none named, none auxiliary, `format` included
    monitor = AnomalyMonitor(auxiliary_rewards=[])
    monitor.replay(composed_run(gaming, stalled))
    assert "reward_composition" not in monitor.counts
    with pytest.raises(TypeError, match="auxiliary_rewards must be a list of reward function names"):
        AnomalyMonitor(auxiliary_rewards=[1, 2])


def scale_jump_run(jump_at: int = 110, steps: int = 200, seed: int = 0) -> list[dict]:
    """rlwatch's reward-variance explosion as TRL logs it: the reward's spread near 0.5, then tenfold from `jump_at` on
    and staying there (a reward function whose scale changed)."""
    rng = random.Random(seed)
    return [
        {
            "step": step,
            "loss": 0.1,
            "reward_std": (5.0 + abs(rng.gauss(0, 0.5))) if step >= jump_at else (0.5 + abs(rng.gauss(0, 0.02))),
        }
        for step in range(1, steps + 1)
    ]


def learning_spread_run(start: float, speed: int, steps: int = 400, seed: int = 0) -> list[dict]:
    """A 0/1 reward learned from a pass rate `start` to 0.6 along a logistic curve centred on step 150 (`speed` steps
    from about 12% to 88% of the way), 16 groups of 8 completions per step: the mean std inside the groups."""
    rng = random.Random(seed)
    history = []
    for step in range(1, steps + 1):
        rate = start + (0.6 - start) / (1 + math.exp(-4 * (step - 150) / speed))
        stds = []
        for _ in range(16):
            scores = [float(rng.random() < rate) for _ in range(8)]
            centre = sum(scores) / 8
            stds.append(math.sqrt(sum((s - centre) ** 2 for s in scores) / 7))
        history.append({"step": step, "loss": 0.1, "reward_std/group_mean": sum(stds) / 16})
    return history


def test_a_reward_whose_spread_jumps_tenfold_is_flagged_within_a_few_log_steps():
    from benchmarks.health_scenarios import logged_every as every

    for seed in range(5):
        health = assess(scale_jump_run(seed=seed))
        (episode,) = [e for e in health.episodes if e.name == "reward_scale"]
        assert 110 <= episode.start <= 112 and "reward_std jumped from" in episode.message, episode
        spread = next(signal for signal in health.signals if signal.signal.name == "reward spread in groups")
        assert spread.verdict == "ALARM" and "reward_scale at" in spread.detail
        # logged every 10 steps: the first entry holding the jump
        (episode,) = [e for e in assess(every(scale_jump_run(seed=seed), 10)).episodes if e.name == "reward_scale"]
        assert episode.start == 120, episode


def test_the_slow_growth_of_a_learned_0_1_reward_s_spread_is_no_jump():
    from benchmarks.health_scenarios import logged_every as every

    for start in (0.005, 0.02, 0.05):
        for speed in (20, 50, 100):
            for seed in range(3):
                history = learning_spread_run(start, speed, seed=seed)
                for steps in (1, 10):
                    alarms = assess(every(history, steps)).alarms
                    assert "reward_scale" not in alarms, (start, speed, seed, steps)
    monitor = AnomalyMonitor({"reward_scale": None})
    monitor.replay(scale_jump_run())
    assert "reward_scale" not in monitor.counts
