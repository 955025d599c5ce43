"""Dynamic sampling's decisions (`trl_grpo_ext.extras.plan`): TRL's advantages and reward metrics for an assembled
batch, which groups are informative, where kept groups may go, how many rows an extra round generates, and the
seeded, resumable prompt stream."""

import math
from collections import Counter

import pytest
import torch
from datasets import Dataset
from helpers import half_constant_reward, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext.extras.plan import (
    PromptKeys,
    PromptStream,
    combine_round_metrics,
    extra_round_rows,
    fill_slots,
    group_placement,
    informative_groups,
    trl_advantages,
    trl_reward_metrics,
)


def unscored_on_odd_lengths(completions, **kwargs):
    return [
        None if len(completion) % 2 else completion.count("b") + 0.2 * len(completion) for completion in completions
    ]


@pytest.mark.parametrize(
    ("scale_rewards", "aggregation"),
    [
        ("group", "sum_then_normalize"),
        ("batch", "sum_then_normalize"),
        ("none", "sum_then_normalize"),
        ("group", "normalize_then_sum"),
    ],
)
def test_advantages_and_reward_metrics_of_a_batch_are_trl_s(
    scale_rewards, aggregation, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """The copy of TRL's inline advantage block gives TRL's own advantages and reward metrics, bit for bit, also with
    rows that a reward function did not score and groups without spread."""
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=GRPOTrainer,
        config_cls=GRPOConfig,
        reward_funcs=[half_constant_reward, unscored_on_odd_lengths],
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
    )
    captured = []
    original = trainer._calculate_rewards

    def capture(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    trainer._calculate_rewards = capture
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    output = trainer._generate_and_score_completions(batch)
    rewards_per_func = captured[0]
    assert torch.isnan(rewards_per_func[:, 1]).any() and not torch.isnan(rewards_per_func[:, 1]).all()
    advantages, is_std_zero, _ = trl_advantages(
        rewards_per_func, trainer.reward_weights, trainer.num_generations, scale_rewards, aggregation
    )
    assert torch.equal(advantages, output["advantages"])
    metrics = trl_reward_metrics(rewards_per_func, trainer.reward_weights, trainer.reward_func_names, is_std_zero)
    assert set(metrics) <= set(trainer._metrics["train"])
    for name, value in metrics.items():
        logged = trainer._metrics["train"][name][-1]
        assert value == logged or (math.isnan(value) and math.isnan(logged)), name


def test_informative_groups_are_those_with_a_defined_nonzero_spread():
    nan = math.nan
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 1.0]  # no spread
        + [0.0, 1.0, 0.0, 0.0]  # spread
        + [nan, nan, nan, nan]  # nothing scored
        + [nan, 2.0, nan, nan]  # one scored: no spread defined
        + [nan, 2.0, 3.0, nan]  # two scored, different
    )
    assert informative_groups(rewards, 4).tolist() == [False, True, False, False, True]


def test_groups_take_only_places_with_the_same_placement():
    # 2 processes of 6 rows, groups of 4: group 1 spans both processes.
    placements = group_placement(3, 4, 6)
    assert placements == [((0, 4),), ((0, 2), (1, 2)), ((1, 4),)]
    informative = [
        torch.tensor([False, False, True]),
        torch.tensor([True, False, True]),
        torch.tensor([False, True, True]),
    ]
    assignment, short = fill_slots(informative, placements)
    assert assignment == [(1, 0), (2, 1), (0, 2)]
    assert short == 0
    assignment, short = fill_slots(informative[:2], placements)
    assert assignment == [(1, 0), (0, 1), (0, 2)] and short == 1  # group 1 kept: nothing else fits its place
    # One process, groups of 4 over 8 rows: any informative group fills any place, in order.
    placements = group_placement(2, 4, 8)
    assignment, short = fill_slots([torch.tensor([False, False]), torch.tensor([False, True])], placements)
    assert assignment == [(1, 1), (0, 1)] and short == 1


def test_a_round_holds_the_missing_groups_over_the_keep_rate_in_whole_groups_per_process():
    one = group_placement(16, 8, 128)  # the demo: one process, 16 groups of 8
    lacking = Counter({one[0]: 5})
    assert extra_round_rows(lacking, 0.72, 1.0, 128, 1, 8) == 8 * math.ceil(5 / 0.72)  # 7 groups
    assert extra_round_rows(lacking, 0.72, 1.2, 128, 1, 8) == 8 * math.ceil(1.2 * 5 / 0.72)  # 9 groups
    assert extra_round_rows(lacking, 0.2, 1.0, 128, 1, 8) == 128  # more than a generation batch: a whole one
    assert extra_round_rows(lacking, 0.0, 1.0, 128, 1, 8) == 128  # nothing kept yet: a whole one
    # Two processes of 8 rows, groups of 4 (whole groups per process): sized for the neediest process.
    two = group_placement(4, 4, 8)
    assert two == [((0, 4),), ((0, 4),), ((1, 4),), ((1, 4),)]
    assert extra_round_rows(Counter({two[0]: 1}), 1.0, 1.0, 8, 2, 4) == 4  # one group on each process
    assert extra_round_rows(Counter({two[0]: 1, two[2]: 2}), 1.0, 1.0, 8, 2, 4) == 8


def test_where_groups_span_processes_only_a_round_with_the_same_segments_fills_a_spanning_place():
    # 2 processes of 6 rows, groups of 4: group 1 spans both. Rounds of 2 rows hold one spanning group, of 4 rows
    # one whole group per process; 6 rows is a whole generation batch.
    whole = group_placement(3, 4, 6)
    assert group_placement(1, 4, 2) == [((0, 2), (1, 2))] == [whole[1]]
    assert group_placement(2, 4, 4) == [((0, 4),), ((1, 4),)]
    assert extra_round_rows(Counter({whole[1]: 1}), 0.9, 1.0, 6, 2, 4) == 2
    assert extra_round_rows(Counter({whole[0]: 1}), 0.9, 1.0, 6, 2, 4) == 4
    assert extra_round_rows(Counter({whole[0]: 1, whole[1]: 1}), 0.9, 1.0, 6, 2, 4) == 6
    informative = [torch.tensor([False, False, True]), torch.tensor([True]), torch.tensor([True, True])]
    layouts = [whole, group_placement(1, 4, 2), group_placement(2, 4, 4)]
    assignment, short = fill_slots(informative, whole, layouts)
    assert assignment == [(2, 0), (1, 0), (0, 2)] and short == 0
    # The 2-row round's group cannot fill a whole-group place.
    assignment, short = fill_slots(informative[:2], whole, layouts[:2])
    assert assignment == [(0, 0), (1, 0), (0, 2)] and short == 1


def test_the_prompt_stream_is_seeded_resumable_and_continues_over_epochs():
    stream = PromptStream(5, seed=3)
    first = stream.draw(3)
    state = stream.state_dict()
    rest = stream.draw(7)
    assert sorted(first + rest[:2]) == list(range(5))  # one permutation, then the next
    assert sorted(rest[2:]) == list(range(5))
    again = PromptStream(5, seed=3)
    again.load_state_dict(state)
    assert again.draw(7) == rest
    assert PromptStream(5, seed=4).draw(5) != PromptStream(5, seed=3).draw(5)
    assert PromptStream(4, seed=0, shuffle=False).draw(6) == [0, 1, 2, 3, 0, 1]


def test_an_infinite_margin_asks_for_a_whole_generation_batch():
    placement = group_placement(4, 4, 16)[0]
    assert extra_round_rows(Counter({placement: 1}), 0.5, math.inf, 16, 1, 4) == 16
    assert extra_round_rows(Counter({placement: 1}), 1e-300, 1e300, 16, 1, 4) == 16
    assert extra_round_rows(Counter({placement: 1}), 0.5, 1.0, 16, 1, 4) == 8


def test_the_stream_passes_over_the_prompts_a_batch_holds_and_draws_none_twice():
    stream = PromptStream(6, seed=0, shuffle=False)
    taken = {0, 1, 2}
    assert stream.draw(2, taken) == [3, 4]
    assert taken == {0, 1, 2, 3, 4}
    assert stream.draw(2, taken) == [5, 0]  # one pass without a fresh prompt: drawn as they come
    keys = PromptKeys(Dataset.from_dict({"prompt": ["a", "b", "a", "c"]}))
    assert PromptStream(4, seed=0, shuffle=False).draw(2, {"b"}, keys) == [0, 3]  # by value
    chats = PromptKeys([{"prompt": [{"role": "user", "content": "a"}]}, {"environment": "maze"}])  # no columns
    assert chats(0) in chats.of([[{"role": "user", "content": "a"}]]) and chats(1) == ("row", 1)


def test_per_call_metrics_of_several_rounds_weigh_each_round_by_what_it_describes():
    rounds = [
        {"completions/mean_length": [4.0], "completions/min_length": [2.0], "completions/clipped_ratio": [0.5],
         "completions/mean_terminated_length": [3.0], "tools/call_frequency": [1.0],
         "tools/failure_frequency": [0.5], "my_score": [1.0]},
        {"completions/mean_length": [8.0], "completions/min_length": [1.0], "completions/clipped_ratio": [1.0],
         "completions/mean_terminated_length": [0.0], "tools/call_frequency": [3.0],
         "tools/failure_frequency": [0.0], "my_score": [math.nan]},
    ]  # fmt: skip
    combined = combine_round_metrics(rounds, [24, 8])
    assert combined["completions/mean_length"] == pytest.approx((4 * 24 + 8 * 8) / 32)
    assert combined["completions/min_length"] == 1.0
    assert combined["completions/clipped_ratio"] == pytest.approx((0.5 * 24 + 8) / 32)
    assert combined["completions/mean_terminated_length"] == 3.0  # the second round terminated nothing
    assert combined["tools/failure_frequency"] == pytest.approx(0.5 * 24 / (24 + 3 * 8))  # per tool call
    assert combined["my_score"] == 1.0  # a NaN says nothing
