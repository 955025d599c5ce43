"""The ratio statistics, computed beside the loss from the log ratios it returns: the count, the sums of `r - 1` and
of its square (exact for ratios near 1), the extremes and an exact histogram of `x = log r`, all sums that merge.

Bins of `x`, ascending: `x < -64`; 64 geometric bins to -0.5; 4096 uniform bins `2**-12` wide over [-0.5, 0.5), with
`x == 0` in a bin of its own; 64 geometric bins to 64; `x >= 64`; NaN. Their precision: docs/diagnostics.md
("Quantile resolution").
"""

from __future__ import annotations

import functools
import math

import torch

from ..metrics import RATIO_PREFIX
from ..ops.numerics import EXP_LINEAR_ABOVE, exp_linear_above, log_of_exp_linear_above

__all__ = [
    "CORE_BIN_WIDTH",
    "CORE_LOG_RATIO",
    "NUM_BINS",
    "RATIO_FIELDS",
    "TAIL_LOG_RATIO",
    "histogram_quantiles",
    "log_ratio_bin_bounds",
    "log_ratio_bins",
    "quantile_metric_name",
    "ratio_sums",
    "summarize_ratios",
]

CORE_LOG_RATIO = 0.5
CORE_BIN_WIDTH = 2.0**-12
TAIL_LOG_RATIO = 64.0
TAIL_BINS = 64
_CORE_BINS = round(2 * CORE_LOG_RATIO / CORE_BIN_WIDTH)
_TAIL_OCTAVES = math.log2(TAIL_LOG_RATIO / CORE_LOG_RATIO)


@functools.lru_cache(maxsize=8)
def _edges(device: torch.device | str = "cpu") -> torch.Tensor:
    """The inner bin edges, ascending, float32 (so that a float32 log ratio and its bin's bounds compare exactly),
    made on `device` (a copy from the host would wait for it)."""
    octaves = torch.arange(1, TAIL_BINS + 1, dtype=torch.float64, device=device) / TAIL_BINS
    tail = CORE_LOG_RATIO * (TAIL_LOG_RATIO / CORE_LOG_RATIO) ** octaves  # 0.5 * 1.079, ..., 64
    core = torch.arange(-(_CORE_BINS // 2), _CORE_BINS // 2 + 1, device=device) * CORE_BIN_WIDTH
    return torch.cat([-tail.flip(0), core, tail]).float()


ZERO_BIN = TAIL_BINS + _CORE_BINS // 2 + 1  # the bin of [0, 2**-12) between the edges: x == 0 only
NUM_BINS = len(_edges()) + 3  # the edges' bins, the x == 0 bin, NaN
#: The fields of a set of ratios' statistics, with the reductions that merge them (`fields.FieldLayout`).
RATIO_FIELDS = [
    ("units", "sum"),
    ("deviation_sum", "sum"),
    ("square_sum", "sum"),
    ("min", "min"),
    ("max", "max"),
    ("counts", "sum", NUM_BINS),
]


def log_ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """The bin of each log ratio, int64, same shape. Device operations only.

    The bin is computed from the value (a floor of `x / 2**-12` in the core, of the log of `|x|` in the tails), then
    moved one bin where that rounded across an edge, so that every value lies within its bin's bounds: what a binary
    search over the edges (`torch.bucketize`) gives, at a fraction of its cost on a CPU.
    """
    x = log_ratio if log_ratio.dtype == torch.float64 else log_ratio.float()
    finite = torch.nan_to_num(x, nan=0.0, posinf=2 * TAIL_LOG_RATIO, neginf=-2 * TAIL_LOG_RATIO)
    magnitude = finite.abs()
    tail = torch.log2(magnitude.clamp(min=CORE_LOG_RATIO) / CORE_LOG_RATIO) * (TAIL_BINS / _TAIL_OCTAVES)
    tail = tail.floor_().clamp_(max=TAIL_BINS)  # 0 .. 63 in the tails, 64 beyond them
    core = torch.floor(finite / CORE_BIN_WIDTH) + ZERO_BIN
    edge_bins = torch.where(finite > 0, ZERO_BIN + _CORE_BINS // 2 + tail, TAIL_BINS - tail)
    bins = torch.where(magnitude < CORE_LOG_RATIO, core, edge_bins).long().clamp_(0, NUM_BINS - 3)
    lower, upper = _edge_bounds(x.device, x.dtype)
    bins = bins - (finite < lower[bins]).long() + (finite >= upper[bins]).long()
    return torch.where(torch.isnan(x), NUM_BINS - 1, bins + (x > 0))


@functools.lru_cache(maxsize=8)
def _edge_bounds(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """`(lower, upper)` of the bins between the edges, before the `x == 0` bin is set apart, on `device`."""
    edges, infinite = _edges(device).to(dtype), torch.full((1,), math.inf, dtype=dtype, device=device)
    return torch.cat([-infinite, edges]), torch.cat([edges, infinite])


@functools.lru_cache(maxsize=1)
def log_ratio_bin_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """`(lower, upper)` bounds of every bin but the NaN one, float64: `lower <= x < upper` (the `x == 0` bin:
    `[0, 0]`); the outer ones are infinite."""
    zero = torch.zeros(1, dtype=torch.float64)
    lower, upper = _edge_bounds(dtype=torch.float64)
    return torch.cat([lower[:ZERO_BIN], zero, lower[ZERO_BIN:]]), torch.cat([upper[:ZERO_BIN], zero, upper[ZERO_BIN:]])


def ratio_sums(log_ratio: torch.Tensor, units: torch.Tensor, dtype: torch.dtype, ratio=None) -> dict:
    """The `RATIO_FIELDS` of one batch of ratios, in `dtype`. Device operations only.

    Args:
        log_ratio (`torch.Tensor` of any shape): the log ratios; any values where `units` is False.
        units (`torch.Tensor`, bool, same shape): the entries that count.
        dtype (`torch.dtype`): the accumulation dtype.
        ratio (`torch.Tensor`, same shape, *optional*): `exp_linear_above(log_ratio)` where already computed.
    """
    ratio = exp_linear_above(log_ratio.to(dtype)) if ratio is None else ratio.to(dtype)
    deviation = torch.where(units, ratio - 1.0, 0.0)
    bins = torch.where(units, log_ratio_bins(log_ratio), NUM_BINS).flatten()  # one bin past the last: dropped
    counts = torch.zeros(NUM_BINS + 1, dtype=dtype, device=bins.device)
    counts.index_add_(0, bins, torch.ones((), dtype=dtype, device=bins.device).expand(bins.shape))
    return {
        "units": units.sum().to(dtype),
        "deviation_sum": deviation.sum(),
        "square_sum": (deviation * deviation).sum(),
        "min": torch.where(units, ratio, math.inf).amin(),
        "max": torch.where(units, ratio, -math.inf).amax(),
        "counts": counts[:NUM_BINS],
    }


def summarize_ratios(values: dict[str, torch.Tensor], quantiles: list[float], histogram: bool) -> dict | None:
    """The statistics of merged `RATIO_FIELDS` values, `None` when no ratio counted.

    Returns:
        `dict` with `mean`, `std`, `min`, `max`, `quantiles` (one value per quantile), `nan_count`, `units` and, when
        asked, `histogram`: `(bucket upper limits, counts, min, max, number, sum, sum of squares)`.
    """
    counts = values["counts"].to(torch.float64).cpu()
    total = counts[:-1].sum().item()  # without the NaN bin
    if total == 0:
        return None
    deviation_sum, square_sum = values["deviation_sum"].item(), values["square_sum"].item()
    minimum, maximum = values["min"].item(), values["max"].item()
    variance = (square_sum - deviation_sum**2 / total) / (total - 1) if total > 1 else 0.0
    lower, upper = log_ratio_bin_bounds()
    log_extremes = log_of_exp_linear_above(minimum), log_of_exp_linear_above(maximum)
    log_quantiles = torch.tensor(histogram_quantiles(counts[:-1], lower, upper, quantiles, *log_extremes))
    ratios = exp_linear_above(log_quantiles.double()).clamp(minimum, maximum).tolist()
    result = {
        "units": values["units"].item(),
        "mean": 1.0 + deviation_sum / total,
        "std": math.sqrt(max(variance, 0.0)),
        "min": minimum,
        "max": maximum,
        "quantiles": [_exact_extremes(value, q, minimum, maximum) for value, q in zip(ratios, quantiles, strict=True)],
        "nan_count": counts[-1].item(),
    }
    if histogram:
        squares = total + 2.0 * deviation_sum + square_sum
        buckets = _ratio_buckets(counts[:-1], upper, minimum, maximum)
        result["histogram"] = (*buckets, minimum, maximum, total, total + deviation_sum, squares)
    return result


def _exact_extremes(value: float, quantile: float, minimum: float, maximum: float) -> float:
    """The 0 and 1 quantiles are the extremes, not their logarithms' exponential (one rounding away)."""
    return minimum if quantile <= 0 else maximum if quantile >= 1 else value


def histogram_quantiles(
    counts: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    quantiles: list[float],
    minimum: float,
    maximum: float,
) -> list[float]:
    """Quantiles of the values behind a histogram: each at its rank `q * (n - 1)` among the values in order (as
    `torch.quantile`), the values inside a bin taken as evenly spread over it.

    Args:
        counts (`torch.Tensor` of shape `(K,)`): counts per bin, bins in ascending order.
        lower, upper (`torch.Tensor` of shape `(K,)`): the bins' bounds (infinite for the outer bins).
        quantiles (`list[float]`): in [0, 1].
        minimum, maximum (`float`): the exact extremes of the values, which bound the outer bins.

    Returns:
        `list[float]`: one value per quantile, within the bin of the order statistic below its rank; the 0 and 1
        quantiles are `minimum` and `maximum`.
    """
    counts = counts.to(torch.float64).cpu()
    total = counts.sum().item()
    if total == 0:
        return [math.nan] * len(quantiles)
    ranks = torch.tensor(quantiles, dtype=torch.float64) * (total - 1)
    cumulative = counts.cumsum(0)
    index = torch.searchsorted(cumulative, ranks, right=True).clamp(max=counts.numel() - 1)
    low = lower.cpu()[index].clamp(minimum, maximum)
    high = torch.maximum(upper.cpu()[index].clamp(max=maximum), low)
    position = ((ranks - cumulative[index] + counts[index] + 0.5) / counts[index]).clamp(max=1.0)
    values = torch.where(ranks >= total - 1, maximum, low + position * (high - low))
    return torch.where(ranks <= 0, minimum, values).tolist()


def _ratio_buckets(counts: torch.Tensor, upper_log_edges: torch.Tensor, minimum: float, maximum: float) -> tuple:
    """`(bucket upper limits in ratio units, counts)`: at most 64 buckets over the occupied bins."""
    occupied = counts.nonzero().flatten()
    first, last = occupied[0].item(), occupied[-1].item()
    group = max(1, math.ceil((last - first + 1) / 64))
    span = counts[first : last + 1]
    bucket_counts = torch.nn.functional.pad(span, (0, -span.numel() % group)).reshape(-1, group).sum(dim=1)
    ends = (torch.arange(first, last + 1, group) + group - 1).clamp(max=last)
    limits = exp_linear_above(upper_log_edges[ends].clamp(max=EXP_LINEAR_ABOVE)).clamp(max=maximum)
    limits[-1] = maximum  # ratios beyond e^20 end at the maximum
    return limits.tolist(), bucket_counts.tolist()


def quantile_metric_name(quantile: float) -> str:
    """`0.05 -> "ratio/p05"`, `0.5 -> "ratio/p50"`, `0.999 -> "ratio/p99.9"`."""
    percent = round(quantile * 100, 6)
    text = f"{percent:02.0f}" if percent == int(percent) else f"{percent:g}"
    return f"{RATIO_PREFIX}p{text}"
