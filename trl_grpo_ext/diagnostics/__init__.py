"""Training diagnostics, observers of the loss and the rewards: `fields` (named fields of one flat vector),
`histogram` (the ratio statistics, computed beside the loss from its log ratios), `rewards` (the reward spread inside
groups, the length/reward correlation), `accumulator` (the running sums, one gather per log step), `mismatch` (the
sampler/trainer mismatch with vLLM), `loggers` (histograms to the loggers that draw them)."""

from .accumulator import DiagnosticsAccumulator, DiagnosticsSummary
from .histogram import CORE_BIN_WIDTH

__all__ = ["CORE_BIN_WIDTH", "DiagnosticsAccumulator", "DiagnosticsSummary"]
