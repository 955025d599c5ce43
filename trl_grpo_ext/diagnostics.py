"""Training diagnostics: the importance-ratio distribution, clip fractions, reward spread inside groups, loss split.

Everything is accumulated on the device between two log steps, with no host synchronisation per micro-batch. At a
log step, each process packs its running sums into one fixed-size vector and a single `gather` brings all of them
to every process; the statistics are then read off the pooled sums. The vector's size depends on the histogram
resolution and on the number of micro-batches since the last log, never on the batch size or sequence length.

Importance ratios are binned by their logarithm, with arithmetic bin indices (no search): uniform bins `2**-12`
wide for |log r| < 0.5 (ratios in [0.61, 1.65]), geometric bins (7.9% of |log r| wide) out to |log r| = 64, one
bin each for what lies beyond, one for log ratios of exactly 0 (on-policy tokens, so that a quantile among them
reads exactly 1) and one for NaN. A reported quantile is within one bin width (in log space) of the sample's lower
and upper order statistics at that rank: within 2.5e-4 relative to the true value for ratios near 1, which is what
p05/p50/p95 of a healthy run need. Minimum and maximum are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from .loss import GRPOLossOutput
from .numerics import EXP_LINEAR_ABOVE, exp_linear_above, log_of_exp_linear_above

__all__ = [
    "CORE_LOG_RATIO",
    "CORE_BIN_WIDTH",
    "DiagnosticsAccumulator",
    "DiagnosticsSummary",
    "NUM_BINS",
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

# Per micro-batch, the sums behind TRL's own metrics (TRL averages its per-micro-batch global means over the log
# window; keeping them per micro-batch reproduces its numbers exactly).
_STEP_FIELDS = ("kl", "entropy", "low", "high", "region", "tokens", "clip_units", "low_min", "high_max")
# The terms of the loss, each in the units of the logged `loss` (they add up to it): logged as `loss/<term>`.
LOSS_TERMS = ("policy", "kl_penalty", "entropy_bonus", "router")
# Which clip metrics a policy term has, under TRL's names: "clip_ratio" (clip_ratio/low_mean, ... for the clipped
# surrogate), "cispo" (cispo_clip_ratio), or "none" (SAPO, VESPO).
CLIP_METRICS = ("clip_ratio", "cispo", "none")
# Pooled over the whole log window: these sums, then the log-ratio histogram's NUM_BINS counts.
_POOLED_FIELDS = ("deviation_sum", "square_sum", "ratio_min", "ratio_max", *LOSS_TERMS, "micro_batches")
_POOLED = {name: position for position, name in enumerate(_POOLED_FIELDS)}
_COUNTS_START = len(_POOLED_FIELDS)
_MISMATCH_HEADER = 6  # units, outside the bounds, min, max, sum, sum of squares; then the log-ratio bin counts


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


@dataclass
class DiagnosticsSummary:
    """What one log step reports: scalars for every logger, and raw histograms for those that draw them.

    Attributes:
        scalars: metric name -> value.
        per_step: metric name -> one value per micro-batch since the last log (TRL's own metrics, which TRL
            averages over the log window itself).
        histograms: name -> (bucket upper limits, counts, minimum, maximum, number, sum, sum of squares).
    """

    scalars: dict[str, float] = field(default_factory=dict)
    per_step: dict[str, list[float]] = field(default_factory=dict)
    histograms: dict[str, tuple] = field(default_factory=dict)


class DiagnosticsAccumulator:
    """Running sums of the diagnostics of one mode (train or eval) between two log steps.

    Args:
        ratio_stats (`bool`): accumulate the ratio distribution, the loss split and the reward spread; when `False`
            only TRL's own metrics (kl, entropy, clip ratios) are kept.
        quantiles (`list[float]`): ratio quantiles to report.
        histograms (`bool`): build the histograms for loggers that draw them.
        clip_metrics (`str`): one of `CLIP_METRICS`: which clip metrics the objective's policy term has.
        loss_terms (`tuple[str, ...]`): the terms of `LOSS_TERMS` to report as `loss/<term>`.
        extra_metrics (`tuple[str, ...]`): names of further per-micro-batch metrics, each added as a `(sum, count)`
            pair by `add_loss_step` and reported as the pooled sum over the pooled count (like TRL's own).
        sampler_mismatch (`bool`): also pool the raw sampler/trainer importance ratios of `add_sampler_mismatch`
            (vLLM's importance-sampling correction), reported as `sampling/importance_sampling_ratio_raw/*`.
    """

    def __init__(
        self,
        *,
        ratio_stats: bool = True,
        quantiles: list[float] | None = None,
        histograms: bool = True,
        clip_metrics: str = "clip_ratio",
        loss_terms: tuple[str, ...] = ("policy", "kl_penalty"),
        extra_metrics: tuple[str, ...] = (),
        sampler_mismatch: bool = False,
    ):
        if clip_metrics not in CLIP_METRICS:
            raise ValueError(f"`clip_metrics` must be one of {CLIP_METRICS}, got {clip_metrics!r}.")
        unknown = set(loss_terms) - set(LOSS_TERMS)
        if unknown:
            raise ValueError(f"unknown loss terms {sorted(unknown)}; known: {LOSS_TERMS}.")
        self.ratio_stats = ratio_stats
        self.quantiles = list(quantiles) if quantiles is not None else [0.05, 0.5, 0.95]
        self.histograms = histograms and ratio_stats
        self.clip_metrics = clip_metrics
        self.loss_terms = tuple(loss_terms)
        self.extra_metrics = tuple(extra_metrics)
        self.sampler_mismatch = sampler_mismatch
        self.reset()

    def reset(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._pooled: torch.Tensor | None = None
        self._group_stds: list[torch.Tensor] = []
        self._unscored: list[torch.Tensor] = []  # [unscored, total] per generation batch
        self._mismatch: torch.Tensor | None = None  # [units, outside the bounds, min, max, log-ratio bin counts]

    @staticmethod
    def _accumulator_dtype(device: torch.device) -> torch.dtype:
        return torch.float32 if device.type == "mps" else torch.float64

    def add_loss_step(
        self,
        out: GRPOLossOutput,
        entropies: torch.Tensor | None,
        loss_terms: dict[str, torch.Tensor] | None = None,
        extras: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Add one micro-batch. Device ops only: no `.item()`, no boolean indexing.

        Args:
            out: what `grpo_loss` (or `objectives.policy_objective`) returned for the micro-batch.
            entropies (`torch.Tensor` of shape `(N, T)`, *optional*): per-token entropies of the policy.
            loss_terms (`dict[str, torch.Tensor]`, *optional*): 0-dim values of the loss terms, in the units of the
                logged `loss`; default: `out.policy_loss` and `out.kl_penalty`.
            extras (`dict[str, tuple]`, *optional*): `(sum, count)` of each of `extra_metrics`.
        """
        mask = out.mask
        dtype = self._accumulator_dtype(mask.device)
        tokens = out.tokens_per_row.to(dtype)
        units = out.clip_units_per_row.to(dtype)
        low, high = out.low_clipped_per_row.to(dtype), out.high_clipped_per_row.to(dtype)
        with_units = units > 0
        nan = torch.full((), math.nan, dtype=dtype, device=mask.device)  # a fill, not a host-to-device copy
        entropy_sum = torch.where(mask, entropies.detach(), 0).to(dtype).sum() if entropies is not None else nan
        values = [
            out.kl_per_row.to(dtype).sum(),
            entropy_sum,
            low.sum(),
            high.sum(),
            (low + high).sum(),  # a token cannot be both: low needs A < 0, high A > 0
            tokens.sum(),
            units.sum(),
            torch.where(with_units, low / units.clamp(min=1), math.inf).min(),
            torch.where(with_units, high / units.clamp(min=1), -math.inf).max(),
        ]
        for name in self.extra_metrics:
            total, count = extras[name]
            if not isinstance(count, torch.Tensor):  # a Python number: filled on the device, not copied to it
                count = torch.full((), count, dtype=dtype, device=mask.device)
            values += [total.detach().to(dtype).reshape(()), count.to(dtype).reshape(())]
        step = torch.stack(values)
        self._steps.append(step)
        if not self.ratio_stats:
            return

        log_ratio = out.log_ratio.to(dtype)
        deviation = torch.where(mask, out.ratio.to(dtype) - 1.0, 0.0)
        counts = torch.zeros(NUM_BINS, dtype=dtype, device=mask.device)
        counts.index_add_(0, log_ratio_bins(log_ratio).reshape(-1), mask.reshape(-1).to(dtype))
        if loss_terms is None:
            loss_terms = {"policy": out.policy_loss, "kl_penalty": out.kl_penalty}
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        fields = {
            "deviation_sum": deviation.sum(),
            "square_sum": deviation.pow(2).sum(),
            "ratio_min": torch.where(mask, out.ratio.to(dtype), math.inf).min(),
            "ratio_max": torch.where(mask, out.ratio.to(dtype), -math.inf).max(),
            **{term: loss_terms.get(term, zero).detach().to(dtype).reshape(()) for term in LOSS_TERMS},
            "micro_batches": torch.ones((), dtype=dtype, device=mask.device),
        }
        pooled = torch.cat([torch.stack([fields[name] for name in _POOLED_FIELDS]), counts])
        if self._pooled is None:
            self._pooled = pooled
        else:
            # min and max combine by min and max; everything else adds up.
            combined = self._pooled + pooled
            low, high = _POOLED["ratio_min"], _POOLED["ratio_max"]
            combined[low] = torch.minimum(self._pooled[low], pooled[low])
            combined[high] = torch.maximum(self._pooled[high], pooled[high])
            self._pooled = combined

    def add_rewards(self, rewards: torch.Tensor, num_generations: int) -> None:
        """Add the rewards of one generation batch, already gathered from every process.

        Args:
            rewards (`torch.Tensor` of shape `(N,)`): total reward per completion, NaN for unscored ones, ordered
                group-contiguously.
            num_generations (`int`): the group size G.
        """
        if not self.ratio_stats:
            return
        grouped = rewards.detach().to(self._accumulator_dtype(rewards.device)).reshape(-1, num_generations)
        scored = ~torch.isnan(grouped)
        count = scored.sum(dim=1)
        mean = torch.where(scored, grouped, 0.0).sum(dim=1) / count.clamp(min=1)
        squares = torch.where(scored, grouped - mean[:, None], 0.0).pow(2).sum(dim=1)
        std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), math.nan)
        self._group_stds.append(std)
        total = torch.full((), scored.numel(), dtype=torch.int64, device=scored.device)
        self._unscored.append(torch.stack([(~scored).sum(), total]))

    def add_sampler_mismatch(self, log_ratio: torch.Tensor, units: torch.Tensor, outside: torch.Tensor) -> None:
        """Add the raw sampler/trainer importance ratios of one generation batch. Device ops only.

        Args:
            log_ratio (`torch.Tensor` of shape `(N, T)` or `(N, 1)`): `old_logp - sampler_logp`, per token or summed
                per sequence, before any truncation or masking.
            units (`torch.Tensor`, bool, same shape): which entries count (completion tokens, or every sequence).
            outside (`torch.Tensor`, bool, same shape): entries whose ratio lies outside the correction's bounds,
                i.e. that the correction truncates or masks.
        """
        if not self.sampler_mismatch:
            return
        dtype = self._accumulator_dtype(log_ratio.device)
        weights = units.reshape(-1).to(dtype)
        counts = torch.zeros(NUM_BINS, dtype=dtype, device=log_ratio.device)
        counts.index_add_(0, log_ratio_bins(log_ratio.to(dtype)).reshape(-1), weights)
        ratio = exp_linear_above(log_ratio.to(dtype))
        segment = torch.cat(
            [
                torch.stack(
                    [
                        weights.sum(),
                        (outside & units).sum().to(dtype),
                        torch.where(units, ratio, math.inf).min(),
                        torch.where(units, ratio, -math.inf).max(),
                        torch.where(units, ratio, 0.0).sum(),
                        torch.where(units, ratio, 0.0).pow(2).sum(),
                    ]
                ),
                counts,
            ]
        )
        if self._mismatch is None:
            self._mismatch = segment
        else:
            combined = self._mismatch + segment
            combined[2] = torch.minimum(self._mismatch[2], segment[2])
            combined[3] = torch.maximum(self._mismatch[3], segment[3])
            self._mismatch = combined

    def is_empty(self) -> bool:
        return not self._steps and not self._group_stds

    def pack(self) -> torch.Tensor | None:
        """This process's sums as one 1-dim vector (what the log step gathers), or `None` if nothing was added."""
        if not self._steps:
            return None
        parts = [torch.cat(self._steps)]
        if self._pooled is not None:
            parts.append(self._pooled)
        if self.sampler_mismatch:  # fixed size, zeros when nothing was generated since the last log
            empty = torch.zeros(_MISMATCH_HEADER + NUM_BINS, dtype=parts[0].dtype, device=parts[0].device)
            empty[2], empty[3] = math.inf, -math.inf
            parts.append(self._mismatch if self._mismatch is not None else empty)
        return torch.cat(parts)

    def _step_width(self) -> int:
        return len(_STEP_FIELDS) + 2 * len(self.extra_metrics)

    def summarize(self, gathered: torch.Tensor | None) -> DiagnosticsSummary:
        """Read the statistics off the gathered sums of all processes and reset.

        Args:
            gathered (`torch.Tensor` of shape `(num_processes, L)`, *optional*): the packed vectors of every
                process, `None` when no micro-batch was added since the last log (reward statistics only).
        """
        summary = DiagnosticsSummary()
        if gathered is not None:
            gathered = gathered.to(torch.float64).cpu()
            num_steps, width = len(self._steps), self._step_width()
            steps = gathered[:, : num_steps * width].reshape(-1, num_steps, width)
            self._summarize_trl_metrics(steps, summary)
            rest = gathered[:, num_steps * width :]
            if self.sampler_mismatch:
                rest, mismatch = rest[:, : -(_MISMATCH_HEADER + NUM_BINS)], rest[:, -(_MISMATCH_HEADER + NUM_BINS) :]
                self._summarize_mismatch(mismatch, summary)
            if self._pooled is not None:
                self._summarize_ratio_and_loss(rest, summary)
        if self._group_stds:
            self._summarize_rewards(torch.cat(self._group_stds).to(torch.float64).cpu(), summary)
            unscored, total = torch.stack(self._unscored).sum(dim=0).tolist()
            summary.scalars["frac_reward_unscored"] = unscored / total
        self.reset()
        return summary

    def _summarize_trl_metrics(self, steps: torch.Tensor, summary: DiagnosticsSummary) -> None:
        index = {name: position for position, name in enumerate(_STEP_FIELDS)}
        totals = steps.sum(dim=0)  # (num_steps, fields)
        tokens = totals[:, index["tokens"]].clamp(min=1.0)
        units = totals[:, index["clip_units"]].clamp(min=1.0)
        summary.per_step["kl"] = (totals[:, index["kl"]] / tokens).tolist()
        summary.per_step["entropy"] = (totals[:, index["entropy"]] / tokens).tolist()
        if self.clip_metrics == "clip_ratio":
            for metric, name in (
                ("clip_ratio/low_mean", "low"),
                ("clip_ratio/high_mean", "high"),
                ("clip_ratio/region_mean", "region"),
            ):
                summary.per_step[metric] = (totals[:, index[name]] / units).tolist()
            low_min = steps[:, :, index["low_min"]].min(dim=0).values
            high_max = steps[:, :, index["high_max"]].max(dim=0).values
            summary.per_step["clip_ratio/low_min"] = torch.where(torch.isinf(low_min), math.nan, low_min).tolist()
            summary.per_step["clip_ratio/high_max"] = torch.where(torch.isinf(high_max), math.nan, high_max).tolist()
        elif self.clip_metrics == "cispo":
            summary.per_step["cispo_clip_ratio"] = (totals[:, index["high"]] / units).tolist()
        for position, name in enumerate(self.extra_metrics):
            start = len(_STEP_FIELDS) + 2 * position
            summary.per_step[name] = (totals[:, start] / totals[:, start + 1]).tolist()

    def _summarize_ratio_and_loss(self, pooled: torch.Tensor, summary: DiagnosticsSummary) -> None:
        counts = pooled[:, _COUNTS_START:].sum(dim=0)
        total_of = {name: pooled[:, _POOLED[name]].sum().item() for name in _POOLED_FIELDS}
        deviation_sum, square_sum = total_of["deviation_sum"], total_of["square_sum"]
        minimum = pooled[:, _POOLED["ratio_min"]].min().item()
        maximum = pooled[:, _POOLED["ratio_max"]].max().item()
        for term in self.loss_terms:
            summary.scalars[f"loss/{term}"] = total_of[term] / total_of["micro_batches"]

        finite_counts = counts[:-1]  # drop the NaN bin
        total = finite_counts.sum().item()
        if total == 0:
            return
        mean_deviation = deviation_sum / total
        variance = (square_sum - total * mean_deviation**2) / (total - 1) if total > 1 else 0.0
        summary.scalars["ratio/mean"] = 1.0 + mean_deviation
        summary.scalars["ratio/std"] = math.sqrt(max(variance, 0.0))
        summary.scalars["ratio/min"] = minimum
        summary.scalars["ratio/max"] = maximum
        lower, upper = log_ratio_bin_bounds()
        log_min, log_max = log_of_exp_linear_above(minimum), log_of_exp_linear_above(maximum)
        log_quantiles = histogram_quantiles(finite_counts, lower, upper, self.quantiles, log_min, log_max)
        for quantile, log_value in zip(self.quantiles, log_quantiles, strict=True):
            value = math.exp(min(log_value, EXP_LINEAR_ABOVE)) * (1.0 + max(log_value - EXP_LINEAR_ABOVE, 0.0))
            summary.scalars[quantile_metric_name(quantile)] = min(max(value, minimum), maximum)
        if counts[-1] > 0:
            summary.scalars["ratio/nan_count"] = counts[-1].item()
        if self.histograms:
            ratio_sum = total + deviation_sum
            ratio_squares = total + 2.0 * deviation_sum + square_sum
            summary.histograms["ratio"] = _ratio_histogram(finite_counts, upper, minimum, maximum)
            summary.histograms["ratio"] += (total, ratio_sum, ratio_squares)

    def _summarize_mismatch(self, pooled: torch.Tensor, summary: DiagnosticsSummary) -> None:
        total = pooled[:, 0].sum().item()
        if total == 0:
            return
        minimum, maximum = pooled[:, 2].min().item(), pooled[:, 3].max().item()
        counts = pooled[:, _MISMATCH_HEADER:].sum(dim=0)[:-1]  # without the NaN bin
        prefix = "sampling/importance_sampling_ratio_raw"
        summary.scalars[f"{prefix}/min"] = minimum
        summary.scalars[f"{prefix}/max"] = maximum
        summary.scalars[f"{prefix}/outside_fraction"] = pooled[:, 1].sum().item() / total
        lower, upper = log_ratio_bin_bounds()
        log_quantiles = histogram_quantiles(
            counts, lower, upper, self.quantiles, log_of_exp_linear_above(minimum), log_of_exp_linear_above(maximum)
        )
        for quantile, log_value in zip(self.quantiles, log_quantiles, strict=True):
            value = math.exp(min(log_value, EXP_LINEAR_ABOVE)) * (1.0 + max(log_value - EXP_LINEAR_ABOVE, 0.0))
            name = quantile_metric_name(quantile).replace("ratio/", f"{prefix}/")
            summary.scalars[name] = min(max(value, minimum), maximum)
        if self.histograms and counts.sum() > 0:
            limits, bucket_counts, low, high = _ratio_histogram(counts, upper, minimum, maximum)
            sums = (pooled[:, 4].sum().item(), pooled[:, 5].sum().item())
            summary.histograms[prefix] = (limits, bucket_counts, low, high, total, *sums)

    def _summarize_rewards(self, group_stds: torch.Tensor, summary: DiagnosticsSummary) -> None:
        valid = group_stds[~torch.isnan(group_stds)]
        if valid.numel() == 0:
            return
        summary.scalars["reward_std/group_mean"] = valid.mean().item()
        summary.scalars["reward_std/group_min"] = valid.min().item()
        summary.scalars["reward_std/group_max"] = valid.max().item()
        if self.histograms:
            summary.histograms["reward_std/group"] = _value_histogram(valid)


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


def _value_histogram(values: torch.Tensor, num_buckets: int = 20) -> tuple:
    """Histogram of a handful of values, in the tuple layout of `DiagnosticsSummary.histograms`."""
    minimum, maximum = values.min().item(), values.max().item()
    if maximum == minimum:
        limits, counts = [maximum], [float(values.numel())]
    else:
        edges = torch.linspace(minimum, maximum, num_buckets + 1, dtype=torch.float64)
        counts = torch.histc(values, bins=num_buckets, min=minimum, max=maximum).tolist()
        limits = edges[1:].tolist()
    return (limits, counts, minimum, maximum, float(values.numel()), values.sum().item(), values.pow(2).sum().item())
