"""The log-ratio histogram: one type for the importance ratio of the loss and for the sampler/trainer mismatch.

Ratios are binned by their logarithm, with arithmetic bin indices (no search): uniform bins `2**-12` wide for
|log r| < 0.5 (ratios in [0.61, 1.65]), geometric bins (each 7.9% of |log r| wider than the one before) out to
|log r| = 64, one bin each for what lies beyond, one for log ratios of exactly 0 (on-policy tokens, so that a
quantile among them reads exactly 1) and one for NaN. A reported quantile lies between the sample's order statistics
at that rank, widened by the width of the bins they fall in: within 2.5e-4 relative to the true value when those
order statistics lie in the core bins (ratios in [0.61, 1.65]); a quantile whose neighbouring order statistic falls
in a tail bin is only as precise as that bin (7.9% of |log r|, e.g. about 4e-2 in log space at |log r| = 0.5).
Minimum and maximum are exact.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from ..ops.numerics import EXP_LINEAR_ABOVE, exp_linear_above, log_of_exp_linear_above
from .layout import FieldLayout

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

CORE_LOG_RATIO = 0.5
CORE_BIN_WIDTH = 2.0**-12
TAIL_LOG_RATIO = 64.0
TAIL_BINS = 64
_CORE_BINS = round(2 * CORE_LOG_RATIO / CORE_BIN_WIDTH)
_TAIL_GROWTH = math.log2(TAIL_LOG_RATIO / CORE_LOG_RATIO) / TAIL_BINS  # log2 of a tail bin's width ratio
# Ordered bins: underflow, negative tail (most negative first), core below 0, exactly 0, core from 0, positive
# tail, overflow, NaN (last, left out of the quantiles).
_NEGATIVE_TAIL = 1
_CORE = _NEGATIVE_TAIL + TAIL_BINS
_ZERO = _CORE + _CORE_BINS // 2
_POSITIVE_TAIL = _CORE + _CORE_BINS + 1
_OVERFLOW = _POSITIVE_TAIL + TAIL_BINS
_NAN = _OVERFLOW + 1
NUM_BINS = _NAN + 1


def log_ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """The histogram bin of each log ratio, int64, same shape; see `log_ratio_bin_bounds` for the bins."""
    x = log_ratio
    magnitude = x.abs()
    core = torch.floor((x + CORE_LOG_RATIO) / CORE_BIN_WIDTH).clamp(0, _CORE_BINS - 1)
    core = _CORE + core + (core >= _CORE_BINS // 2).to(core.dtype)  # leave room for the exactly-0 bin
    tail = torch.floor(torch.log2(magnitude.clamp(min=CORE_LOG_RATIO) / CORE_LOG_RATIO) / _TAIL_GROWTH)
    tail = tail.clamp(0, TAIL_BINS - 1)
    tail = torch.where(x > 0, _POSITIVE_TAIL + tail, _NEGATIVE_TAIL + (TAIL_BINS - 1) - tail)
    bins = torch.where(magnitude < CORE_LOG_RATIO, core, tail)
    bins = torch.where(magnitude >= TAIL_LOG_RATIO, torch.where(x > 0, _OVERFLOW, 0), bins)
    bins = torch.where(x == 0, _ZERO, bins)
    return torch.where(torch.isnan(x), _NAN, bins).to(torch.int64)


@lru_cache(maxsize=1)
def log_ratio_bin_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """`(lower, upper)` bounds of every bin but the NaN one, ascending, float64; the outer ones are infinite."""
    powers = CORE_LOG_RATIO * 2.0 ** (_TAIL_GROWTH * torch.arange(TAIL_BINS + 1, dtype=torch.float64))
    core = -CORE_LOG_RATIO + CORE_BIN_WIDTH * torch.arange(_CORE_BINS + 1, dtype=torch.float64)
    half = _CORE_BINS // 2
    inf = torch.tensor([math.inf], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    lower = torch.cat([-inf, -powers[1:].flip(0), core[:half], zero, core[half:-1], powers[:-1], powers[-1:]])
    upper = torch.cat(
        [-powers[-1:], -powers[:-1].flip(0), core[1 : half + 1], zero, core[half + 1 :], powers[1:], inf]
    )
    return lower, upper


def quantile_metric_name(quantile: float) -> str:
    """`0.05 -> "ratio/p05"`, `0.5 -> "ratio/p50"`, `0.999 -> "ratio/p99.9"`."""
    percent = round(quantile * 100, 6)
    text = f"{percent:02.0f}" if percent == int(percent) else f"{percent:g}"
    return f"ratio/p{text}"


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
        log_ratio = log_ratio.to(dtype)
        ratio = exp_linear_above(log_ratio) if ratio is None else ratio.to(dtype)
        weights = units.reshape(-1).to(dtype)
        counts = torch.zeros(NUM_BINS, dtype=dtype, device=log_ratio.device)
        counts.index_add_(0, log_ratio_bins(log_ratio).reshape(-1), weights)
        deviation = torch.where(units, ratio - 1.0, 0.0)
        return cls.layout.pack(
            {
                "units": weights.sum(),
                "deviation_sum": deviation.sum(),
                "square_sum": deviation.pow(2).sum(),
                "min": torch.where(units, ratio, math.inf).min(),
                "max": torch.where(units, ratio, -math.inf).max(),
                "counts": counts,
            }
        )

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
