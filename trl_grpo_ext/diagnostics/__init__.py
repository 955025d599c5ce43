"""Training diagnostics: the importance-ratio distribution, clip fractions, reward spread inside groups, loss split.

- `layout`: named fields of a flat vector, each with its reduction (`FieldLayout`);
- `histogram`: the log-ratio histogram (`LogRatioHistogram`), for the loss's ratios and the sampler mismatch;
- `rewards`: the reward spread inside groups and the length/reward correlation, read at a log step;
- `accumulator`: the running sums between two log steps, one gather per log step (`DiagnosticsAccumulator`);
- `loggers`: histograms to the loggers that draw them.
"""

from .accumulator import LOSS_TERMS, DiagnosticsAccumulator, DiagnosticsSummary
from .histogram import (
    CORE_BIN_WIDTH,
    CORE_LOG_RATIO,
    NUM_BINS,
    TAIL_LOG_RATIO,
    LogRatioHistogram,
    histogram_quantiles,
    log_ratio_bin_bounds,
    log_ratio_bins,
    quantile_metric_name,
)
from .layout import FieldLayout

__all__ = [
    "CORE_BIN_WIDTH",
    "CORE_LOG_RATIO",
    "LOSS_TERMS",
    "NUM_BINS",
    "TAIL_LOG_RATIO",
    "DiagnosticsAccumulator",
    "DiagnosticsSummary",
    "FieldLayout",
    "LogRatioHistogram",
    "histogram_quantiles",
    "log_ratio_bin_bounds",
    "log_ratio_bins",
    "quantile_metric_name",
]
