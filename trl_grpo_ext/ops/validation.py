"""The checks on the objective's inputs and hyper-parameters, in one place: `policy_objective` (and so `grpo_loss`)
and the configuration's checks call these, before any implementation computes anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "IMPLEMENTATIONS",
    "ValidatedInputs",
    "hyperparameter_problems",
    "implementation_problem",
    "kernel_refusal",
    "raise_problems",
    "validate_inputs",
]

#: How the objective is computed: the formula with autograd (the default), or the opt-in kernel of `fused.py`, eager
#: or through `torch.compile`.
IMPLEMENTATIONS = ("reference", "fused", "compiled")


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


def _checked(name: str, tensor, device: torch.device, shapes: list[tuple], expected: str) -> torch.Tensor:
    """`tensor`, if it is a tensor of one of `shapes` on `device`; else a `ValueError` naming `name`."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tuple(tensor.shape) not in shapes:
        raise ValueError(f"`{name}` has shape {tuple(tensor.shape)}, expected {expected}.")
    if tensor.device != device:
        raise ValueError(f"`{name}` is on {tensor.device}, but `logps` is on {device}; move it to the same device.")
    return tensor


def validate_inputs(
    logps, old_logps, ref_logps, advantages, completion_mask, *, beta: float, optional: dict | None = None
) -> ValidatedInputs:
    """Check the objective's tensors against `logps`; raise `ValueError` naming the first offending argument.

    Args:
        logps, old_logps, ref_logps, advantages, completion_mask: as `policy_objective` takes them.
        beta (`float`): the KL coefficient (`ref_logps=None` is allowed only when it is 0).
        optional (`dict[str, torch.Tensor | None]`, *optional*): further weights, `(N, 1)` or `(N, T)`.

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
    (rows, tokens), device = logps.shape, logps.device
    same = ([(rows, tokens)], f"{(rows, tokens)} (the shape of `logps`)")
    mask = _checked("completion_mask", completion_mask, device, *same)
    if old_logps is not None:
        _checked("old_logps", old_logps, device, *same)
    if ref_logps is None and beta > 0:
        raise ValueError(f"`ref_logps` is None but `beta` is {beta}; pass reference log-probs or set beta=0.")
    if ref_logps is not None:
        _checked("ref_logps", ref_logps, device, *same)
    per_row = [(rows, 1), (rows, tokens)]
    expected = f"({rows},), ({rows}, 1) or ({rows}, {tokens}) for `logps` of shape {(rows, tokens)}"
    advantages = _checked("advantages", advantages, device, [(rows,), *per_row], expected)
    for name, tensor in (optional or {}).items():
        if tensor is not None:
            _checked(name, tensor, device, per_row, f"({rows}, 1) or ({rows}, {tokens})")
    return ValidatedInputs(
        logps=logps,
        old_logps=None if old_logps is None else old_logps.detach(),
        ref_logps=None if ref_logps is None else ref_logps.detach(),
        advantages=advantages.detach().reshape(rows, -1),
        mask=mask if mask.dtype == torch.bool else mask != 0,
        dtype=torch.promote_types(logps.dtype, torch.float32),
    )


def implementation_problem(implementation, argument: str = "implementation") -> str | None:
    """The sentence that refuses a value that is not one of `IMPLEMENTATIONS` (naming the argument as the caller
    calls it: `"loss_implementation"` in a config), `None` for a valid one."""
    if implementation == "auto":  # a removed value: it meant the fused kernel wherever the kernel applied
        return (
            f"`{argument}='auto'` was removed: the formula, {argument}='reference', is the default; "
            f"{argument}='fused' or 'compiled' asks for the opt-in kernel."
        )
    if implementation not in IMPLEMENTATIONS:
        return f"`{argument}` must be one of {IMPLEMENTATIONS}, got {implementation!r}."
    return None


def kernel_refusal(implementation: str, problems: list[str], argument: str = "implementation") -> str:
    """The error for the fused or compiled kernel asked for outside its domain (`problems`: `fused.domain_problems`),
    naming the argument as the caller calls it."""
    return (
        f"{argument}={implementation!r} cannot compute this objective: "
        + "; ".join(problems)
        + f". Use {argument}='reference' (the default)."
    )
