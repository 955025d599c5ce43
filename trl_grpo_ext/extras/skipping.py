"""Exact skipping of the rows that cannot move the loss (`GRPOConfigExt.skip_zero_advantage_rows`).

Without a KL term every policy term is proportional to the row's advantage, and the per-row weights are computed row
by row: a row with `A = 0` (or without completion tokens) has a zero loss and gradient. `ZeroAdvantageRowSkipping`
leaves such rows out of the training forward, and the loss keeps the whole micro-batch's denominators
(`RowSelection.policy_options`), so `loss` and `grad_norm` are those of the run without skipping, to float rounding.
Nothing is skipped where that would not hold (`skipping_problems`). A micro-batch whose rows all skip keeps one row,
its completion mask cleared (`RowSelection.carrier`): every process still runs a forward and a backward.
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
        clip_units (`torch.Tensor` of shape `(N,)`): what the clip metrics count per row (its tokens; 1 with
            sequence-level ratios).
        skipped (`int`): rows left out (N when the one row kept only carries the graph).
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
        """`out` (the kept rows' `GRPOLossOutput`) with per-row clip counts over the whole micro-batch (0 for a
        skipped row: the clip regions need `A != 0`), so that `clip_ratio/*` are those of the run without skipping."""
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
    """Selects, before the training forward, the rows of a micro-batch that can contribute to the loss (built where
    `skipping_problems` is empty).

    Args:
        importance_sampling_level (`str`): `"token"` or `"sequence"` (what the clip metrics count per row).
    """

    def __init__(self, importance_sampling_level: str):
        self.importance_sampling_level = importance_sampling_level
        self._warned_multimodal = False

    def select(self, inputs: dict[str, Any]) -> tuple[dict[str, Any], RowSelection]:
        """The rows of `inputs` (TRL's micro-batch, `(N, ...)` tensors per row) with a nonzero advantage and at least
        one completion token, and what the loss needs of the whole micro-batch: `(inputs of the rows kept,
        RowSelection)`, `inputs` itself when every row trains. One host synchronisation (the rows kept)."""
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
        if carrier:  # DDP's reduction and FSDP's or ZeRO-3's gathers need a forward and backward on every process
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
