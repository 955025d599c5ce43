"""Exact skipping of the rows that cannot move the loss (`GRPOConfigExt.skip_zero_advantage_rows`).

Why it is exact. Without a KL term (`beta == 0`) the per-token loss of row i is `L_it = w_it * P_it`, and every policy
term of the catalogue (`ops/terms.py`) is proportional to the row's advantage `A_i`:

    clipped: P = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)     cispo: P = -sg(min(r, eps_high)) A logp
    sapo:    P = -(4 / tau) sigmoid(tau (r - 1)) A                   vespo: P = -sg(phi) A logp

so a row with `A_i = 0` has `L_it = 0` and `dL_it / dtheta = 0` at every token, whatever its ratios; a row without
completion tokens adds nothing either. The weights `w` (off-policy mask, vLLM correction) and VESPO's `phi` are
computed row by row. Left out of the forward and the backward, such rows change neither the loss nor its gradient,
provided the aggregation still normalises over the whole micro-batch: `policy_objective(batch_rows=N,
batch_tokens=sum_j |o_j|)` for `sequence_mean` (grpo, sapo), `sequence_sum` (luspo) and `token_mean` (bnpo), and
`gather_objective_inputs(num_rows=N)` for dr_grpo's divisor `N * max_completion_length`; the window divisors of dapo,
cispo and vespo count the whole window already. `loss` and `grad_norm` then equal those of the run without skipping,
to float rounding (the same sums in another order, the forward on a smaller batch).

It does not hold, and nothing is skipped (`skipping_problems` says why, once), with a KL term (`beta != 0`: every
row has a gradient), an entropy bonus or a router loss (means over every row), or an entropy-quantile mask
(`top_entropy_quantile < 1`: its threshold is a quantile over every row's tokens). A multimodal micro-batch (image
tensors that are not one per row) is trained whole.

Distributed training needs every process to run a forward and a backward through every parameter (DDP's gradient
reduction, FSDP's and ZeRO-3's parameter gathers wait for all processes). A micro-batch whose rows all skip keeps one
row, its completion mask cleared: an exact 0 loss connected to the graph, whose zero gradients are reduced like any.

Metrics: `skipped_rows/fraction` is the share of rows left out. `clip_ratio/*` stay exact (a skipped row has no
clipped token, and its tokens still count in the denominator); `entropy`, the ratio distribution (`ratio/*`) and
`vespo/phi_seq_mean` describe the rows that trained: a micro-batch whose rows all skipped (on every process) adds
no entropy, and its carrier row no `phi`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.utils import logging

from .._compat import FORWARD_KEYS

__all__ = ["RowSelection", "ZeroAdvantageRowSkipping", "row_skipping", "skipping_problems"]

logger = logging.get_logger(__name__)


def row_skipping(trainer) -> ZeroAdvantageRowSkipping | None:
    """The row skipping of `trainer`'s run (`skip_zero_advantage_rows` on): `None`, with one warning saying why, when
    leaving zero-advantage rows out would change the gradient (`skipping_problems`)."""
    problems = skipping_problems(trainer)
    if problems:
        logger.warning(
            "skip_zero_advantage_rows=True does nothing in this run: leaving zero-advantage rows out would "
            "change the gradient, because " + "; ".join(problems) + "."
        )
        return None
    return ZeroAdvantageRowSkipping(trainer.importance_sampling_level)


def skipping_problems(trainer) -> list[str]:
    """Why leaving zero-advantage rows out would change the gradient under the trainer's options (empty: it would
    not)."""
    problems = []
    if trainer.beta != 0.0:
        problems.append(f"beta={trainer.beta}: the KL term gives every row a gradient (set beta=0.0)")
    if trainer._entropy_bonus_enabled:
        problems.append("the entropy bonus (entropy_coef, use_adaptive_entropy) is a mean over every row's tokens")
    if trainer.aux_loss_enabled:
        problems.append("the Mixture-of-Experts router loss depends on every row")
    if trainer.top_entropy_quantile < 1.0:
        problems.append(
            f"top_entropy_quantile={trainer.top_entropy_quantile}: the entropy mask's threshold is a quantile over "
            "every row's tokens"
        )
    return problems


@dataclass
class RowSelection:
    """Which rows of a micro-batch go through the training forward.

    Attributes:
        rows (`torch.Tensor` of shape `(K,)` or `None`): indices of the rows kept, in order; `None`: all of them.
        num_rows (`int`): N, the rows of the whole micro-batch.
        num_tokens (`torch.Tensor` of shape `()`): completion tokens of the whole micro-batch (the loss mask).
        clip_units (`torch.Tensor` of shape `(N,)`): what the clip metrics count per row of the whole micro-batch
            (its tokens; 1 with sequence-level ratios, as TRL counts).
        skipped (`int`): rows left out (N when the one row kept is only there to carry the graph).
    """

    rows: torch.Tensor | None
    num_rows: int
    num_tokens: torch.Tensor
    clip_units: torch.Tensor
    skipped: int

    @property
    def carrier(self) -> bool:
        """Every row was skipped: the one row kept only carries the graph (its completion mask cleared)."""
        return self.rows is not None and self.skipped == self.num_rows

    def policy_options(self) -> dict[str, Any]:
        """The whole micro-batch's counts, for `ops.policy_objective`."""
        return {"batch_rows": self.num_rows, "batch_tokens": self.num_tokens}

    def skipped_fraction(self) -> tuple[torch.Tensor, int]:
        """`(rows skipped, rows)`, the `(sum, count)` pair of the `skipped_rows/fraction` metric."""
        return torch.full((), float(self.skipped), device=self.num_tokens.device), self.num_rows

    def with_whole_batch_clip_counts(self, out):
        """`out` (the kept rows' `GRPOLossOutput`) with per-row clip counts over the whole micro-batch: zeros for the
        rows skipped (no clipped token: the clip regions need `A != 0`), and their units, so that `clip_ratio/*` are
        those of the run without skipping."""
        if self.rows is None:
            return out

        def whole(per_row: torch.Tensor) -> torch.Tensor:
            return per_row.new_zeros(self.num_rows).index_copy(0, self.rows, per_row)

        return replace(
            out,
            low_clipped_per_row=whole(out.low_clipped_per_row),
            high_clipped_per_row=whole(out.high_clipped_per_row),
            clip_units_per_row=self.clip_units.to(out.clip_units_per_row.dtype),
        )


class ZeroAdvantageRowSkipping:
    """Selects, before the training forward, the rows of a micro-batch that can contribute to the loss.

    Build it only where `skipping_problems` is empty.

    Args:
        importance_sampling_level (`str`): `"token"` or `"sequence"` (what the clip metrics count per row).
    """

    def __init__(self, importance_sampling_level: str):
        self.importance_sampling_level = importance_sampling_level
        self._warned_multimodal = False

    def select(self, inputs: dict[str, Any]) -> tuple[dict[str, Any], RowSelection]:
        """The rows of `inputs` with a nonzero advantage and at least one completion token, and what the loss needs
        of the whole micro-batch. One host synchronisation (the number of rows kept).

        Args:
            inputs (`dict`): TRL's micro-batch: `(N, ...)` tensors per row, and `num_items_in_batch`.

        Returns:
            `(inputs of the rows kept, RowSelection)`; `inputs` itself when every row trains.
        """
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        num_rows = mask.size(0)
        tokens = mask.sum(dim=1)
        if self.importance_sampling_level == "sequence":
            clip_units = torch.ones_like(tokens)
        else:
            clip_units = tokens
        whole = RowSelection(None, num_rows, tokens.sum(), clip_units, 0)
        if any(inputs.get(key) is not None for key in FORWARD_KEYS):
            if not self._warned_multimodal:
                logger.warning(
                    "skip_zero_advantage_rows: a multimodal micro-batch (image inputs) is trained whole; its image "
                    "tensors are not one per row."
                )
                self._warned_multimodal = True
            return inputs, whole
        advantages = inputs["advantages"].reshape(num_rows, -1)
        trains = (advantages != 0).any(dim=1) & (tokens > 0)
        rows = trains.nonzero().squeeze(1)
        kept = rows.numel()
        if kept == num_rows:
            return inputs, whole
        carrier = kept == 0
        if carrier:  # one row keeps the forward and backward going through every parameter (see the module)
            rows = rows.new_zeros(1)
        selected = {
            key: value.index_select(0, rows) if _is_per_row(value, num_rows) else value
            for key, value in inputs.items()
        }
        if carrier:
            selected["completion_mask"] = torch.zeros_like(selected["completion_mask"])
        return selected, RowSelection(rows, num_rows, whole.num_tokens, clip_units, num_rows - kept)


def _is_per_row(value: Any, num_rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == num_rows
