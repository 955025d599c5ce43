"""The reward statistics of the diagnostics: the reward spread inside groups and the length/reward correlation.

`DiagnosticsAccumulator.add_rewards` keeps each group's reward std and this process's centred length/reward sums
(`LENGTH_FIELDS`) on the device; at a log step these functions read the reported scalars and histogram off them.
"""

from __future__ import annotations

import math

import torch

from ..metrics import (
    REWARD_LENGTH_CORR,
    REWARD_STD_FRAC_ZERO_GROUPS,
    REWARD_STD_GROUP,
    REWARD_STD_GROUP_MAX,
    REWARD_STD_GROUP_MEAN,
    REWARD_STD_GROUP_MIN,
)
from ..ops.advantages import has_spread

__all__ = [
    "LENGTH_FIELDS",
    "group_reward_stds",
    "length_moments",
    "summarize_length_correlation",
    "summarize_reward_spread",
    "value_histogram",
]

# The length/reward correlation inside groups: this process's centred sums since the last log (`length_moments`).
LENGTH_FIELDS = [("length_reward", "sum"), ("length_squares", "sum"), ("reward_squares", "sum")]


def group_reward_stds(grouped: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Each group's sample std of its scored rewards, NaN for a group with fewer than two. Device ops only.

    Args:
        grouped (`torch.Tensor` of shape `(N / G, G)`): total reward per completion, one group per row.
        scored (`torch.Tensor`, bool, same shape): the completions that some reward function scored.
    """
    count = scored.sum(dim=1)
    mean = torch.where(scored, grouped, 0.0).sum(dim=1) / count.clamp(min=1)
    squares = torch.where(scored, grouped - mean[:, None], 0.0).pow(2).sum(dim=1)
    return torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), math.nan)


def length_moments(
    rewards: torch.Tensor, group_stds: torch.Tensor, lengths: torch.Tensor, first_row: int, num_generations: int
) -> dict[str, torch.Tensor]:
    """This process's `LENGTH_FIELDS` sums for one generation batch, by name. Device ops only.

    Its rows `first_row ..` of the batch are centred on the means of their group's rows held here (all of the group
    unless the group spans processes) and summed: `sum l_c * R_c`, `sum l_c^2`, `sum R_c^2`. Rows that no function
    scored are left out, and so are groups without reward spread (their advantages are 0: they push no length either
    way, and their length spread would pull the correlation towards 0).

    Args:
        rewards (`torch.Tensor` of shape `(N,)`): the whole batch's total rewards, NaN for unscored rows.
        group_stds (`torch.Tensor` of shape `(N / G,)`): each group's reward std.
        lengths (`torch.Tensor` of shape `(n,)`): this process's completion lengths.
        first_row (`int`): the batch row of `lengths[0]`.
        num_generations (`int`): the group size G.
    """
    count = lengths.numel()
    reward = rewards[first_row : first_row + count]
    length = lengths.to(device=reward.device, dtype=reward.dtype)
    first_group, last_group = first_row // num_generations, (first_row + count - 1) // num_generations
    group = torch.arange(first_row, first_row + count, device=reward.device) // num_generations
    local = group - first_group  # index among the groups this process holds (host integers: no sync)
    scored = ~torch.isnan(reward)
    weight = scored.to(reward.dtype)
    zeros = reward.new_zeros(last_group - first_group + 1)
    rows = zeros.index_add(0, local, weight).clamp(min=1)
    reward_mean = zeros.index_add(0, local, torch.where(scored, reward, 0.0)) / rows
    length_mean = zeros.index_add(0, local, torch.where(scored, length, 0.0)) / rows
    varies = has_spread(group_stds[group])  # NaN (one scored row) is no spread either
    counted = scored & varies
    length_centred = torch.where(counted, length - length_mean[local], 0.0)
    reward_centred = torch.where(counted, reward - reward_mean[local], 0.0)
    return {
        "length_reward": (length_centred * reward_centred).sum(),
        "length_squares": length_centred.pow(2).sum(),
        "reward_squares": reward_centred.pow(2).sum(),
    }


def summarize_length_correlation(sums: dict[str, torch.Tensor], scalars: dict[str, float]) -> None:
    """Report the length/reward correlation inside groups, unless lengths or rewards have no spread.

    Args:
        sums (`dict[str, torch.Tensor]`): the `LENGTH_FIELDS` sums (0-dim), pooled over processes.
        scalars (`dict[str, float]`): the log step's scalars, to add to.
    """
    cross, length_squares, reward_squares = (sums[name] for name, _ in LENGTH_FIELDS)
    if length_squares.item() > 0 and reward_squares.item() > 0:
        # r = sum (l - l_g)(R - R_g) / sqrt(sum (l - l_g)^2 * sum (R - R_g)^2), pooled over groups and processes
        correlation = cross / (length_squares * reward_squares).sqrt()
        scalars[REWARD_LENGTH_CORR] = correlation.item()


def summarize_reward_spread(
    group_stds: torch.Tensor, scalars: dict[str, float], histograms: dict[str, tuple] | None = None
) -> None:
    """Report the reward spread inside groups: the share of flat groups and the groups' std.

    Args:
        group_stds (`torch.Tensor` of shape `(num_groups,)`): each group's reward std since the last log, NaN for a
            group with fewer than two scored rewards.
        scalars (`dict[str, float]`): the log step's scalars, to add to.
        histograms (`dict[str, tuple]`, *optional*): the log step's histograms, to add the stds' histogram to.
    """
    # A group teaches nothing when its rewards are all equal (TRL's zero test: within 1e-8) or fewer than two of
    # them were scored, whatever `scale_rewards` then divides by (TRL's `frac_reward_zero_std` uses the batch's
    # std under scale_rewards="batch").
    flat = ~has_spread(group_stds)
    scalars[REWARD_STD_FRAC_ZERO_GROUPS] = flat.to(torch.float64).mean().item()
    valid = group_stds[~torch.isnan(group_stds)]
    if valid.numel() == 0:
        return
    scalars[REWARD_STD_GROUP_MEAN] = valid.mean().item()
    scalars[REWARD_STD_GROUP_MIN] = valid.min().item()
    scalars[REWARD_STD_GROUP_MAX] = valid.max().item()
    if histograms is not None:
        histograms[REWARD_STD_GROUP] = value_histogram(valid)


def value_histogram(values: torch.Tensor, num_buckets: int = 20) -> tuple:
    """Histogram of a handful of values, in the tuple layout of `DiagnosticsSummary.histograms`."""
    minimum, maximum = values.min().item(), values.max().item()
    if maximum == minimum:
        limits, counts = [maximum], [float(values.numel())]
    else:
        edges = torch.linspace(minimum, maximum, num_buckets + 1, dtype=torch.float64)
        counts = torch.histc(values, bins=num_buckets, min=minimum, max=maximum).tolist()
        limits = edges[1:].tolist()
    return (limits, counts, minimum, maximum, float(values.numel()), values.sum().item(), values.pow(2).sum().item())
