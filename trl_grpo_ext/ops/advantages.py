"""Group-relative advantages: `A_i = (R_i - mean_group(R)) / (std_group(R) + eps)`."""

from __future__ import annotations

import math

import torch

__all__ = ["NO_SPREAD_STD", "group_relative_advantages", "has_spread"]

#: A group's reward standard deviation at or below this is no spread: TRL's zero test, `torch.isclose(std, 0)`
#: (its absolute tolerance).
NO_SPREAD_STD = 1e-8


def has_spread(std: torch.Tensor) -> torch.Tensor:
    """Where a group's rewards differ, so that it teaches something: the one definition of "no spread" that dynamic
    sampling, selective rollouts and the diagnostics use.

    Args:
        std (`torch.Tensor`): each group's reward standard deviation; NaN where fewer than two rewards were scored.

    Returns:
        `torch.Tensor` of bool, the same shape: finite and above `NO_SPREAD_STD`.
    """
    return torch.isfinite(std) & (std > NO_SPREAD_STD)


def group_relative_advantages(
    rewards: torch.Tensor, num_generations: int, *, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages `A_i = (R_i - mean_group(R)) / (std_group(R) + eps)`.

    Args:
        rewards (`torch.Tensor` of shape `(N,)`):
            One reward per completion, ordered group-contiguously: rows `g*G .. g*G + G - 1` share a prompt. NaN
            marks a completion that could not be scored (a reward function returned `None`, as in TRL): it is left
            out of its group's mean and std, and gets advantage 0.
        num_generations (`int`):
            G, the number of completions per prompt; at least 2, and it must divide N.
        scale (`bool`, defaults to `True`):
            Divide by the group's standard deviation (unbiased, torch's default). `False` only centres the rewards.
        eps (`float`, defaults to `1e-4`):
            Added to the standard deviation. A group whose rewards are all equal gets advantage 0.

    Returns:
        `torch.Tensor` of shape `(N,)`, float32 or wider.

    Raises:
        ValueError: for a `rewards` tensor that is not 1-dim or is empty, `num_generations < 2`, `num_generations`
            not dividing the number of rewards, or `eps < 0`.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"`rewards` must be a 1-dim (N,) tensor, got {shape}.")
    if rewards.numel() == 0:
        raise ValueError("`rewards` is empty.")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"`num_generations` must be an int >= 2 (a group needs a baseline), got {num_generations!r}.")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"`num_generations` ({num_generations}) does not divide the number of rewards ({rewards.numel()}); "
            "rewards must come in whole groups."
        )
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"`eps` must be a finite number >= 0, got {eps!r}.")

    dtype = torch.promote_types(rewards.dtype, torch.float32) if rewards.is_floating_point() else torch.float32
    grouped = rewards.detach().to(dtype).reshape(-1, num_generations)  # (B, G)
    scored = ~torch.isnan(grouped)
    count = scored.sum(dim=1, keepdim=True)
    # Averaging around a value of the group itself makes a group of equal rewards centre to exactly 0.
    shift = torch.where(scored, grouped, -math.inf).amax(dim=1, keepdim=True)
    shift = torch.where(count > 0, shift, 0.0)
    offsets = torch.where(scored, grouped - shift, 0.0)
    mean = shift + offsets.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(scored, grouped - mean, 0.0)
    if not scale:
        return centred.reshape(-1)
    # Unbiased variance over the scored completions; a group with fewer than 2 scored completions has no spread.
    variance = centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), 0.0)
    denominator = std + eps
    advantages = torch.where(denominator > 0, centred / denominator, 0.0)
    return advantages.reshape(-1)
