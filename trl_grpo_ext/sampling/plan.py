"""The decisions of dynamic sampling (`dynamic.py`), as functions of gathered tensors: alike everywhere.

- `trl_advantages`, `trl_reward_metrics`: TRL's advantages and reward metrics of a generation batch, from its gathered
  rewards (a copy of the inline block of TRL 1.16's `GRPOTrainer._generate_and_score_completions`, recorded in
  `_compat.TRL_COPIES` and pinned by `tests/test_sampling_plan.py`), so that a batch assembled from several generation
  rounds gets the advantages TRL would give it.
- `informative_groups`: which groups have a reward spread (the others have advantage 0: no policy gradient).
- `group_placement`, `fill_slots`: which generated group trains in which place of the batch. TRL's sampler lays a
  generation batch out group by group over the processes; a group may span two. An extra round is laid out the same
  way with fewer rows per process (the same number on each), so a group can take the place of another with the same
  placement (the same processes, as many rows on each) without any row moving between processes.
- `extra_round_rows`: how many rows per process the next extra round generates, from the places still empty and the
  share of groups kept so far.
- `PromptStream`: the fresh prompts of the extra rounds, in a seeded order of their own (two integers of state).
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from trl.trainer.utils import nanstd

__all__ = [
    "PromptStream",
    "extra_round_rows",
    "fill_slots",
    "group_placement",
    "informative_groups",
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
    """TRL's advantages of a generation batch, from the rewards of every process.

    Copy of the advantage block of TRL 1.16's `GRPOTrainer._generate_and_score_completions`
    (`trl/trainer/grpo_trainer.py`), which is inline there.

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
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    return metrics


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Which groups have a reward spread, `(K,)` bool, from TRL's combined reward `(N,)` (`trl_advantages`).

    A group is dropped when the standard deviation of its scored rewards is 0 (as TRL's `torch.isclose` tests it) or
    undefined (fewer than two scored completions): its advantages are then all 0, or all but 0 under
    `normalize_then_sum` (a shift shared by the whole group). Rows that no reward function scored are left out of
    the statistics, as TRL leaves them out.
    """
    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return torch.isfinite(std) & ~torch.isclose(std, torch.zeros_like(std))


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
        round_placements (`list[list[tuple]]`, *optional*): `group_placement` of each round, round 0's included
            (an extra round may be smaller); default: every round laid out as round 0.

    Returns:
        `(assignment, short)`: per place `j` of round 0, the `(round, group)` that trains there, and how many places
        no informative group of the same placement could fill: they keep round 0's group (see `dynamic.py`).
        Round 0's informative groups keep their places; the others are filled in order of round, then group.
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
    """Rows per process of the next extra round: the smallest round, laid out as TRL lays out a generation batch (the
    same number of rows on every process, groups in order), that holds, for every placement with empty places,
    `ceil(margin * empty / keep_rate)` groups of that placement, or as many as a whole generation batch holds.

    Args:
        lacking (`Counter`): placement (`group_placement`'s tuples, of a whole generation batch) -> empty places.
        keep_rate (`float`): the expected share of informative groups; 0 (none seen yet): a whole generation batch.
        margin (`float`): generate this many times the groups expected to be needed.
        rows_per_process (`int`): rows of a whole generation batch on each process.
        num_processes (`int`), num_generations (`int`): the layout.

    Returns:
        `int`: between 1 and `rows_per_process`; `rows_per_process` where no smaller round holds enough.

    A round of `r` rows per process needs `num_processes * r` to be a multiple of `num_generations` (whole groups);
    where `rows_per_process` is a multiple of `num_generations`, rounds of whole groups per process fill any place of
    their process, and a smaller round costs nothing in which places it can fill. Where groups span processes, only
    a round with the same spanning segments can fill a spanning place.
    """
    num_groups = num_processes * rows_per_process // num_generations
    whole = Counter(group_placement(num_groups, num_generations, rows_per_process))
    needed = {}
    for placement, empty in lacking.items():
        if empty <= 0:
            continue
        wanted = math.ceil(margin * empty / keep_rate) if keep_rate > 0 else whole[placement]
        needed[placement] = min(wanted, whole[placement])
    for rows in range(1, rows_per_process):
        if (num_processes * rows) % num_generations:
            continue
        held = Counter(group_placement(num_processes * rows // num_generations, num_generations, rows))
        if all(held[placement] >= count for placement, count in needed.items()):
            return rows
    return rows_per_process


class PromptStream:
    """Indices of the training set for the extra rounds: successive permutations (or the plain order without
    shuffling), each drawn from a generator seeded with `seed` and the permutation's number.

    Its state is `(epoch, position)`: two integers, saved with each checkpoint, identical on every process.

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

    def draw(self, count: int) -> list[int]:
        """The next `count` indices (continuing into the next permutation when this one runs out)."""
        drawn = []
        while len(drawn) < count:
            order = self._permutation()
            take = min(count - len(drawn), self.size - self.position)
            drawn += order[self.position : self.position + take]
            self.position += take
            if self.position == self.size:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return drawn

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
