"""The alarms (`trl_grpo_ext.guardrails.alarms`): each on a synthetic log stream (fires, once per episode, clears,
fires again, can be switched off) with its advice written once; their thresholds as one mapping, refused out of
range, under an unknown name or under a removed `warn_*` field's."""

import re

import pytest
from helpers import (
    fired_at,
)

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.guardrails import ALARMS, AnomalyMonitor
from trl_grpo_ext.guardrails.alarms import DEFAULTS, FAMILIES, ORDER, RENAMED, build_rules
from trl_grpo_ext.metrics import reward_function_metric
from trl_grpo_ext.tools.report.health import assess


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
