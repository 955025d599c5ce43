"""The length alarms (`guardrails/alarms/length.py`): truncation sustained over steps, a length that follows the reward
or grows over the run, the batch that trains under dynamic sampling, a length correlation inside groups."""

import pytest
from helpers import fired_at, monitor_of, train_logs

from trl_grpo_ext.tools.report.health import assess


def test_sustained_truncation_is_a_note_from_5_percent_and_a_warning_from_15_percent():
    stream = [{"completions/clipped_ratio": v} for v in [0.06] * 5 + [0.2] * 5 + [0.01] + [0.3] * 5]
    _, messages, monitor = fired_at(stream, "truncation_sustained")
    assert [episode.severity for episode in monitor.episodes] == ["note", "warning", "warning"]
    assert "6% or more of completions (6% now) reached max_completion_length" in messages[0]
    assert "at each of the last 5 log steps (note; a warning from 15%)" in messages[0]
    assert "(warning: 15% or more)" in messages[1] and "Raise max_completion_length" in messages[1]
    assert "truncation" not in monitor.counts  # the alarm at once waits for half the completions


def test_sustained_truncation_waits_for_5_log_steps_in_a_row():
    """One batch with a few long completions, or 4 steps in a row, is no trend; the demo's share (at most 1.9%,
    logged every 10 steps over 400) is none either."""
    noisy = [{"completions/clipped_ratio": 0.4 if i % 4 == 0 else 0.01} for i in range(20)]
    short = [{"completions/clipped_ratio": 0.3}] * 4 + [{"completions/clipped_ratio": 0.0}]
    demo = [{"completions/clipped_ratio": 0.0125 - 0.011 * (i % 2)} for i in range(40)]
    for stream in (noisy, short, demo):
        assert fired_at(stream, "truncation_sustained")[0] == []


def test_length_drift_needs_a_rising_reward_and_a_real_change():
    falling_reward = [{"reward": 1.0 - 0.1 * i, "completions/mean_length": 10.0 + 2 * i} for i in range(8)]
    small_change = [{"reward": 0.1 * i, "completions/mean_length": 10.0 + 0.1 * i} for i in range(8)]
    assert fired_at(falling_reward, "length_drift")[0] == []
    assert fired_at(small_change, "length_drift")[0] == []


def slow_length_growth(steps: int = 60, start: float = 203.0, end: float = 707.0) -> list[dict]:
    """A run whose mean completion length grows steadily from `start` to `end` tokens while the reward rises, with
    a little noise at every log step: each 10-step window moves too little for `length_drift`."""
    return [
        {
            "loss": 0.0,
            "reward": 0.2 + 0.5 * i / (steps - 1) + 0.05 * (-1) ** i,
            "completions/mean_length": start + (end - start) * i / (steps - 1) + 15.0 * (-1) ** (i // 2),
            "step": 10 * (i + 1),
        }
        for i in range(steps)
    ]


def test_slow_length_growth_over_the_run_raises_length_growth_where_length_drift_sees_nothing():
    history = slow_length_growth()
    assert fired_at(history, "length_drift")[0] == []  # the 10-step window's gap
    indices, messages, _ = fired_at(history, "length_growth")
    # The median of the last 5 lengths first exceeds the median of the first 5 (218 tokens) by half at index 17.
    assert indices == [17]
    assert "completion length grew from 218 to 329 tokens (+51%) since the start of the run" in messages[0]
    assert "[alarms/length_growth; alarm_thresholds['length_growth']=0.5, None switches it off]" in messages[0]
    health = assess(history)
    (length,) = [signal for signal in health.signals if signal.signal.name == "completion length"]
    assert length.verdict == "ALARM" and length.onset == 180 and length.severity == "warning"
    assert "length_growth at steps 180-600" in length.detail and not health.ok


def test_a_length_steady_around_its_start_raises_no_length_growth():
    """The demo's lengths (5.6 to 6.1 tokens, logged every 10 steps over 400) and a run whose length falls."""
    demo = [{"loss": 0.0, "completions/mean_length": 5.8 + 0.3 * (-1) ** i, "step": 10 * i} for i in range(1, 41)]
    shrinking = [{"loss": 0.0, "completions/mean_length": 400.0 - 5 * i, "step": i} for i in range(1, 41)]
    for history in (demo, shrinking):
        assert fired_at(history, "length_growth")[0] == []
        (length,) = [signal for signal in assess(history).signals if signal.signal.name == "completion length"]
        assert length.verdict == "ok" and "length_growth" in length.detail


def test_under_dynamic_sampling_the_length_alarms_read_the_batch_that_trains():
    """`completions/*` count every generated round, `reward` is the trained batch's: the rules pair the reward with
    the trained batch's length and truncation."""
    drifting = [
        {"reward": 0.1 * i, "completions/mean_length": 10.0, "dynamic_sampling/trained_mean_length": 10.0 + 3 * i}
        for i in range(8)
    ]
    assert fired_at(drifting, "length_drift")[0] == [5]
    steady = [
        {**entry, "completions/mean_length": entry["dynamic_sampling/trained_mean_length"]} for entry in drifting
    ]
    steady = [{**entry, "dynamic_sampling/trained_mean_length": 10.0} for entry in steady]
    assert fired_at(steady, "length_drift")[0] == []
    flat = {"reward_std/frac_zero_groups": 1.0, "completions/clipped_ratio": 0.1}
    _, messages, _ = fired_at([{**flat, "dynamic_sampling/trained_clipped_ratio": 1.0}] * 3, "no_spread")
    assert "Truncation is the likely cause: 100%" in messages[0]


def length_where_it_varies(prompts, completion_ids, **kwargs):
    """Constant on half the prompts (flat groups); elsewhere exactly the completion length."""
    constant = {"xyz=", "qq="}
    return [1.0 if p in constant else float(len(ids)) for p, ids in zip(prompts, completion_ids, strict=True)]


def test_the_length_alarm_fires_however_many_groups_are_flat(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    entries, trainer = train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=length_where_it_varies,
        max_completion_length=16,
        per_device_train_batch_size=16,  # 4 groups a step, half of them flat
    )
    correlations = [entry.get("reward_length_corr/within_group") for entry in entries]
    assert any(entry["reward_std/frac_zero_groups"] >= 0.5 for entry in entries)
    assert all(value == pytest.approx(1.0) for value in correlations if value is not None) and any(correlations)
    assert monitor_of(trainer).counts["length_in_group"] == 1
