"""The importance ratios' statistics, as sums that merge: count, moments, extremes and a histogram of the log ratio.

What the diagnostics log about the ratios of the loss (`ratio/mean`, `ratio/std`, `ratio/min`, `ratio/max`, the
`ratio/pXX` quantiles and the histogram) is read off these sums (`diagnostics.histogram.LogRatioHistogram`). They are
computed here, in the ops layer, so that the loss kernel (`fused.py`) can add them up block by block while the
ratios are in the cache, instead of writing per-token ratios for a second pass to read.

Bins of the log ratio `x = log r`, in ascending order (`log_ratio_bin_bounds` gives their bounds):

- one for `x <= -64` (and `-inf`), 64 geometric bins for `-64 < x <= -0.5` (each 7.9% of |x| wider than the one
  nearer 0), 2048 uniform bins `2**-12` wide below 0, one for `x` = 0, 2048 uniform bins above 0, 64 geometric bins
  up to 64, one for `x >= 64` (and `inf`), and one for NaN (last, left out of the quantiles).

A bin is found without arithmetic on the value: the float32 bits of `x` shifted right by 13 (its sign, exponent and
10 leading mantissa bits, a "slot" 2**-10 of |x| wide at most) index a table that maps every slot to its bin. The
table is `_designed_bin` (the bins above, as formulas) applied to each slot's midpoint, so a bin holds whole slots:
the uniform bins' edges lie on the slot grid and are exact; the geometric bins' edges are moved to the nearest slot
edge (at most 0.1% of |x|); the `x = 0` bin also holds the float32 values below `2**-136` in magnitude (denormals,
whose ratio is exactly 1); a bin's bounds are those of the slots it holds. A float64 `x` is rounded towards 0 to
float32 first, which keeps it in its slot: every value lies within the bounds of its bin.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

__all__ = [
    "CORE_BIN_WIDTH",
    "CORE_LOG_RATIO",
    "NUM_BINS",
    "TAIL_LOG_RATIO",
    "ZERO_BIN",
    "RatioStatistics",
    "log_ratio_bin_bounds",
    "log_ratio_bins",
    "ratio_statistics",
    "ratio_sums",
    "statistics_dtype",
    "statistics_of_sums",
]

CORE_LOG_RATIO = 0.5
CORE_BIN_WIDTH = 2.0**-12
TAIL_LOG_RATIO = 64.0
TAIL_BINS = 64
_CORE_BINS = round(2 * CORE_LOG_RATIO / CORE_BIN_WIDTH)
_TAIL_GROWTH = math.log2(TAIL_LOG_RATIO / CORE_LOG_RATIO) / TAIL_BINS  # log2 of a tail bin's width ratio
# Ordered bins: underflow, negative tail (most negative first), core below 0, exactly 0, core from 0, positive
# tail, overflow, NaN.
_NEGATIVE_TAIL = 1
_CORE = _NEGATIVE_TAIL + TAIL_BINS
ZERO_BIN = _CORE + _CORE_BINS // 2
_POSITIVE_TAIL = _CORE + _CORE_BINS + 1
_OVERFLOW = _POSITIVE_TAIL + TAIL_BINS
_NAN = _OVERFLOW + 1
NUM_BINS = _NAN + 1

# A slot: the float32 bits of x shifted right by this many bits, masked to `_SLOT_MASK` (sign bit included).
_SLOT_SHIFT = 13
_SLOT_MASK = (1 << (32 - _SLOT_SHIFT)) - 1
_NEGATIVE_SLOTS = 1 << (31 - _SLOT_SHIFT)  # slots at and above this index hold negative values
_INFINITE_SLOT = 0x7F800000 >> _SLOT_SHIFT  # +inf (and NaNs without leading mantissa bits)


class RatioStatistics(NamedTuple):
    """Sums over a set of importance ratios `r = exp'(x)`, in the accumulation dtype (`counts`: int64).

    Attributes:
        units (`torch.Tensor` of shape `()`): how many ratios.
        deviation_sum, square_sum (`torch.Tensor` of shape `()`): `sum (r - 1)` and `sum (r - 1)**2`, exact for
            ratios near 1.
        min, max (`torch.Tensor` of shape `()`): the extremes (`inf` and `-inf` for no ratio).
        counts (`torch.Tensor` of shape `(NUM_BINS,)`): the histogram of the log ratios.
    """

    units: torch.Tensor
    deviation_sum: torch.Tensor
    square_sum: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    counts: torch.Tensor


def statistics_dtype(device: torch.device) -> torch.dtype:
    """The accumulation dtype of the statistics: float64, or float32 where the device has no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def ratio_statistics(log_ratio: torch.Tensor, ratio: torch.Tensor, weight: torch.Tensor) -> RatioStatistics:
    """The statistics of the ratios where `weight` is 1. Device operations only (no host synchronisation).

    Masked positions are not selected out but must hold `log_ratio == 0` and `ratio == 1`, as the loss kernel's
    ratios do (see `ratio_sums`).

    Args:
        log_ratio (`torch.Tensor` of any shape): `x`, float32 or float64.
        ratio (`torch.Tensor`, same shape): `exp_linear_above(x)`, `>= 0` (or NaN) where `weight` is 1.
        weight (`torch.Tensor`, same shape and dtype as `ratio`): 1 at the ratios that count, 0 elsewhere.

    Returns:
        [`RatioStatistics`].
    """
    return statistics_of_sums([ratio_sums(log_ratio, ratio, weight)], weight.sum(), log_ratio.numel())


def ratio_sums(log_ratio: torch.Tensor, ratio: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One block's share of `ratio_statistics`, to be finished by `statistics_of_sums` with those of the others.

    Masked positions hold `log_ratio == 0` and `ratio == 1`: they add 0 to the moments, are counted in the `x = 0`
    bin (and taken out of it by `statistics_of_sums`), and `weight` keeps them out of the extremes. No select: with
    `r >= 0`, a weight of 0 cannot raise the maximum of `r * weight` above that of the weighted ratios (nor above 0,
    the maximum `statistics_of_sums` reads as no ratio), and `r / 0 = inf` cannot lower a minimum.

    Returns:
        `(counts, deviation_sum, square_sum, minimum, maximum)`, the counts int64 (masked positions included), the
        sums in `statistics_dtype`, the extremes in the dtype of `ratio`.
    """
    bins = _bins(log_ratio).flatten()
    if bins.device.type == "cpu":
        counts = torch.bincount(bins, minlength=NUM_BINS)
    else:  # an index_add, not `bincount`: on a GPU bincount reads the largest bin on the host
        counts = torch.zeros(NUM_BINS, dtype=torch.int64, device=bins.device)
        counts.index_add_(0, bins.int(), torch.ones(bins.shape, dtype=torch.int64, device=bins.device))
    del bins  # before the moments' wide temporary is made (the loss kernel's peak memory)
    deviation = ratio.to(statistics_dtype(ratio.device), copy=True).flatten().sub_(1.0)
    return counts, deviation.sum(), torch.dot(deviation, deviation), (ratio / weight).amin(), (ratio * weight).amax()


def statistics_of_sums(sums: list[tuple[torch.Tensor, ...]], units: torch.Tensor, numel: int) -> RatioStatistics:
    """`RatioStatistics` from the `ratio_sums` of the blocks of a set of `numel` values, `units` of which count."""
    dtype = sums[0][1].dtype
    counts, deviation_sum, square_sum, minimum, maximum = (torch.stack(parts) for parts in zip(*sums, strict=True))
    counts = counts.sum(dim=0)
    units = units.to(dtype)
    counts[ZERO_BIN] -= numel - units.to(torch.int64)  # the masked positions, all counted at x = 0
    maximum = torch.where(units > 0, maximum.amax().to(dtype), -math.inf)
    return RatioStatistics(units, deviation_sum.sum(), square_sum.sum(), minimum.amin().to(dtype), maximum, counts)


def log_ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """The histogram bin of each log ratio, int64, same shape; see the module docstring for the bins."""
    return _bins(log_ratio).long()


def _bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """`log_ratio_bins` as int16 (`NUM_BINS < 2**15`), what the histogram counts: a quarter of int64's bytes."""
    x = log_ratio
    if x.dtype == torch.float64:
        x = _float32_towards_zero(x)
    elif x.dtype != torch.float32:
        x = x.to(torch.float32)  # exact from half precision
    slots = torch.bitwise_right_shift(x.view(torch.int32), _SLOT_SHIFT).bitwise_and_(_SLOT_MASK)
    return _bin_of_slot(x.device).index_select(0, slots.flatten()).view(x.shape)


def _float32_towards_zero(x: torch.Tensor) -> torch.Tensor:
    """float64 values as float32, rounded towards 0 (not to nearest), so that each stays in its slot."""
    rounded = x.to(torch.float32)
    away = rounded.to(torch.float64).abs() > x.abs()
    rounded = torch.where(away, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)
    smallest = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # the smallest denormal
    return torch.where((rounded == 0) & (x != 0), torch.copysign(torch.full_like(rounded, smallest), rounded), rounded)


def _designed_bin(x: torch.Tensor) -> torch.Tensor:
    """The bins as designed (see the module docstring), by formula, for float64 values: the table's source."""
    magnitude = x.abs()
    # x / w is exact (w a power of 2), x + 0.5 is not: a tiny negative x would round into the bin above 0
    core = (torch.floor(x / CORE_BIN_WIDTH) + _CORE_BINS // 2).clamp(0, _CORE_BINS - 1)
    core = _CORE + core + (core >= _CORE_BINS // 2).to(core.dtype)  # leave room for the x = 0 bin
    tail = torch.floor(torch.log2(magnitude.clamp(min=CORE_LOG_RATIO) / CORE_LOG_RATIO) / _TAIL_GROWTH)
    tail = tail.clamp(0, TAIL_BINS - 1)
    tail = torch.where(x > 0, _POSITIVE_TAIL + tail, _NEGATIVE_TAIL + (TAIL_BINS - 1) - tail)
    bins = torch.where(magnitude < CORE_LOG_RATIO, core, tail)
    bins = torch.where(magnitude >= TAIL_LOG_RATIO, torch.where(x > 0, _OVERFLOW, 0), bins)
    bins = torch.where(x == 0, ZERO_BIN, bins)
    return torch.where(torch.isnan(x), _NAN, bins).to(torch.int64)


#: Slots per chunk while the tables are built: a chunk's float64 temporaries hold a few MiB, where the whole slot
#: range at once held about 100 MiB at its peak (and left most of it in the process's resident set).
_CHUNK_SLOTS = 2**15


def _slots(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(bin, lower, upper)` of the slots `start` to `stop - 1`: each slot's bin and the bounds of the log ratios it
    holds (float64)."""
    slots = torch.arange(start, stop, dtype=torch.int64)
    magnitude_slot = slots % _NEGATIVE_SLOTS
    negative = slots >= _NEGATIVE_SLOTS

    def magnitude_at(slot: torch.Tensor) -> torch.Tensor:
        bits = (slot << _SLOT_SHIFT).clamp(max=0x7F800000).to(torch.int32)  # above the finite slots: inf
        return bits.view(torch.float32).to(torch.float64)

    # Selects only (no boolean indexing): built on the first call, which should read nothing on the host either.
    infinite = magnitude_slot >= _INFINITE_SLOT
    low = torch.where(infinite, math.inf, magnitude_at(magnitude_slot))
    high = torch.where(infinite, math.inf, magnitude_at(magnitude_slot + 1))
    middle = torch.where(torch.isinf(high), high, (low + high) / 2)
    middle = torch.where(negative, -middle, middle)
    middle = torch.where(magnitude_slot > _INFINITE_SLOT, math.nan, middle)  # exponent all ones, mantissa bits set
    middle = torch.where(magnitude_slot == 0, 0.0, middle)  # 0, -0 and the smallest denormals: the x = 0 bin
    lower = torch.where(negative, -high, low)
    upper = torch.where(negative, -low, high)
    return _designed_bin(middle), lower, upper


def _chunks() -> range:
    return range(0, _SLOT_MASK + 1, _CHUNK_SLOTS)


@functools.lru_cache(maxsize=8)
def _bin_of_slot(device: torch.device) -> torch.Tensor:
    """The table slot -> bin on `device`, int16 (1 MiB). The loss kernel looks up a block's bins while its other
    temporaries fill a CPU core's cache: with an int64 table (4 MiB) and int64 bins the histogram took a quarter of
    the kernel's time at 64 x 4096, twice what it takes in int16."""
    table = torch.empty(_SLOT_MASK + 1, dtype=torch.int16)
    for start in _chunks():
        table[start : start + _CHUNK_SLOTS] = _slots(start, start + _CHUNK_SLOTS)[0]
    return table.to(device=device)


@functools.lru_cache(maxsize=1)
def log_ratio_bin_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """`(lower, upper)` bounds of every bin but the NaN one, ascending, float64; the outer ones are infinite."""
    lowest = torch.full((NUM_BINS - 1,), math.inf, dtype=torch.float64)
    highest = torch.full((NUM_BINS - 1,), -math.inf, dtype=torch.float64)
    for start in _chunks():
        bins, lower, upper = _slots(start, start + _CHUNK_SLOTS)
        finite = bins != _NAN
        bins, lower, upper = bins[finite], lower[finite], upper[finite]
        lowest.scatter_reduce_(0, bins, lower, "amin")
        highest.scatter_reduce_(0, bins, upper, "amax")
    return lowest, highest
