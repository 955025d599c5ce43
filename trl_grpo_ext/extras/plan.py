"""Dynamic sampling's decisions (`dynamic.py`), as functions of gathered tensors: alike on every process.

TRL's advantages and reward metrics of an assembled batch (`trl_advantages`, `trl_reward_metrics`); which groups have
a reward spread (`informative_groups`); which generated group trains in which place (`group_placement`,
`fill_slots`); how large the next extra round is (`extra_round_rows`); the fresh prompts (`PromptStream`,
`PromptKeys`); TRL's per-call metrics of several rounds as one value (`combine_round_metrics`); the check that every
process took the same decisions (`gathered`, `position_checksum`, also selective rollouts').
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping

import torch
from trl.trainer.utils import nanstd

from ..metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    FRAC_REWARD_ZERO_STD,
    NUM_TOKENS,
    REWARD,
    REWARD_STD,
    TOOLS_CALL_FREQUENCY,
    TOOLS_FAILURE_FREQUENCY,
    reward_function_metric,
)
from ..ops.advantages import has_spread

__all__ = [
    "PromptKeys",
    "PromptStream",
    "combine_round_metrics",
    "extra_round_rows",
    "fill_slots",
    "gathered",
    "group_placement",
    "group_spread",
    "informative_groups",
    "position_checksum",
    "trl_advantages",
    "trl_reward_metrics",
]


def trl_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    multi_objective_aggregation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's advantages of a generation batch, from the rewards of every process: a copy of the inline advantage
    block of TRL 1.16's `GRPOTrainer._generate_and_score_completions` (`_compat.TRL_COPIES`).

    Args:
        rewards_per_func (`torch.Tensor` of shape `(N, F)`): every reward function's reward, gathered from all
            processes, NaN where a function did not score; rows group-contiguous.
        reward_weights (`torch.Tensor` of shape `(F,)`): TRL's `reward_weights`.
        num_generations (`int`): G.
        scale_rewards (`str`): `"group"`, `"batch"` or `"none"`.
        multi_objective_aggregation (`str`): `"sum_then_normalize"` or `"normalize_then_sum"`.

    Returns:
        `(advantages, is_std_zero, rewards)`, each `(N,)`: the advantages (0 for unscorable rows), TRL's zero-std flag
        (its `frac_reward_zero_std` is the mean), and the combined reward the advantages are built from (NaN for rows
        no function scored; with `normalize_then_sum`, the sum of the per-group normalised rewards).
    """
    device = rewards_per_func.device
    weights = reward_weights.to(device).unsqueeze(0)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
        if scale_rewards in ["group", "none"]:
            if num_generations > 1:
                std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
                std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
            else:
                std_rewards = torch.zeros_like(rewards)
        elif scale_rewards == "batch":
            std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"Invalid value for scale_rewards: {scale_rewards}. Must be 'batch', 'group' or 'none'.")
        advantages = rewards - mean_grouped_rewards
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    elif multi_objective_aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1))
        rewards = (reward_k * weights).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    else:
        raise ValueError(
            f"Invalid multi_objective_aggregation: {multi_objective_aggregation}. Must be 'sum_then_normalize' or "
            "'normalize_then_sum'."
        )
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero, rewards


def trl_reward_metrics(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, names: list[str], is_std_zero: torch.Tensor
) -> dict[str, float]:
    """TRL's reward metrics of a generation batch (`reward`, `reward_std`, `frac_reward_zero_std`,
    `rewards/<name>/mean`, `rewards/<name>/std`), as the same TRL block logs them."""
    metrics = {}
    for i, name in enumerate(names):
        metrics[reward_function_metric(name)] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[reward_function_metric(name, "std")] = nanstd(rewards_per_func[:, i]).item()
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    metrics[REWARD] = torch.nanmean(rewards).item()
    metrics[REWARD_STD] = nanstd(rewards).item()
    metrics[FRAC_REWARD_ZERO_STD] = is_std_zero.float().mean().item()
    return metrics


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Which groups have a reward spread, `(K,)` bool, from TRL's combined reward `(N,)` (`trl_advantages`): a
    standard deviation of the scored rewards that is neither 0 (`ops.has_spread`, TRL's test) nor undefined (fewer
    than two scored completions)."""
    return has_spread(nanstd(rewards.view(-1, num_generations), dim=1))


def group_spread(trainer, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(informative, is_std_zero)`: which groups of a scored batch `(N, F)` have a reward spread, `(K,)` bool, and
    TRL's zero-std flag per row, `(N,)`, under the trainer's reward weights, scaling and aggregation. The one test of
    a batch's groups that dynamic sampling and selective rollouts apply."""
    _, is_std_zero, rewards = trl_advantages(
        rewards_per_func,
        trainer.reward_weights,
        trainer.num_generations,
        trainer.scale_rewards,
        trainer.multi_objective_aggregation,
    )
    return informative_groups(rewards, trainer.num_generations), is_std_zero


def group_placement(num_groups: int, num_generations: int, rows_per_process: int) -> list[tuple]:
    """Where each group of a generation batch lies: `((process, rows), ...)` per group, for TRL's layout (global row
    `i` on process `i // rows_per_process`)."""
    placements = []
    for group in range(num_groups):
        start, end = group * num_generations, (group + 1) * num_generations
        segments = []
        for process in range(start // rows_per_process, (end - 1) // rows_per_process + 1):
            low, high = max(start, process * rows_per_process), min(end, (process + 1) * rows_per_process)
            segments.append((process, high - low))
        placements.append(tuple(segments))
    return placements


def fill_slots(
    informative: list[torch.Tensor], placements: list[tuple], round_placements: list[list[tuple]] | None = None
) -> tuple[list[tuple[int, int]], int]:
    """Which generated group trains in each place of the batch.

    Args:
        informative (`list[torch.Tensor]`): per round (0 the batch TRL sampled, then the extra rounds), `(K_r,)` bool.
        placements (`list[tuple]`): `group_placement` of round 0: the places of the batch.
        round_placements (`list[list[tuple]]`, *optional*): `group_placement` of each round, round 0's included;
            default: every round laid out as round 0.

    Returns:
        `(assignment, short)`: per place, the `(round, group)` that trains there (round 0's informative groups keep
        their places, the others are filled in order of round, then group), and how many places no informative group
        of the same placement filled (they keep round 0's group).
    """
    assignment = [(0, group) for group in range(len(placements))]
    waiting: dict[tuple, list[int]] = {}
    for group, ok in enumerate(informative[0].tolist()):
        if not ok:
            waiting.setdefault(placements[group], []).append(group)
    for round_index, flags in enumerate(informative[1:], start=1):
        layout = placements if round_placements is None else round_placements[round_index]
        for group, ok in enumerate(flags.tolist()):
            places = waiting.get(layout[group])
            if ok and places:
                assignment[places.pop(0)] = (round_index, group)
    return assignment, sum(len(places) for places in waiting.values())


def extra_round_rows(
    lacking: Counter,
    keep_rate: float,
    margin: float,
    rows_per_process: int,
    num_processes: int,
    num_generations: int,
) -> int:
    """Rows per process of the next extra round: the smallest round of whole groups, laid out as TRL lays out a
    generation batch, that holds for every placement with empty places `ceil(margin * empty / keep_rate)` groups of
    that placement (or as many as a whole generation batch holds); `rows_per_process` where none smaller does.

    Args:
        lacking (`Counter`): placement (`group_placement`'s tuples, of a whole generation batch) -> empty places.
        keep_rate (`float`): the expected share of informative groups; 0 (none seen yet): a whole generation batch.
        margin (`float`): generate this many times the groups expected to be needed.
        rows_per_process, num_processes, num_generations (`int`): the layout of a whole generation batch.
    """
    num_groups = num_processes * rows_per_process // num_generations
    whole = Counter(group_placement(num_groups, num_generations, rows_per_process))
    needed = {}
    for placement, empty in lacking.items():
        if empty <= 0:
            continue
        # A margin of inf (or one so large that the count overflows) asks for as many as a whole batch holds.
        wanted = margin * empty / keep_rate if keep_rate > 0 else math.inf
        needed[placement] = whole[placement] if wanted >= whole[placement] else math.ceil(wanted)
    for rows in range(1, rows_per_process):
        if (num_processes * rows) % num_generations:
            continue
        held = Counter(group_placement(num_processes * rows // num_generations, num_generations, rows))
        if all(held[placement] >= count for placement, count in needed.items()):
            return rows
    return rows_per_process


class PromptStream:
    """Indices of the training set for the extra rounds: successive permutations (or the plain order without
    shuffling), each seeded with `seed` and its number. State: `(epoch, position)`, alike on every process.

    Args:
        size (`int`): number of prompts in the training set.
        seed (`int`): the run's seed.
        shuffle (`bool`): draw in a random order (TRL's `shuffle_dataset`).
    """

    # Kept apart from the seeds TRL's sampler draws from (`seed` itself): the same prompts in another order.
    SEED_OFFSET = 0x5EED

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size < 1:
            raise ValueError("PromptStream needs a training set with at least one prompt.")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.SEED_OFFSET + self.epoch)
                self._order = torch.randperm(self.size, generator=generator).tolist()
            else:
                self._order = list(range(self.size))
        return self._order

    def draw(self, count: int, taken: set | None = None, key: Callable[[int], Hashable] | None = None) -> list[int]:
        """The next `count` indices.

        Args:
            taken (`set`, *optional*): keys (`key(index)`) of the prompts the generation batch holds: an index whose
                key is in it is passed over, and each index drawn adds its key. After one pass over the training set
                without enough fresh prompts, the indices are drawn as they come.
            key (`Callable`, *optional*): what makes two prompts the same (`PromptKeys`); default: the index.
        """
        drawn, passed = [], 0
        while len(drawn) < count:
            index = self._permutation()[self.position]
            self.position += 1
            if self.position == self.size:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            if taken is not None:
                name = index if key is None else key(index)
                if name in taken and passed < self.size:
                    passed += 1
                    continue
                taken.add(name)
            drawn.append(index)
        return drawn

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def prompt_key(prompt) -> Hashable:
    """What makes two prompts the same: the string, or the text of a conversation (a list of messages)."""
    return prompt if isinstance(prompt, str) else repr(prompt)


class PromptKeys:
    """`prompt_key` of each row of a map-style training set, by index (its `prompt` column read once). A row without
    a prompt (an environment supplies it) has a key of its own, `("row", index)`: it is never passed over."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._keys: list[Hashable] | None = None

    def __call__(self, index: int) -> Hashable:
        if self._keys is None:
            columns = getattr(self.dataset, "column_names", None) or []
            self._keys = [prompt_key(prompt) for prompt in self.dataset["prompt"]] if "prompt" in columns else []
        if self._keys:
            return self._keys[index]
        row = self.dataset[index]
        prompt = row.get("prompt") if isinstance(row, Mapping) else None
        return ("row", index) if prompt is None else prompt_key(prompt)

    def of(self, prompts: Iterable) -> set:
        """The keys of `prompts` (prompt values, e.g. the rows of TRL's completions table)."""
        return {prompt_key(prompt) for prompt in prompts}


#: TRL metrics that are set, not appended, at each generation call (a running total): the last call's value stands.
RUNNING_TOTALS = (NUM_TOKENS,)


def combine_round_metrics(rounds: list[dict[str, list[float]]], rows: list[int]) -> dict[str, float]:
    """One value per metric for everything several generation calls generated (TRL logs one per call): a metric
    whose name's last part starts with `min` (`max`) is the smallest (largest) round value, any other the mean of the
    round values weighted by the rows they describe (the terminated rows for `*_terminated_length`, the tool calls
    for `tools/failure_frequency`); NaN values are left out.

    Args:
        rounds (`list[dict]`): per call, metric name -> the values it appended.
        rows (`list[int]`): per call, the rows it generated (every process's).

    Returns:
        `dict`: metric name -> its value for the whole generation batch (NaN where no round had one).
    """
    combined = {}
    for name in dict.fromkeys(name for values in rounds for name in values):
        pairs = []
        for values, count in zip(rounds, rows, strict=True):
            finite = [value for value in values.get(name, []) if not math.isnan(value)]
            if not finite:
                continue
            weight = float(count)
            if name.endswith("_terminated_length"):
                weight *= 1.0 - _round_value(values, COMPLETIONS_CLIPPED_RATIO, 0.0)
            elif name == TOOLS_FAILURE_FREQUENCY:
                weight *= _round_value(values, TOOLS_CALL_FREQUENCY, 1.0)
            pairs.append((sum(finite) / len(finite), weight))
        last = name.rsplit("/", 1)[-1]
        weighed = [(value, weight) for value, weight in pairs if weight > 0] or pairs
        if not weighed:
            combined[name] = math.nan
        elif len(weighed) == 1:  # one round (no extra round): TRL's value as it is
            combined[name] = weighed[0][0]
        elif last.startswith("min"):
            combined[name] = min(value for value, _ in weighed)
        elif last.startswith("max"):
            combined[name] = max(value for value, _ in weighed)
        else:
            total = sum(weight for _, weight in weighed)
            combined[name] = (
                sum(value * weight for value, weight in weighed) / total
                if total > 0
                else sum(value for value, _ in weighed) / len(weighed)
            )
    return combined


def _round_value(values: dict[str, list[float]], name: str, default: float) -> float:
    found = [value for value in values.get(name, []) if not math.isnan(value)]
    return sum(found) / len(found) if found else default


def position_checksum(values: torch.Tensor) -> float:
    """`sum_i (i + 1) * values[i]` in float64: differs between two sequences that differ in value or order."""
    values = values.detach().double().cpu()
    return (values * torch.arange(1, values.numel() + 1, dtype=torch.float64)).sum().item()


def gathered(accelerator, *values: float) -> torch.Tensor:
    """`values` of every process, `(P, len(values))` float64 on the CPU: one gather, for the checks that the processes
    agree."""
    mine = torch.tensor([[float(value) for value in values]], dtype=torch.float64, device=accelerator.device)
    return accelerator.gather(mine).cpu()
