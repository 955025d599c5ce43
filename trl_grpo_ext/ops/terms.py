"""The catalogue of the objective's pieces, each written once and picked by name: per-token policy terms `P`
(minimised; `-S` of the objective) and aggregations `sum_i c_i * sum_t L_it`, written as their row weights `c_i`.

A loss type (`loss_types.py`) is one of each; their formulas side by side: docs/objective.md ("Every TRL loss type").
`N` and `sum_j |o_j|` are those of the whole micro-batch: a caller that passes only some of its rows (the others add
exactly 0) gives them as `batch_rows` and `batch_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["AGGREGATIONS", "POLICY_TERMS", "aggregate"]


# Policy terms. Each returns `(P, low_clipped, high_clipped)`, `(N, T)` each; the indicators mark the flat,
# zero-gradient region of the term and are `None` for terms without one.


def clipped_term(ratio, advantages, logp, *, epsilon_low, epsilon_high, delta=None, **_):
    """PPO's clipped surrogate, with TRL's optional two-sided clipping `delta`:

        S = min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A),   P = -S

    Clipped (flat) where `r < 1 - eps_low` with `A < 0`, or `r > 1 + eps_high` with `A > 0`.
    """
    clipped_ratio = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    return -surrogate, low, high


def cispo_term(ratio, advantages, logp, *, epsilon_high, **_):
    """CISPO: the importance weight, capped and detached, scales a REINFORCE term:

        P = -sg(min(r, eps_high)) * A * logp

    "Clipped" where the cap binds for a positive advantage (`r > eps_high`, `A > 0`; TRL's `cispo_clip_ratio`).
    """
    weight = ratio.clamp(max=epsilon_high).detach()
    return -weight * advantages * logp, None, (ratio > epsilon_high) & (advantages > 0)


def sapo_term(ratio, advantages, logp, *, sapo_temperature_pos, sapo_temperature_neg, **_):
    """SAPO: a soft, temperature-controlled gate instead of a hard clip:

    P = -(4 / tau) * sigmoid(tau * (r - 1)) * A,   tau = tau_pos if A > 0 else tau_neg
    """
    temperature = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
    return -torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature * advantages, None, None


def vespo_term(ratio, advantages, logp, *, sequence_weights, **_):
    """VESPO: a detached gamma weight phi of the sequence's importance weight scales a REINFORCE term:

    P = -phi_i * A * logp     (phi from TRL's `GRPOTrainer.get_gamma_weights`, passed in)
    """
    return -sequence_weights.detach() * advantages * logp, None, None


POLICY_TERMS: dict[str, Callable] = {
    "clipped": clipped_term,
    "cispo": cispo_term,
    "sapo": sapo_term,
    "vespo": vespo_term,
}


# Aggregations, as row weights `c_i`, `(N,)`, from the completion tokens of each row `|o_i|`, `(N,)`; `batch_rows` and
# `batch_tokens` are N and sum_j |o_j| of the whole micro-batch (default: of the rows given).


def sequence_mean(tokens_per_row: torch.Tensor, denominator=None, batch_rows=None, batch_tokens=None) -> torch.Tensor:
    """`c_i = 1 / (N * |o_i|)`: `(1/N) sum_i (1/|o_i|) sum_t L_it`, each completion weighs the same."""
    rows = tokens_per_row.numel() if batch_rows is None else batch_rows
    return 1.0 / (rows * tokens_per_row.clamp(min=1))


def token_mean(tokens_per_row: torch.Tensor, denominator=None, batch_rows=None, batch_tokens=None) -> torch.Tensor:
    """`c_i = 1 / sum_j |o_j|`: `sum_it L_it / sum_i |o_i|`, each token of the micro-batch weighs the same."""
    tokens = tokens_per_row.sum() if batch_tokens is None else batch_tokens
    return torch.ones_like(tokens_per_row) / torch.as_tensor(tokens, dtype=tokens_per_row.dtype).clamp(min=1)


def sum_over_denominator(
    tokens_per_row: torch.Tensor, denominator, batch_rows=None, batch_tokens=None
) -> torch.Tensor:
    """`c_i = 1 / D`: `sum_it L_it / D`, with `D` fixed by the caller (e.g. all tokens of the accumulation window)."""
    return torch.ones_like(tokens_per_row) / denominator


def sequence_sum(tokens_per_row: torch.Tensor, denominator=None, batch_rows=None, batch_tokens=None) -> torch.Tensor:
    """`c_i = 1 / N`: `(1/N) sum_i sum_t L_it`, longer completions weigh more (LUSPO)."""
    rows = tokens_per_row.numel() if batch_rows is None else batch_rows
    return torch.full_like(tokens_per_row, 1.0 / rows)


AGGREGATIONS: dict[str, Callable] = {
    "sequence_mean": sequence_mean,
    "token_mean": token_mean,
    "sum_over_denominator": sum_over_denominator,
    "sequence_sum": sequence_sum,
}


def aggregate(per_token: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """`sum_i c_i * sum_t L_it`, 0-dim; `per_token` `(N, T)` is 0 at masked positions, `row_weights` `(N,)`."""
    return (per_token.sum(dim=-1) * row_weights).sum()
