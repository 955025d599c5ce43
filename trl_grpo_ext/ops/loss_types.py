"""One record per TRL `loss_type`: everything the objective, the trainer and the diagnostics need to know of it.

| loss_type | policy term | aggregation | divisor `D` | normalised over | clip metrics |
| --- | --- | --- | --- | --- | --- |
| grpo | clipped | sequence_mean | | micro-batch | clip_ratio |
| bnpo | clipped | token_mean | | micro-batch | clip_ratio |
| dr_grpo | clipped | sum_over_denominator | N * max_completion_length | micro-batch | clip_ratio |
| dapo | clipped | sum_over_denominator | completion tokens of the window | window | clip_ratio |
| luspo | clipped | sequence_sum | | micro-batch | clip_ratio |
| cispo | cispo | sum_over_denominator | completion tokens of the window | window | cispo |
| sapo | sapo | sequence_mean | | micro-batch | none |
| vespo | vespo | sum_over_denominator | completion tokens of the window | window | none |

"window": the divisor already counts every completion token of the gradient-accumulation window, so the micro-batch
loss is final as it is; "micro-batch": the loss is a per-micro-batch mean, divided by the accumulation steps before
backward (as TRL 1.16's `GRPOTrainer._compute_loss` does for each loss type).
"""

from __future__ import annotations

from dataclasses import dataclass

from .terms import AGGREGATIONS, POLICY_TERMS

__all__ = ["CLIP_METRICS", "DIVISORS", "LOSS_TYPES", "LossType", "loss_type_record"]

#: Which clip metrics a loss type logs, under TRL's names: "clip_ratio" (`clip_ratio/low_mean`, ... of the clipped
#: surrogate), "cispo" (`cispo_clip_ratio`), or "none".
CLIP_METRICS = ("clip_ratio", "cispo", "none")
#: How the trainer computes `D` of `sum_over_denominator`: "window_tokens" (the completion tokens of one accumulation
#: window, from TRL's `num_items_in_batch`) or "rows_times_max_length" (`N * max_completion_length`).
DIVISORS = ("window_tokens", "rows_times_max_length")


@dataclass(frozen=True)
class LossType:
    """What a `loss_type` is made of.

    Attributes:
        name (`str`): TRL's name.
        policy_term (`str`): a key of `terms.POLICY_TERMS`.
        aggregation (`str`): a key of `terms.AGGREGATIONS`.
        divisor (`str` or `None`): a key of `DIVISORS` for `sum_over_denominator`, else `None`.
        clip_metrics (`str`): one of `CLIP_METRICS`.
        needs_sequence_weights (`bool`): the term takes per-sequence weights (VESPO's gamma weights).
        extra_metrics (`tuple[str, ...]`): metrics TRL logs for this loss type only.
    """

    name: str
    policy_term: str
    aggregation: str
    divisor: str | None = None
    clip_metrics: str = "clip_ratio"
    needs_sequence_weights: bool = False
    extra_metrics: tuple[str, ...] = ()

    def __post_init__(self):
        if self.policy_term not in POLICY_TERMS or self.aggregation not in AGGREGATIONS:
            raise ValueError(f"{self.name}: unknown policy term or aggregation.")
        if (self.aggregation == "sum_over_denominator") != (self.divisor in DIVISORS):
            raise ValueError(f"{self.name}: `sum_over_denominator` needs a divisor, and only it has one.")
        if self.clip_metrics not in CLIP_METRICS:
            raise ValueError(f"{self.name}: `clip_metrics` must be one of {CLIP_METRICS}.")

    @property
    def window_normalised(self) -> bool:
        """Whether the loss is divided by a count of the whole accumulation window (then not again by its steps)."""
        return self.divisor == "window_tokens"


LOSS_TYPES: dict[str, LossType] = {
    record.name: record
    for record in (
        LossType("grpo", "clipped", "sequence_mean"),
        LossType("bnpo", "clipped", "token_mean"),
        LossType("dr_grpo", "clipped", "sum_over_denominator", divisor="rows_times_max_length"),
        LossType("dapo", "clipped", "sum_over_denominator", divisor="window_tokens"),
        LossType("luspo", "clipped", "sequence_sum"),
        LossType("cispo", "cispo", "sum_over_denominator", divisor="window_tokens", clip_metrics="cispo"),
        LossType("sapo", "sapo", "sequence_mean", clip_metrics="none"),
        LossType(
            "vespo",
            "vespo",
            "sum_over_denominator",
            divisor="window_tokens",
            clip_metrics="none",
            needs_sequence_weights=True,
            extra_metrics=("vespo/phi_seq_mean",),
        ),
    )
}


def loss_type_record(name: str) -> LossType:
    """The record of `name`; `ValueError` naming the known ones for any other."""
    if name not in LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {tuple(LOSS_TYPES)}, got {name!r}.")
    return LOSS_TYPES[name]
