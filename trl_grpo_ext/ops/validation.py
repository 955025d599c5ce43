"""The checks on the objective's inputs and hyper-parameters, in one place.

`policy_objective` (and so `grpo_loss`) validates its arguments here once, whichever implementation then computes
the loss; `GRPOConfigExt` and `GRPOTrainerExt` check a configuration with `hyperparameter_problems` before any
model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ValidatedInputs", "hyperparameter_problems", "kernel_refusal", "raise_problems", "validate_inputs"]


def raise_problems(problems: list[str]) -> None:
    """Raise one `ValueError` naming every problem (one sentence each, as the `*_problems` checks give them); nothing
    when there is none."""
    if problems:
        raise ValueError(" ".join(problems))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def hyperparameter_problems(
    epsilon: float, epsilon_high: float | None, beta: float, delta: float | None = None
) -> list[str]:
    """What is wrong with the objective's hyper-parameters, one message per problem (empty when they are valid).

    Args:
        epsilon (`float`): lower clipping width, finite and > 0.
        epsilon_high (`float` or `None`): upper clipping width, finite and >= 0; `None` means `epsilon`.
        beta (`float`): KL coefficient, finite and >= 0.
        delta (`float` or `None`): upper bound of the unclipped ratio (two-sided clipping), > 0 when set.

    Returns:
        `list[str]`: messages naming the offending argument and its value.
    """
    problems = []
    if not (_is_number(epsilon) and epsilon > 0):
        problems.append(f"`epsilon` must be a finite number > 0, got {epsilon!r}.")
    if epsilon_high is not None and not (_is_number(epsilon_high) and epsilon_high >= 0):
        problems.append(f"`epsilon_high` must be a finite number >= 0 (or None for `epsilon`), got {epsilon_high!r}.")
    if not (_is_number(beta) and beta >= 0):
        problems.append(f"`beta` must be a finite number >= 0, got {beta!r}.")
    if delta is not None and not (_is_number(delta) and delta > 0):
        problems.append(f"`delta` must be a finite number > 0 (or None), got {delta!r}.")
    return problems


@dataclass(frozen=True)
class ValidatedInputs:
    """The objective's tensors after validation.

    Attributes:
        logps (`torch.Tensor` of shape `(N, T)`): as given (with its gradient).
        old_logps, ref_logps (`torch.Tensor` of shape `(N, T)` or `None`): detached.
        advantages (`torch.Tensor` of shape `(N, 1)` or `(N, T)`): detached.
        mask (`torch.Tensor` of shape `(N, T)`, bool): the completion tokens that count.
        dtype (`torch.dtype`): the computation dtype, float32 or the inputs' if wider.
    """

    logps: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    dtype: torch.dtype


def _check_tensor(name: str, tensor, shape: torch.Size, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.shape != shape:
        raise ValueError(f"`{name}` has shape {tuple(tensor.shape)}, expected {tuple(shape)} (the shape of `logps`).")
    if tensor.device != device:
        raise ValueError(f"`{name}` is on {tensor.device}, but `logps` is on {device}; move it to the same device.")


def _advantages_2d(advantages, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """`advantages` as `(N, 1)` or `(N, T)`."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"`advantages` must be a torch.Tensor, got {type(advantages).__name__}.")
    if advantages.device != device:
        raise ValueError(
            f"`advantages` is on {advantages.device}, but `logps` is on {device}; move it to the same device."
        )
    num_rows, num_tokens = shape
    if advantages.shape == (num_rows,):
        return advantages.unsqueeze(-1)
    if advantages.shape in ((num_rows, 1), (num_rows, num_tokens)):
        return advantages
    raise ValueError(
        f"`advantages` has shape {tuple(advantages.shape)}; expected ({num_rows},), ({num_rows}, 1) or "
        f"({num_rows}, {num_tokens}) for `logps` of shape {tuple(shape)}."
    )


def validate_inputs(
    logps, old_logps, ref_logps, advantages, completion_mask, *, beta: float, optional: dict | None = None
) -> ValidatedInputs:
    """Check the objective's tensors against `logps`; raise `ValueError` naming the first offending argument.

    Args:
        logps, old_logps, ref_logps, advantages, completion_mask: as `policy_objective` takes them.
        beta (`float`): the KL coefficient (`ref_logps=None` is allowed only when it is 0).
        optional (`dict[str, torch.Tensor | None]`, *optional*): further per-row or per-token tensors (weights) that
            must be on the device of `logps` and have `N` rows.

    Returns:
        [`ValidatedInputs`].
    """
    if not isinstance(logps, torch.Tensor) or logps.dim() != 2:
        shape = tuple(logps.shape) if isinstance(logps, torch.Tensor) else type(logps).__name__
        raise ValueError(f"`logps` must be a 2-dim (N, T) tensor, got {shape}.")
    if not logps.is_floating_point():
        raise ValueError(f"`logps` must be a floating-point tensor, got {logps.dtype}.")
    if logps.numel() == 0:
        raise ValueError(f"`logps` is empty (shape {tuple(logps.shape)}): a batch needs at least one row and token.")
    shape, device = logps.shape, logps.device
    _check_tensor("completion_mask", completion_mask, shape, device)
    if old_logps is not None:
        _check_tensor("old_logps", old_logps, shape, device)
    if ref_logps is None and beta > 0:
        raise ValueError(f"`ref_logps` is None but `beta` is {beta}; pass reference log-probs or set beta=0.")
    if ref_logps is not None:
        _check_tensor("ref_logps", ref_logps, shape, device)
    advantages = _advantages_2d(advantages, shape, device)
    for name, tensor in (optional or {}).items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[0] != shape[0]:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"`{name}` must be a ({shape[0]}, 1) or ({shape[0]}, {shape[1]}) tensor, got {got}.")
        if tensor.device != device:
            raise ValueError(
                f"`{name}` is on {tensor.device}, but `logps` is on {device}; move it to the same device."
            )
    mask = completion_mask if completion_mask.dtype == torch.bool else completion_mask != 0
    return ValidatedInputs(
        logps=logps,
        old_logps=None if old_logps is None else old_logps.detach(),
        ref_logps=None if ref_logps is None else ref_logps.detach(),
        advantages=advantages.detach(),
        mask=mask,
        dtype=torch.promote_types(logps.dtype, torch.float32),
    )


def kernel_refusal(implementation: str, problems: list[str], argument: str = "implementation") -> str:
    """The error for a fused or compiled kernel asked for outside its domain (`problems`: `fused.domain_problems`).

    Args:
        argument (`str`): the name the caller gave the choice (`"loss_implementation"` in a config).
    """
    return (
        f"{argument}={implementation!r} cannot compute this objective: "
        + "; ".join(problems)
        + f". Use {argument}='auto' (the kernel wherever it applies) or 'reference'."
    )
