"""The reward-spread alarms (`guardrails/alarms/spread.py`): groups without spread, whether truncation is the cause,
groups flat at every step (too easy or too hard), completions no reward function scored."""

from helpers import fired_at, monitor_of, train_logs

from trl_grpo_ext.guardrails import AnomalyMonitor
from trl_grpo_ext.tools.report.health import assess


def test_no_spread_says_whether_truncation_is_the_cause():
    def message(clipped):
        extra = {} if clipped is None else {"completions/clipped_ratio": clipped}
        return fired_at([{"frac_reward_zero_std": 1.0, **extra}] * 3, "no_spread")[1][0]

    assert "Truncation is the likely cause" in message(0.97) and "max_completion_length" in message(0.97)
    assert "Truncation is not the cause (10% of completions were cut)" in message(0.1)
    assert "Whether truncation is the cause is unknown" in message(None)


def test_the_spread_alarms_judge_the_groups_when_the_package_logs_them():
    """Under scale_rewards="batch" TRL's frac_reward_zero_std tests the batch's std: 0 for flat groups."""
    entry = {"frac_reward_zero_std": 0.0, "reward_std/frac_zero_groups": 1.0}
    assert fired_at([entry], "zero_std")[0] == [0]
    assert fired_at([entry] * 3, "no_spread")[0] == [2]
    assert fired_at([{"frac_reward_zero_std": 1.0}] * 3, "no_spread")[0] == [2]  # a stock TRL history


def test_unscored_waits_for_a_function_silent_over_a_window_while_every_completion_is_scored():
    nan = float("nan")
    # Two tasks, each function None on the other's prompts: a step whose batch held only one task's prompts.
    multitask = [
        {"rewards/math/mean": nan if step % 3 == 0 else 0.5, "rewards/code/mean": 0.2 if step % 3 else nan}
        for step in range(30)
    ]
    multitask = [{**entry, "frac_reward_unscored": 0.0} for entry in multitask]
    assert fired_at(multitask, "unscored")[0] == []
    silent = [{"rewards/format/mean": 1.0, "rewards/parse/mean": nan, "frac_reward_unscored": 0.0}] * 12
    indices, messages, _ = fired_at(silent, "unscored")
    assert indices == [9]  # the 10th log step in a row without a score
    assert "reward function 'parse' scored no completion for 10 log steps in a row" in messages[0]
    unscored = [{"rewards/parse/mean": nan, "frac_reward_unscored": 1.0}]  # scored by no function at all: at once
    assert "'parse' scored no completion of this step" in fired_at(unscored, "unscored")[1][0]


def math_only(prompts, completions, **kwargs):
    return [float(len(c)) if p == "abc=" else None for p, c in zip(prompts, completions, strict=True)]


def words_only(prompts, completions, **kwargs):
    return [float(c.count("a")) if p != "abc=" else None for p, c in zip(prompts, completions, strict=True)]


def test_a_healthy_multi_task_run_raises_no_unscored_alarm(tiny_model_path, tiny_tokenizer, tmp_path):
    """One prompt per step, the tasks taking turns: each function scores nothing at every other step, while every
    completion is scored."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ["abc=", "xyz="] * 4})
    entries, trainer = train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        dataset,
        reward_funcs=[math_only, words_only],
        shuffle_dataset=False,
        max_steps=6,
    )
    assert all(entry["frac_reward_unscored"] == 0.0 for entry in entries)
    assert any(entry["rewards/math_only/mean"] is None for entry in entries)  # silent at some steps
    assert "unscored" not in monitor_of(trainer).counts
    assert "unscored" not in assess(trainer.state.log_history, AnomalyMonitor.from_config(trainer.args)).alarms


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
