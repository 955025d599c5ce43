"""`DiagnosticsAccumulator`: the running sums of the diagnostics between two log steps, packed and read by name.

Everything is accumulated on the device, with no host synchronisation per micro-batch. At a log step each process
packs its sums into one vector and a single `gather` brings all of them to every process; the statistics are read
off the pooled sums. The vector has these parts, each a `FieldLayout`:

- one `STEP_LAYOUT` row per micro-batch: the sums behind TRL's own metrics (kl, entropy, clip ratios), which TRL
  averages per micro-batch over the log window itself;
- one window row (`DiagnosticsAccumulator.window_layout`): the importance-ratio histogram of the loss's tokens
  (`LogRatioHistogram`), the loss terms in the units of the backward loss, and the optimizer steps they span;
- with the ratio statistics, the length/reward correlation's three sums (`rewards.LENGTH_LAYOUT`);
- with vLLM, one mismatch row: the histogram of the raw sampler/trainer ratios, how many lie outside the
  correction's bounds, the sums behind the sampler/trainer k3 KL and behind the effective sample size of the
  weights TRL's correction applies (`MISMATCH_SUMS`).

Its size depends on the number of micro-batches since the last log, never on the batch size or sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..metrics import (
    CISPO_CLIP_RATIO,
    CLIP_RATIO_PREFIX,
    ENTROPY,
    FRAC_REWARD_UNSCORED,
    IMPORTANCE_SAMPLING_RATIO_ESS,
    IMPORTANCE_SAMPLING_RATIO_RAW,
    KL,
    LOSS_PREFIX,
    RATIO_NAN_COUNT,
    RATIO_PREFIX,
    SAMPLER_K3_KL,
)
from ..ops.loss_types import CLIP_METRICS
from ..ops.numerics import kl_estimator
from .histogram import LogRatioHistogram, quantile_metric_name
from .layout import FieldLayout
from .rewards import (
    LENGTH_LAYOUT,
    group_reward_stds,
    length_moments,
    summarize_length_correlation,
    summarize_reward_spread,
)

__all__ = ["LOSS_TERMS", "STEP_LAYOUT", "DiagnosticsAccumulator", "DiagnosticsSummary"]

# The terms of the loss, each in the units of the logged `loss` (they add up to it): logged as `loss/<term>`.
LOSS_TERMS = ("policy", "kl_penalty", "entropy_bonus", "router")
STEP_LAYOUT = FieldLayout(
    [
        (KL, "sum"),
        (ENTROPY, "sum"),
        ("low", "sum"),
        ("high", "sum"),
        ("region", "sum"),
        ("tokens", "sum"),
        ("clip_units", "sum"),
        ("low_min", "min"),  # the lowest per-row low-clip fraction
        ("high_max", "max"),  # the highest per-row high-clip fraction
        ("carriers", "sum"),  # processes whose micro-batch only carried the graph (every row skipped)
    ]
)
MISMATCH_PREFIX = IMPORTANCE_SAMPLING_RATIO_RAW
# Beside the raw ratios' histogram: the units outside the bounds; sum of exp(d) - d - 1 over the tokens the sampler
# scored and their number (d = trainer_logp - sampler_logp); the units, sum and sum of squares of the weights the
# correction applies (none when it is off).
MISMATCH_SUMS = ("outside", "k3_sum", "k3_tokens", "applied_units", "applied_sum", "applied_square_sum")


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
        clip_metrics (`str`): one of `ops.loss_types.CLIP_METRICS`: which clip metrics the loss type has.
        loss_terms (`tuple[str, ...]`): the terms of `LOSS_TERMS` to report as `loss/<term>`.
        extra_metrics (`tuple[str, ...]`): names of further per-micro-batch metrics, each added as a `(sum, count)`
            pair by `add_loss_step` and reported as the pooled sum over the pooled count (like TRL's own).
        sampler_mismatch (`bool`): also pool the sampler/trainer mismatch of `add_sampler_mismatch` (vLLM),
            reported as `sampling/importance_sampling_ratio_raw/*`, `sampling/sampler_k3_kl` and, with the
            correction on, `sampling/importance_sampling_ratio/ess`.
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
        extras = [(f"{name}/{part}", "sum") for name in self.extra_metrics for part in ("sum", "count")]
        self.step_layout = FieldLayout([*STEP_LAYOUT.fields(), *extras])
        histogram = LogRatioHistogram.layout
        terms = [(term, "sum") for term in LOSS_TERMS]
        self.window_layout = FieldLayout([*histogram.fields(RATIO_PREFIX), *terms, ("optimizer_steps", "sum")])
        self.mismatch_layout = FieldLayout([*histogram.fields(), *((name, "sum") for name in MISMATCH_SUMS)])
        self.reset()

    def reset(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._window: torch.Tensor | None = None
        self._group_stds: list[torch.Tensor] = []
        self._unscored: list[torch.Tensor] = []  # [unscored, total] per generation batch
        self._lengths: torch.Tensor | None = None  # this process's [sum l*R, sum l^2, sum R^2], centred in groups
        self._mismatch: torch.Tensor | None = None

    @staticmethod
    def _accumulator_dtype(device: torch.device) -> torch.dtype:
        return torch.float32 if device.type == "mps" else torch.float64

    def add_loss_step(
        self,
        out,
        entropies: torch.Tensor | None,
        loss_terms: dict[str, torch.Tensor] | None = None,
        extras: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        optimizer_step: bool = True,
        carrier: bool = False,
    ) -> None:
        """Add one micro-batch. Device ops only: no `.item()`, no boolean indexing.

        Args:
            out (`GRPOLossOutput`): what `ops.policy_objective` returned for the micro-batch; when `ratio_stats` is
                on, with `ratio_statistics=True` (or `per_token=True`: the statistics are then computed here).
            entropies (`torch.Tensor` of shape `(N, T)`, *optional*): per-token entropies of the policy.
            loss_terms (`dict[str, torch.Tensor]`, *optional*): 0-dim values of the loss terms in the units of the
                backward loss (summed over an optimizer step's micro-batches, they give that step's logged loss);
                default: `out.policy_loss` and `out.kl_penalty`.
            extras (`dict[str, tuple]`, *optional*): `(sum, count)` of each of `extra_metrics`.
            optimizer_step (`bool`): whether this micro-batch ends an optimizer step (in evaluation: every batch).
            carrier (`bool`): every row of the micro-batch was skipped (`sampling.skipping`): its one row only carries
                the graph. Where every process's micro-batch is a carrier, no entropy is logged for it (TRL's mean over
                micro-batches would take a 0 from it); its clip counts still count (zeros, exactly).
        """
        mask = out.mask
        device = mask.device
        dtype = self._accumulator_dtype(device)
        tokens = out.tokens_per_row.to(dtype)
        units = out.clip_units_per_row.to(dtype)
        low, high = out.low_clipped_per_row.to(dtype), out.high_clipped_per_row.to(dtype)
        with_units = units > 0
        nan = torch.full((), math.nan, dtype=dtype, device=device)  # a fill, not a host-to-device copy
        values = {
            KL: out.kl_per_row.to(dtype).sum(),
            ENTROPY: torch.where(mask, entropies.detach(), 0).to(dtype).sum() if entropies is not None else nan,
            "low": low.sum(),
            "high": high.sum(),
            "region": (low + high).sum(),  # a token cannot be both: low needs A < 0, high A > 0
            "tokens": tokens.sum(),
            "clip_units": units.sum(),
            "low_min": torch.where(with_units, low / units.clamp(min=1), math.inf).min(),
            "high_max": torch.where(with_units, high / units.clamp(min=1), -math.inf).max(),
            "carriers": torch.full((), float(carrier), dtype=dtype, device=device),
        }
        for name in self.extra_metrics:
            total, count = extras[name]
            if not isinstance(count, torch.Tensor):  # a Python number: filled on the device, not copied to it
                count = torch.full((), count, dtype=dtype, device=device)
            values[f"{name}/sum"] = total.detach().to(dtype)
            values[f"{name}/count"] = count.to(dtype)
        self._steps.append(self.step_layout.pack(values))
        if not self.ratio_stats:
            return

        if out.ratio_statistics is not None:  # summed by the loss where it computed the ratios
            histogram = LogRatioHistogram.pack(out.ratio_statistics, dtype)
        else:
            histogram = LogRatioHistogram.measure(out.log_ratio, mask, dtype, ratio=out.ratio)
        if loss_terms is None:
            loss_terms = {"policy": out.policy_loss, "kl_penalty": out.kl_penalty}
        zero = torch.zeros((), dtype=dtype, device=device)
        window = torch.cat(
            [
                histogram,
                torch.stack([loss_terms.get(term, zero).detach().to(dtype).reshape(()) for term in LOSS_TERMS]),
                torch.full((1,), float(optimizer_step), dtype=dtype, device=device),
            ]
        )
        self._window = window if self._window is None else self.window_layout.merge(self._window, window)

    def add_rewards(
        self,
        rewards: torch.Tensor,
        num_generations: int,
        lengths: torch.Tensor | None = None,
        first_row: int = 0,
    ) -> None:
        """Add the rewards of one generation batch, already gathered from every process. Device ops only.

        Args:
            rewards (`torch.Tensor` of shape `(N,)`): total reward per completion, NaN for unscored ones, ordered
                group-contiguously.
            num_generations (`int`): the group size G.
            lengths (`torch.Tensor` of shape `(n,)`, *optional*): completion lengths (tokens) of this process's
                completions, rows `first_row` to `first_row + n - 1` of `rewards` (TRL's process slice): for the
                correlation of length and reward inside groups, pooled over processes by the log step's gather.
            first_row (`int`): see `lengths`.
        """
        if not self.ratio_stats:
            return
        dtype = self._accumulator_dtype(rewards.device)
        grouped = rewards.detach().to(dtype).reshape(-1, num_generations)
        scored = ~torch.isnan(grouped)
        std = group_reward_stds(grouped, scored)
        self._group_stds.append(std)
        total = torch.full((), scored.numel(), dtype=torch.int64, device=scored.device)
        self._unscored.append(torch.stack([(~scored).sum(), total]))
        if lengths is not None:
            moments = length_moments(grouped.flatten(), std, lengths, first_row, num_generations)
            self._lengths = moments if self._lengths is None else self._lengths + moments

    def add_sampler_mismatch(self, mismatch) -> None:
        """Add the sampler/trainer mismatch of one generation batch. Device ops only.

        Args:
            mismatch (`extras.vllm.mismatch.SamplerMismatch`): its `log_ratio`, `units` and `outside` (`(N, T)`, or
                `(N, 1)` per sequence), `token_log_ratio` and `scored` (`(N, T)`) and `applied` (the correction's
                weights, or `None`).
        """
        if not self.sampler_mismatch:
            return
        log_ratio, units = mismatch.log_ratio, mismatch.units
        dtype = self._accumulator_dtype(log_ratio.device)
        scored = mismatch.scored
        k3 = torch.where(scored, kl_estimator(mismatch.token_log_ratio.to(dtype)), 0.0)
        sums = {"outside": (mismatch.outside & units).sum(), "k3_sum": k3.sum(), "k3_tokens": scored.sum()}
        zero = torch.zeros((), dtype=dtype, device=log_ratio.device)
        if mismatch.applied is not None:
            applied = torch.where(units, mismatch.applied.to(dtype), 0.0)
            sums.update(applied_units=units.sum(), applied_sum=applied.sum(), applied_square_sum=applied.pow(2).sum())
        values = torch.stack([sums.get(name, zero).to(dtype) for name in MISMATCH_SUMS])
        segment = torch.cat([LogRatioHistogram.measure(log_ratio, units, dtype), values])
        self._mismatch = segment if self._mismatch is None else self.mismatch_layout.merge(self._mismatch, segment)

    def pack(self) -> torch.Tensor | None:
        """This process's sums as one 1-dim vector (what the log step gathers), or `None` if nothing was added."""
        if not self._steps:
            return None
        parts = [torch.cat(self._steps)]
        if self._window is not None:
            parts.append(self._window)
        if self.ratio_stats:  # fixed size, zeros when no lengths were added since the last log
            parts.append(self._lengths if self._lengths is not None else parts[0].new_zeros(LENGTH_LAYOUT.width))
        if self.sampler_mismatch:  # fixed size, an empty histogram when nothing was generated since the last log
            if self._mismatch is None:
                empty = LogRatioHistogram.empty(parts[0].device, parts[0].dtype)
                self._mismatch = torch.cat([empty, empty.new_zeros(len(MISMATCH_SUMS))])
            parts.append(self._mismatch)
        return torch.cat(parts)

    def summarize(self, gathered: torch.Tensor | None) -> DiagnosticsSummary:
        """Read the statistics off the gathered sums of all processes and reset.

        Args:
            gathered (`torch.Tensor` of shape `(num_processes, L)`, *optional*): the packed vectors of every
                process, `None` when no micro-batch was added since the last log (reward statistics only).
        """
        summary = DiagnosticsSummary()
        if gathered is not None:
            gathered = gathered.to(torch.float64).cpu()
            steps_width = len(self._steps) * self.step_layout.width
            steps = gathered[:, :steps_width].reshape(gathered.shape[0], len(self._steps), -1)
            self._summarize_trl_metrics(self.step_layout.unpack(self.step_layout.reduce(steps)), summary)
            rest = gathered[:, steps_width:]
            if self._window is not None:
                window = self.window_layout.unpack(self.window_layout.reduce(rest[:, : self.window_layout.width]))
                self._summarize_ratio_and_loss(window, summary)
                rest = rest[:, self.window_layout.width :]
            if self.ratio_stats:
                summarize_length_correlation(LENGTH_LAYOUT.reduce(rest[:, : LENGTH_LAYOUT.width]), summary.scalars)
                rest = rest[:, LENGTH_LAYOUT.width :]
            if self.sampler_mismatch:
                self._summarize_mismatch(self.mismatch_layout.unpack(self.mismatch_layout.reduce(rest)), summary)
        if self._group_stds:
            group_stds = torch.cat(self._group_stds).to(torch.float64).cpu()
            summarize_reward_spread(group_stds, summary.scalars, summary.histograms if self.histograms else None)
            unscored, total = torch.stack(self._unscored).sum(dim=0).tolist()
            summary.scalars[FRAC_REWARD_UNSCORED] = unscored / total
        if gathered is None and self._lengths is not None:  # nothing gathered (no loss step): this process's own
            summarize_length_correlation(self._lengths.to(torch.float64).cpu(), summary.scalars)
        self.reset()
        return summary

    def _summarize_trl_metrics(self, steps: dict[str, torch.Tensor], summary: DiagnosticsSummary) -> None:
        """TRL's per-micro-batch metrics from the steps' fields (each `(num_steps,)`, pooled over processes)."""
        tokens = steps["tokens"].clamp(min=1.0)
        units = steps["clip_units"].clamp(min=1.0)
        summary.per_step[KL] = (steps[KL] / tokens).tolist()
        trained = (steps["tokens"] > 0) | (steps["carriers"] == 0)  # not a micro-batch that only carried the graph
        summary.per_step[ENTROPY] = (steps[ENTROPY] / tokens)[trained].tolist()
        if self.clip_metrics == "clip_ratio":
            for metric, name in (("low_mean", "low"), ("high_mean", "high"), ("region_mean", "region")):
                summary.per_step[f"{CLIP_RATIO_PREFIX}{metric}"] = (steps[name] / units).tolist()
            for metric, name in (("low_min", "low_min"), ("high_max", "high_max")):
                summary.per_step[f"{CLIP_RATIO_PREFIX}{metric}"] = torch.where(
                    torch.isinf(steps[name]), math.nan, steps[name]
                ).tolist()
        elif self.clip_metrics == "cispo":
            summary.per_step[CISPO_CLIP_RATIO] = (steps["high"] / units).tolist()
        for name in self.extra_metrics:
            counted = steps[f"{name}/count"] > 0  # a carrier micro-batch adds (0, 0)
            summary.per_step[name] = (steps[f"{name}/sum"] / steps[f"{name}/count"])[counted].tolist()

    def _summarize_ratio_and_loss(self, window: dict[str, torch.Tensor], summary: DiagnosticsSummary) -> None:
        # Trainer logs the mean over optimizer steps of each step's summed micro-batch losses: so are the terms.
        optimizer_steps = max(window["optimizer_steps"].item(), 1.0)
        for term in self.loss_terms:
            summary.scalars[f"{LOSS_PREFIX}{term}"] = window[term].item() / optimizer_steps
        ratio = LogRatioHistogram.summarize(
            {
                name.removeprefix(RATIO_PREFIX): value
                for name, value in window.items()
                if name.startswith(RATIO_PREFIX)
            },
            self.quantiles,
            histogram=self.histograms,
        )
        if ratio is None:
            return
        for name in ("mean", "std", "min", "max"):
            summary.scalars[f"{RATIO_PREFIX}{name}"] = ratio[name]
        for quantile, value in zip(self.quantiles, ratio["quantiles"], strict=True):
            summary.scalars[quantile_metric_name(quantile)] = value
        if ratio["nan_count"] > 0:
            summary.scalars[RATIO_NAN_COUNT] = ratio["nan_count"]
        if self.histograms:
            summary.histograms["ratio"] = ratio["histogram"]

    def _summarize_mismatch(self, mismatch: dict[str, torch.Tensor], summary: DiagnosticsSummary) -> None:
        ratio = LogRatioHistogram.summarize(mismatch, self.quantiles, histogram=self.histograms)
        if ratio is None or ratio["units"] == 0:
            return
        summary.scalars[f"{MISMATCH_PREFIX}/mean"] = ratio["mean"]
        summary.scalars[f"{MISMATCH_PREFIX}/min"] = ratio["min"]
        summary.scalars[f"{MISMATCH_PREFIX}/max"] = ratio["max"]
        summary.scalars[f"{MISMATCH_PREFIX}/outside_fraction"] = mismatch["outside"].item() / ratio["units"]
        for quantile, value in zip(self.quantiles, ratio["quantiles"], strict=True):
            summary.scalars[quantile_metric_name(quantile).replace(RATIO_PREFIX, f"{MISMATCH_PREFIX}/")] = value
        # Effective sample size over the number of units, (sum w)^2 / (N sum w^2), in (0, 1]: 1 when every weight is
        # equal, 1/N when one weight carries all. The raw ratios' sums are those of the histogram (kept as r - 1).
        units, deviation, squares = ratio["units"], mismatch["deviation_sum"].item(), mismatch["square_sum"].item()
        summary.scalars[f"{MISMATCH_PREFIX}/ess"] = _ess(units, units + deviation, units + 2 * deviation + squares)
        if mismatch["applied_units"].item() > 0:
            summary.scalars[IMPORTANCE_SAMPLING_RATIO_ESS] = _ess(
                mismatch["applied_units"].item(), mismatch["applied_sum"].item(), mismatch["applied_square_sum"].item()
            )
        if mismatch["k3_tokens"].item() > 0:
            summary.scalars[SAMPLER_K3_KL] = mismatch["k3_sum"].item() / mismatch["k3_tokens"].item()
        if self.histograms:
            summary.histograms[MISMATCH_PREFIX] = ratio["histogram"]


def _ess(units: float, weight_sum: float, square_sum: float) -> float:
    """`(sum w)^2 / (N * sum w^2)`: the effective sample size of N weights as a share of N (0 if every weight is 0)."""
    return weight_sum**2 / (units * square_sum) if square_sum > 0 else 0.0
