"""The log-prob forward of every step: rows packed without padding (`logprobs`), the layout and the token counts of
the waste it removes (`layout`)."""

from .layout import (
    FORWARD_METRICS,
    ForwardCounts,
    PackedLayout,
    forward_counts,
    pack_rows,
    row_spans,
    unpackable_reason,
)
from .logprobs import PackedLogProbs, SelfCheck, run_fallback_reason

__all__ = [
    "FORWARD_METRICS",
    "ForwardCounts",
    "PackedLayout",
    "PackedLogProbs",
    "SelfCheck",
    "forward_counts",
    "pack_rows",
    "row_spans",
    "run_fallback_reason",
    "unpackable_reason",
]
