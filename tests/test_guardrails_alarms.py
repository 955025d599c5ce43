"""The alarms: each on a synthetic log stream (fires, once per episode, clears, fires again) and on real tiny runs;
their counts in the logs, their thresholds in the config, the same verdicts live and replayed."""

import re

import pytest
from helpers import count_a_reward, tiny_grpo_args, train_logs, training_entries
from transformers import TrainerControl, TrainerState, TrainingArguments
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.guardrails import ALARMS, AlarmSettings, AnomalyMonitor
from trl_grpo_ext.guardrails.alarms import DEFAULTS, FAMILIES, ORDER, RENAMED, build_rules
from trl_grpo_ext.guardrails.alarms.rule import pearson
from trl_grpo_ext.metrics import reward_function_metric
from trl_grpo_ext.tools.report.health import assess


def fired_at(stream, name, thresholds=None, **settings):
    """The indices of the entries of `stream` at which the alarm `name` was given, and the warnings."""
    monitor = AnomalyMonitor(thresholds, **settings)
    indices, messages = [], []
    for index, entry in enumerate(stream):
        started = [message for message in monitor.check(entry, step=index, warn=False) if f"alarms/{name};" in message]
        if started:
            indices.append(index)
            messages += started
    return indices, messages, monitor


def rising_length(start, count, reward_from=0.0):
    """Log entries whose reward and mean completion length rise together."""
    return [{"reward": reward_from + 0.1 * i, "completions/mean_length": 10.0 + 2 * (start + i)} for i in range(count)]


#: Two reward functions' means: an auxiliary one (by its name) and the task's.
FORMAT, TASK = reward_function_metric("format"), reward_function_metric("correctness")

# alarm -> (stream, indices where it is given). Each stream: the condition starts, lasts (given once), clears for
# at least one entry (or an entry without the metric, which neither clears nor continues it), starts again.
STREAMS = {
    "zero_std": (
        [{"frac_reward_zero_std": 0.95}, {"frac_reward_zero_std": 0.97}, {}, {"frac_reward_zero_std": 0.2}]
        + [{"frac_reward_zero_std": 0.92}],
        [0, 4],
    ),
    "no_spread": (
        [{"frac_reward_zero_std": v, "completions/clipped_ratio": 1.0} for v in (1, 1, 1, 1, 0.5, 1, 1, 1)],
        [2, 7],
    ),
    "truncation": ([{"completions/clipped_ratio": v} for v in (0.6, 0.9, 0.1, 0.7)], [0, 3]),
    "truncation_sustained": (
        # 6% for 5 log steps (a note), 20% for 5 more (risen to a warning: a new episode), cleared, 30% for 5
        [{"completions/clipped_ratio": v} for v in [0.06] * 5 + [0.2] * 5 + [0.01] + [0.3] * 5],
        [4, 9, 15],
    ),
    "unscored": (
        [
            {"rewards/parse/mean": float("nan"), "frac_reward_unscored": 1.0},  # the function scored nothing
            {"rewards/parse/mean": float("nan"), "frac_reward_unscored": 1.0},
            {"rewards/parse/mean": 0.4, "frac_reward_unscored": 0.1},
            {"rewards/parse/mean": 0.4, "frac_reward_unscored": 0.7},  # most completions scored by no function
        ],
        [0, 3],
    ),
    "no_gradient": ([{"grad_norm": v} for v in (0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0)], [2, 7]),
    "clip_fraction": ([{"clip_ratio/region_mean": v} for v in (0.3, 0.3, 0.3, 0.3, 0.1, 0.3, 0.3, 0.3)], [2, 7]),
    "ratio_p95": ([{"ratio/p95": v} for v in (2.0, 2.0, 1.1, float("inf"))], [0, 3]),
    "ratio_max": ([{"ratio/max": v} for v in (500.0, 500.0, 2.0, float("nan"))], [0, 3]),
    "kl_jump": ([{"kl": v} for v in (0.01, 0.01, 0.01, 0.01, 0.01, 0.5, 0.6, 0.01, 0.5)], [5, 8]),
    "kl_high": ([{"kl": v} for v in (6.7, 3.1, 0.4, {}, 1.5, float("nan"))], [0, 4]),
    "kl_growth": (
        # judged from the 70th value: the median of the last 20 against those 50 and 25 entries earlier (0.05). It is
        # 0.125 once ten values of 0.2 are in (index 70), 0.05 again once ten values of 0.05 follow (cleared at index
        # 90), 0.175 once ten values of 0.3 are in (index 149, where the 0.2s are out of the earlier medians)
        [{"kl": v} for v in [0.05] * 61 + [0.2] * 19 + [0.05] * 60 + [0.3] * 10],
        [70, 149],
    ),
    "entropy_collapse": ([{"entropy": v} for v in (2.0, 2.0, 2.0, 1.5, 0.1, 0.1, 1.0, 0.1)], [4, 7]),
    "grad_norm_spike": ([{"grad_norm": v} for v in (1.0, 1.0, 1.0, 1.0, 1.0, 50.0, 60.0, 1.0, 50.0)], [5, 8]),
    "length_drift": (
        # rises for 8 entries (judged from the 6th), then the length settles while the reward stays: it clears
        rising_length(0, 8)
        + [{"reward": 0.7, "completions/mean_length": 24.0} for _ in range(10)]
        + rising_length(8, 8, reward_from=0.8),
        [5, 22],
    ),
    "length_growth": (
        # the first 5 lengths are the start (10); the median of the last 5 is 50% above it from the 10th entry (the
        # first judged), falls back to 10, and rises again
        [{"completions/mean_length": v} for v in [10.0] * 5 + [12, 14, 16, 18, 20, 22, 24, 10, 10, 10, 30, 30, 30]],
        [9, 17],
    ),
    "length_in_group": ([{"reward_length_corr/within_group": v} for v in (0.9, 0.95, 0.1, 0.85)], [0, 3]),
    "vanishing_gradient": (
        # a start of 1.0; the median of the last 5 falls below 0.2 at the 3rd small value, rises (cleared), falls again
        [{"grad_norm": v} for v in [1.0] * 5 + [0.1] * 4 + [1.0] * 3 + [0.05] * 3],
        [7, 14],
    ),
    "clip_asymmetry": (
        # 4x more clipped below than above for 5 log steps (given at the 5th), even (cleared), 5 more lopsided ones
        [{"clip_ratio/low_mean": lo, "clip_ratio/high_mean": 0.02} for lo in [0.08] * 6 + [0.02] + [0.1] * 5],
        [4, 11],
    ),
    "flat_groups": (
        # 70% of groups flat for 10 log steps (given at the 10th), one entry at 20% (cleared), 10 more at 65%
        [{"frac_reward_zero_std": v} for v in [0.7] * 12 + [0.2] + [0.65] * 10],
        [9, 22],
    ),
    "plateau": (
        # 10 rising rewards, then flat: the running median's last new best is at index 14, the 150th entry without
        # one gives it; a jump to 5.0 sets new bests (cleared) until the median is 5.0 (index 170), and the 150th
        # entry after that without one gives it again
        [{"reward": 0.1 * i} for i in range(10)] + [{"reward": 0.9}] * 155 + [{"reward": 5.0}] * 156,
        [164, 320],
    ),
    "reward_drop": (
        # 0 to 1 over 21 entries, then 0.3 (given once the running median of 10 is 0.3: half the gain lost), back
        # up to 1 (cleared), down to 0 (given once the median is 0.5: half the gain from 0.225 to 1.0 lost)
        [{"reward": v} for v in [0.05 * i for i in range(21)] + [0.3] * 8 + [1.0] * 8 + [0.0] * 8],
        [26, 41],
    ),
    "reward_composition": (
        # a format reward cycling 0.2, 0.5, 0.8 (spread 0.3) and a constant task reward: the format's share is 1 from
        # the 150th entry; the task's cycling 0, 0.5, 1 for 40 entries clears it once most of the last 37 task
        # values are off their median (index 177), and 10 constant ones after it give it again (index 199)
        [{FORMAT: (0.2, 0.5, 0.8)[i % 3], TASK: 0.5} for i in range(150)]
        + [{FORMAT: (0.2, 0.5, 0.8)[i % 3], TASK: (0.0, 0.5, 1.0)[i % 3]} for i in range(40)]
        + [{FORMAT: (0.2, 0.5, 0.8)[i % 3], TASK: 0.5} for i in range(20)],
        [149, 199],
    ),
    "reward_scale": (
        # a steady spread of 0.5 for 20 entries, then tenfold: given once the last 3 entries' median is 5.0 (the 20
        # entries before it steady); back to 0.5, the history steady again after 20 entries, then tenfold again
        [{"reward_std": value} for value in [0.5] * 20 + [5.0] * 6 + [0.5] * 30 + [5.0] * 3],
        [22, 57],
    ),
    "reward_vs_heldout": (
        [
            {"reward": 0.1, "heldout/acc/mean@4": 0.5, "heldout/acc/scored@4": 200},
            {"reward": 0.3},
            # held-out fell 40% from its best, 4 standard errors of the difference over 200 completions; reward up
            {"reward": 0.5, "heldout/acc/mean@4": 0.3, "heldout/acc/scored@4": 200},
            {"reward": 0.6},  # no held-out value: the episode goes on
            {"reward": 0.6, "heldout/acc/mean@4": 0.6, "heldout/acc/scored@4": 200},  # a new best: cleared
            {"reward": 0.9},
            {"heldout/acc/mean@4": 0.4, "heldout/acc/scored@4": 200},  # an evaluation logged in its own entry
        ],
        [2, 6],
    ),
}


def test_every_alarm_has_a_stream():
    assert set(STREAMS) == set(ALARMS)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_each_alarm_fires_once_per_episode_clears_and_fires_again(name):
    stream, expected = STREAMS[name]
    indices, messages, monitor = fired_at(stream, name, patience=3)
    assert indices == expected
    assert monitor.counts[name] == len(expected) and monitor.alarm_metrics()[f"alarms/{name}"] == len(expected)
    # Every warning names the metric that counts it and the setting of its threshold.
    assert all(f"[alarms/{name}; alarm_thresholds['{name}']=" in message for message in messages)
    episodes = [episode for episode in monitor.episodes if episode.name == name]
    assert [episode.start for episode in episodes] == expected and not episodes[0].active


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_each_alarm_can_be_switched_off(name):
    stream, _ = STREAMS[name]
    indices, _, monitor = fired_at(stream, name, {name: None})
    assert indices == [] and name not in monitor.counts


#: A phrase of each alarm's advice (what its warning says to change).
ADVICE = {
    "zero_std": "Make the prompts neither too easy nor too hard for the model",
    "no_spread": "so the reward sees no complete answer. Raise max_completion_length.",
    "unscored": "a parser that never matches (answer format, tags) returns None for everything",
    "no_gradient": "check requires_grad and the LoRA target modules",
    "truncation": "or ask for shorter answers (a system prompt, a format reward)",
    "truncation_sustained": "or ask for shorter answers (a system prompt, a format reward)",
    "clip_fraction": "Lower the learning_rate or num_iterations, or widen epsilon.",
    "ratio_p95": "check that it samples with the same weights and sampling settings as the trainer",
    "ratio_max": "check that it samples with the same weights and sampling settings as the trainer",
    "kl_jump": "Lower the learning_rate, raise beta, or check the rewards for hacking.",
    "kl_high": "Lower the learning_rate, raise beta, or check the rewards for hacking.",
    "kl_growth": "Lower the learning_rate, raise beta, or check the rewards for hacking.",
    "entropy_collapse": "or add an entropy bonus (entropy_coef)",
    "grad_norm_spike": "set or lower max_grad_norm, or raise beta",
    "length_drift": "cap or penalise length in it",
    "length_growth": "cap or penalise length in it",
    "length_in_group": "cap or penalise length in it",
    "reward_vs_heldout": "Read completions for loopholes the reward pays for",
    "reward_scale": "Check the reward functions and reward_weights",
    "vanishing_gradient": "a gradient accumulation or scaling bug",
    "clip_asymmetry": "Lower the learning_rate or num_iterations, or widen epsilon.",
    "flat_groups": "Make the prompts neither too easy nor too hard for the model",
    "plateau": "change what limits it (harder prompts",
    "reward_drop": "raise beta, and keep the best checkpoint (metric_for_best_model, load_best_model_at_end)",
    "reward_composition": "make the auxiliary reward harder to earn without solving the task",
}


def package_strings() -> list[str]:
    """Every string literal of the package (an implicit concatenation as one, an f-string's literal parts each)."""
    import ast
    import pathlib

    import trl_grpo_ext

    strings = []
    for path in pathlib.Path(trl_grpo_ext.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(" ".join(node.value.split()))
    return strings


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_each_alarm_s_advice_is_written_once_in_the_package(name):
    """The advice its warning gives is in one string of the package: not repeated in a configuration's help, a
    record, a docstring or another rule's warning (the alarms of a family that share it read it from the family)."""
    _, messages, _ = fired_at(STREAMS[name][0], name, patience=3)
    assert ADVICE[name] in messages[0]
    holding = [text for text in package_strings() if ADVICE[name].lower() in text.lower()]
    assert len(holding) == 1, holding


@pytest.mark.parametrize(
    ("knob", "name", "entry"),
    [
        ("max_completion_length", "truncation", {"completions/clipped_ratio": 0.9}),
        ("num_generations", "zero_std", {"frac_reward_zero_std": 1.0}),
        ("temperature", "entropy_collapse", None),
        ("learning_rate", "grad_norm_spike", None),
        ("beta", "kl_jump", None),
        ("beta", "kl_growth", None),
        ("metric_for_best_model", "reward_vs_heldout", None),
    ],
)
def test_each_warning_names_the_knob_to_change(knob, name, entry):
    stream = STREAMS[name][0] if entry is None else [entry]
    _, messages, _ = fired_at(stream, name)
    assert knob in messages[0]


def test_no_spread_says_whether_truncation_is_the_cause():
    def message(clipped):
        extra = {} if clipped is None else {"completions/clipped_ratio": clipped}
        return fired_at([{"frac_reward_zero_std": 1.0, **extra}] * 3, "no_spread")[1][0]

    assert "Truncation is the likely cause" in message(0.97) and "max_completion_length" in message(0.97)
    assert "Truncation is not the cause (10% of completions were cut)" in message(0.1)
    assert "Whether truncation is the cause is unknown" in message(None)


def test_sustained_truncation_is_a_note_from_5_percent_and_a_warning_from_15_percent():
    _, messages, monitor = fired_at(STREAMS["truncation_sustained"][0], "truncation_sustained")
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


def test_pearson_correlation():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None and pearson([1], [2]) is None


def test_the_report_replays_the_same_episodes_as_the_live_monitor():
    stream = [
        {**a, **b, **c, "loss": 0.0, "step": step}
        for step, (a, b, c) in enumerate(
            zip(STREAMS["kl_jump"][0], STREAMS["entropy_collapse"][0], STREAMS["grad_norm_spike"][0], strict=False),
            start=1,
        )
    ]
    live = AnomalyMonitor()
    for entry in stream:
        live.check(entry, warn=False)
    replayed = assess(stream).episodes
    assert [(e.name, e.start, e.end) for e in replayed] == [(e.name, e.start, e.end) for e in live.episodes]
    assert {e.name for e in replayed} == {"kl_jump", "entropy_collapse", "grad_norm_spike"}


def callback_args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)


def test_counts_reach_the_logs_the_later_callbacks_see_and_the_history(tmp_path):
    monitor, state = AnomalyMonitor(), TrainerState()
    seen = []
    for step, clipped in enumerate((0.9, 0.9, 0.1, 0.9), start=1):
        logs = {"loss": 0.0, "completions/clipped_ratio": clipped}
        state.global_step = step
        state.log_history.append({**logs, "step": step})  # as Trainer.log records it before the callbacks
        monitor.on_log(callback_args(tmp_path), state, TrainerControl(), logs=logs)
        seen.append(logs.get("alarms/truncation"))
    assert seen == [1, 1, 1, 2]  # how many times it was given so far
    assert [entry["alarms/truncation"] for entry in state.log_history] == [1, 1, 1, 2]
    evaluation = {"eval_loss": 0.1}
    monitor.on_log(callback_args(tmp_path), state, TrainerControl(), logs=evaluation)
    assert "alarms/truncation" not in evaluation  # counts go with the training entries


def test_a_resumed_run_keeps_its_counts_and_does_not_warn_again(tmp_path, caplog):
    history = [{"loss": 0.0, "completions/clipped_ratio": 0.9, "step": step} for step in (1, 2)]
    state = TrainerState(log_history=list(history), global_step=2)
    monitor = AnomalyMonitor()
    monitor.on_train_begin(callback_args(tmp_path), state, TrainerControl())
    assert monitor.counts == {"truncation": 1} and monitor.warnings == []
    logs = {"loss": 0.0, "completions/clipped_ratio": 0.9}
    state.global_step = 3
    assert monitor.check(logs, 3) == []  # the same episode, not a new one


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("truncation", 0.0),
        ("truncation", 1.5),
        ("no_spread", 0),
        ("entropy_collapse", 1.0),
        ("grad_norm_spike", 1.0),
        ("length_drift", 1.2),
        ("length_growth", 0.0),
        ("truncation_sustained", 1.5),
        ("length_in_group", 0.0),
        ("reward_vs_heldout", -0.1),
        ("ratio_p95", 0.9),
        ("plateau", 0),
        ("plateau", 10.5),
        ("flat_groups", 0.0),
        ("vanishing_gradient", 1.0),
        ("clip_asymmetry", 1.0),
        ("reward_drop", 0.0),
        ("kl_growth", 1.0),
        ("reward_composition", 0.0),
        ("reward_composition", 1.5),
        ("kl_high", "high"),
    ],
)
def test_thresholds_out_of_range_are_refused_naming_the_alarm(name, value, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"`alarm_thresholds['{name}']` must be")):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds={name: value})
    with pytest.raises(ValueError, match=re.escape(f"`thresholds['{name}']` must be")):
        AnomalyMonitor({name: value})


def test_a_patience_below_1_is_refused(tmp_path):
    with pytest.raises(ValueError, match="`warn_patience` must be"):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, warn_patience=0)


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("kl_hihg", "did you mean 'kl_high'?"),
        ("kl_max", "did you mean 'kl_high'?"),
        ("bogus", "the alarms are zero_std"),
    ],
)
def test_an_unknown_alarm_name_is_refused_with_the_nearest_one(given, hint, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"`alarm_thresholds` has no alarm {given!r}: {hint}")):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds={given: 0.5})
    with pytest.raises(ValueError, match=re.escape(f"`thresholds` has no alarm {given!r}")):
        AnomalyMonitor({given: 0.5})


def test_every_removed_warn_field_is_an_alarm_s_earlier_spelling():
    assert len(RENAMED) == 25 and set(RENAMED.values()) <= set(ALARMS)  # the threshold fields of the release before
    assert all(field.startswith("warn_") and field not in GRPOConfigExt.__dataclass_fields__ for field in RENAMED)


@pytest.mark.parametrize(("field", "name"), sorted(RENAMED.items()))
def test_a_removed_warn_field_is_refused_naming_its_new_spelling(field, name, tmp_path):
    with pytest.raises(
        ValueError,
        match=re.escape(f"`{field}` was removed") + r".*" + re.escape(f"alarm_thresholds={{'{name}': 0.5}}"),
    ):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, **{field: 0.5})


def test_the_alarms_are_judged_in_their_order_each_by_its_family():
    """`ORDER` names every alarm of every family once; a family judges its own alarms only."""
    assert sorted(ORDER) == sorted(name for family in FAMILIES for name in family.alarms) == sorted(ALARMS)
    assert list(ALARMS) == list(ORDER) and [rule.name for rule in build_rules(DEFAULTS)] == list(ORDER)
    with pytest.raises(ValueError, match="judges"):
        ALARMS["kl_high"]("zero_std", 0.5)


def test_the_thresholds_are_read_from_a_command_line_s_json(tmp_path):
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds='{"kl_high": 0.5, "zero_std": null}')
    assert args.alarm_thresholds == {"kl_high": 0.5, "zero_std": None}
    with pytest.raises(ValueError, match="`alarm_thresholds` must be a JSON object"):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds="kl_high=0.5")


def test_the_config_defaults_are_the_monitor_s(tmp_path):
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds={"truncation": None})
    monitor = AnomalyMonitor.from_config(args)
    assert monitor.thresholds == {**DEFAULTS, "truncation": None} and list(monitor.thresholds) == list(ALARMS)
    assert "truncation" not in [rule.name for rule in monitor.rules]
    assert AnomalyMonitor.from_config(GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)).thresholds == DEFAULTS


def test_a_plain_trl_config_gets_the_alarm_settings_of_grpo_config_ext_s_defaults(tmp_path):
    ours = AlarmSettings.from_config(GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)).state()
    assert AlarmSettings.from_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True)).state() == ours


def monitor_of(trainer) -> AnomalyMonitor:
    (monitor,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]
    return monitor


class TestOnRealRuns:
    def test_the_monitor_comes_before_the_loggers(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer = GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=count_a_reward,
            args=GRPOConfigExt(**tiny_grpo_args(tmp_path, report_to="tensorboard")),
            train_dataset=prompt_dataset,
            processing_class=tiny_tokenizer,
        )
        names = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
        assert names.index("AnomalyMonitor") < names.index("TensorBoardCallback")

    def test_one_token_completions_raise_the_truncation_alarm(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        _, trainer = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_completion_length=1)
        monitor = monitor_of(trainer)
        assert monitor.counts["truncation"] == 1
        entries = training_entries(trainer)
        assert entries[0]["completions/clipped_ratio"] >= 0.5
        assert [entry["alarms/truncation"] for entry in entries] == [1] * len(entries)
        trainer.create_model_card()
        health = (tmp_path / "README.md").read_text().split("## Training health")[1].split("\n## ")[0]
        assert "- truncation (steps 1-4): " in health and "Raise max_completion_length" in health

    def test_a_constant_reward_raises_the_no_spread_alarm_once(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def constant_reward(completions, **kwargs):
            return [1.0] * len(completions)

        _, trainer = train_logs(
            tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=constant_reward
        )
        monitor = monitor_of(trainer)
        assert monitor.counts["no_spread"] == 1 and monitor.counts["zero_std"] == 1
        (no_spread,) = [episode for episode in monitor.episodes if episode.name == "no_spread"]
        assert no_spread.start == DEFAULTS["no_spread"]  # the 3rd log step without spread
        assert "Truncation is" in no_spread.message  # says whether truncation is the cause
        assert [entry.get("alarms/no_spread") for entry in training_entries(trainer)] == [None, None, 1, 1]

    def test_a_reward_equal_to_the_length_raises_the_length_alarm(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def length_reward(completion_ids, **kwargs):
            return [float(len(ids)) for ids in completion_ids]

        _, trainer = train_logs(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward_funcs=length_reward,
            max_completion_length=16,
        )
        correlations = [entry.get("reward_length_corr/within_group") for entry in training_entries(trainer)]
        assert any(value == pytest.approx(1.0) for value in correlations if value is not None)
        assert monitor_of(trainer).counts["length_in_group"] == 1

    def test_an_unrelated_reward_shows_a_weak_length_correlation(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def parity_reward(completion_ids, **kwargs):  # depends on the tokens, not on how many
            return [float(sum(ids) % 2) for ids in completion_ids]

        _, trainer = train_logs(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward_funcs=parity_reward,
            max_completion_length=16,
        )
        assert "length_in_group" not in monitor_of(trainer).counts


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


@pytest.mark.parametrize("with_bar", [True, False])
def test_in_a_redirected_log_a_warning_starts_its_own_line_after_the_progress_bar(with_bar, monkeypatch):
    import io
    import logging
    import sys

    from tqdm import tqdm

    log = io.StringIO()  # stderr redirected to a file: the bar and the warnings in one stream, not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    handler = logging.StreamHandler(log)
    anomaly_logger = logging.getLogger("trl_grpo_ext.guardrails.anomaly")
    anomaly_logger.addHandler(handler)
    bar = tqdm(total=10, file=log, disable=not with_bar, mininterval=0)
    try:
        bar.update(3)
        (message,) = AnomalyMonitor().check({"completions/clipped_ratio": 0.9}, step=3)
    finally:
        bar.close()
        anomaly_logger.removeHandler(handler)
    before, _, _ = log.getvalue().partition(message)
    if with_bar:
        assert "3/10" in before and before.endswith("\n") and not before.endswith("\n\n")
    else:
        assert before == ""


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
