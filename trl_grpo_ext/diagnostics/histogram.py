"""The log-ratio histogram: one type for the importance ratio of the loss and for the sampler/trainer mismatch.

The sums and the bins are those of `ops.ratio_statistics` (where the loss kernel adds them up while it computes the
ratios): ratios are binned by their logarithm, uniform bins `2**-12` wide for |log r| < 0.5 (ratios in
[0.61, 1.65]), geometric bins (each about 7.9% of |log r| wider than the one before, their edges on the float32 grid
of 10 mantissa bits) out to |log r| = 64, one bin each for what lies beyond, one for log ratios of 0 (on-policy tokens,
so that a quantile among them reads exactly 1; it also holds the float32 denormals below `2**-136`, whose ratio is 1
too) and one for NaN. A reported quantile lies between the sample's order statistics at that rank, widened by the
width of the bins they fall in: within 2.5e-4 relative to the true value when those order statistics lie in the core
bins (ratios in [0.61, 1.65]); a quantile whose neighbouring order statistic falls in a tail bin is only as precise
as that bin (7.9% of |log r|, e.g. about 4e-2 in log space at |log r| = 0.5). Minimum and maximum are exact.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..metrics import RATIO_PREFIX
from ..ops.numerics import EXP_LINEAR_ABOVE, exp_linear_above, log_of_exp_linear_above
from ..ops.ratio_statistics import (
    CORE_BIN_WIDTH,
    CORE_LOG_RATIO,
    NUM_BINS,
    TAIL_LOG_RATIO,
    RatioStatistics,
    log_ratio_bin_bounds,
    log_ratio_bins,
    ratio_statistics,
)
from .fields import FieldLayout

__all__ = [
    "CORE_BIN_WIDTH",
    "CORE_LOG_RATIO",
    "NUM_BINS",
    "TAIL_LOG_RATIO",
    "LogRatioHistogram",
    "histogram_quantiles",
    "log_ratio_bin_bounds",
    "log_ratio_bins",
    "quantile_metric_name",
]


def quantile_metric_name(quantile: float) -> str:
    """`0.05 -> "ratio/p05"`, `0.5 -> "ratio/p50"`, `0.999 -> "ratio/p99.9"`."""
    percent = round(quantile * 100, 6)
    text = f"{percent:02.0f}" if percent == int(percent) else f"{percent:g}"
    return f"{RATIO_PREFIX}p{text}"


def histogram_quantiles(
    counts: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    quantiles: list[float],
    minimum: float,
    maximum: float,
) -> list[float]:
    """Quantiles of the values behind a histogram, as `torch.quantile` (linear interpolation) would give them.

    Args:
        counts (`torch.Tensor` of shape `(K,)`): counts per bin, bins in ascending order.
        lower, upper (`torch.Tensor` of shape `(K,)`): the bins' bounds (infinite for the outer bins).
        quantiles (`list[float]`): in [0, 1].
        minimum, maximum (`float`): the exact extremes of the values, which bound the outer bins.

    Returns:
        `list[float]`: one value per quantile. The values inside a bin are taken as evenly spread over it, so each
        result is within one bin width of the sample's order statistics at that rank; the 0 and 1 quantiles are
        exactly `minimum` and `maximum`.
    """
    counts = counts.to(torch.float64).cpu().numpy()
    lower, upper = lower.cpu().numpy(), upper.cpu().numpy()
    total = int(counts.sum())
    if total == 0:
        return [math.nan] * len(quantiles)
    cumulative = counts.cumsum()

    def value_at_rank(rank: int) -> float:
        if rank <= 0:
            return minimum
        if rank >= total - 1:
            return maximum
        index = int(np.searchsorted(cumulative, rank, side="right"))
        before = float(cumulative[index - 1]) if index > 0 else 0.0
        low = min(max(float(lower[index]), minimum), maximum)
        high = max(min(float(upper[index]), maximum), low)
        position = (rank - before + 0.5) / float(counts[index])
        return low + position * (high - low)

    results = []
    for quantile in quantiles:
        position = quantile * (total - 1)
        below = math.floor(position)
        fraction = position - below
        value = value_at_rank(below)
        if fraction > 0:
            value += fraction * (value_at_rank(below + 1) - value)
        results.append(value)
    return results


def _ratio_histogram(counts: torch.Tensor, upper_log_edges: torch.Tensor, minimum: float, maximum: float) -> tuple:
    """(bucket upper limits in ratio units, counts, minimum, maximum): at most 64 buckets over the occupied bins."""
    counts_array = counts.numpy()
    occupied = np.flatnonzero(counts_array)
    first, last = int(occupied[0]), int(occupied[-1])
    group = max(1, math.ceil((last - first + 1) / 64))
    starts = np.arange(first, last + 1, group)
    bucket_counts = np.add.reduceat(counts_array[first : last + 1], starts - first)
    ends = np.minimum(starts + group, last + 1) - 1
    log_limits = np.minimum(upper_log_edges.numpy()[ends], EXP_LINEAR_ABOVE)  # ratios beyond e^20 end at the max
    bucket_limits = np.minimum(np.exp(log_limits), maximum)
    bucket_limits[-1] = maximum
    return bucket_limits.tolist(), bucket_counts.tolist(), minimum, maximum


def _ratio_of_log(log_value: float) -> float:
    """Inverse of `log_of_exp_linear_above`: the ratio whose (linearly continued) logarithm is `log_value`."""
    return math.exp(min(log_value, EXP_LINEAR_ABOVE)) * (1.0 + max(log_value - EXP_LINEAR_ABOVE, 0.0))


class LogRatioHistogram:
    """The distribution of a set of importance ratios, as sums on the device that merge by field.

    `measure` turns one batch of log ratios into a packed vector of `layout`; vectors of several micro-batches merge
    (`layout.merge`) and those of every process reduce (`layout.reduce`); `summarize` reads the statistics off the
    result. The moments are kept as sums of `r - 1`, which stay exact for ratios near 1.
    """

    layout = FieldLayout(
        [
            ("units", "sum"),
            ("deviation_sum", "sum"),
            ("square_sum", "sum"),
            ("min", "min"),
            ("max", "max"),
            ("counts", "sum", NUM_BINS),
        ]
    )

    @classmethod
    def measure(
        cls, log_ratio: torch.Tensor, units: torch.Tensor, dtype: torch.dtype, ratio: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One batch as a packed vector. Device ops only.

        Args:
            log_ratio (`torch.Tensor` of any shape): the log ratios.
            units (`torch.Tensor`, bool, same shape): the entries that count.
            dtype: the accumulation dtype.
            ratio (`torch.Tensor`, same shape, *optional*): `exp_linear_above(log_ratio)` where already computed.
        """
        if ratio is None:
            log_ratio = log_ratio.to(dtype)
            ratio = exp_linear_above(log_ratio)
        # What `ratio_statistics` expects where an entry does not count: log ratio 0, ratio 1.
        log_ratio, ratio = torch.where(units, log_ratio, 0.0), torch.where(units, ratio, 1.0)
        return cls.pack(ratio_statistics(log_ratio, ratio, units.to(ratio.dtype)), dtype)

    @classmethod
    def pack(cls, statistics: RatioStatistics, dtype: torch.dtype) -> torch.Tensor:
        """`RatioStatistics` (of the loss kernel, or of `measure`) as a packed vector in `dtype`."""
        return cls.layout.pack({name: value.to(dtype) for name, value in statistics._asdict().items()})

    @classmethod
    def empty(cls, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The packed vector of no ratios at all (merges with any other as if absent)."""
        return cls.measure(torch.zeros(1, device=device), torch.zeros(1, dtype=torch.bool, device=device), dtype)

    @staticmethod
    def summarize(values: dict[str, torch.Tensor], quantiles: list[float], histogram: bool) -> dict | None:
        """The statistics of reduced `values` (`layout.unpack` of a reduced vector), `None` when no ratio counted.

        Returns:
            `dict` with `mean`, `std`, `min`, `max`, `quantiles` (one value per quantile), `nan_count`, `units` and,
            when asked, `histogram`: `(bucket upper limits, counts, min, max, number, sum, sum of squares)`.
        """
        counts = values["counts"].to(torch.float64).cpu()
        finite_counts = counts[:-1]  # without the NaN bin
        total = finite_counts.sum().item()
        if total == 0:
            return None
        deviation_sum, square_sum = values["deviation_sum"].item(), values["square_sum"].item()
        minimum, maximum = values["min"].item(), values["max"].item()
        mean_deviation = deviation_sum / total
        variance = (square_sum - total * mean_deviation**2) / (total - 1) if total > 1 else 0.0
        lower, upper = log_ratio_bin_bounds()
        log_min, log_max = log_of_exp_linear_above(minimum), log_of_exp_linear_above(maximum)
        log_quantiles = histogram_quantiles(finite_counts, lower, upper, quantiles, log_min, log_max)
        result = {
            "units": values["units"].item(),
            "mean": 1.0 + mean_deviation,
            "std": math.sqrt(max(variance, 0.0)),
            "min": minimum,
            "max": maximum,
            "quantiles": [min(max(_ratio_of_log(value), minimum), maximum) for value in log_quantiles],
            "nan_count": counts[-1].item(),
        }
        if histogram:
            ratio_sum = total + deviation_sum
            ratio_squares = total + 2.0 * deviation_sum + square_sum
            result["histogram"] = (*_ratio_histogram(finite_counts, upper, minimum, maximum), total, ratio_sum)
            result["histogram"] += (ratio_squares,)
        return result
