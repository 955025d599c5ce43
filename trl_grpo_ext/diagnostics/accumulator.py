"""`DiagnosticsAccumulator`: the running sums of the diagnostics between two log steps, on the device (no host
synchronisation per micro-batch), gathered once per log step as one vector: a `step_layout` row per micro-batch (the
sums behind TRL's own metrics, which TRL averages per micro-batch), then a `window_layout` row merged over them (the
loss's ratio statistics and terms, the length/reward sums, the sampler/trainer mismatch). Its size depends on the
number of micro-batches since the last log, never on the batch size or sequence length.
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
from .fields import FieldLayout
from .histogram import RATIO_FIELDS, quantile_metric_name, ratio_sums, summarize_ratios
from .rewards import (
    LENGTH_FIELDS,
    group_reward_stds,
    length_moments,
    summarize_length_correlation,
    summarize_reward_spread,
)

__all__ = ["LOSS_TERMS", "DiagnosticsAccumulator", "DiagnosticsSummary"]

# The terms of the loss, each in the units of the logged `loss` (they add up to it): logged as `loss/<term>`.
LOSS_TERMS = ("policy", "kl_penalty", "entropy_bonus", "router")
STEP_FIELDS = [
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
MISMATCH = IMPORTANCE_SAMPLING_RATIO_RAW
# Beside the raw ratios' statistics: the units outside the bounds; the sum of exp(d) - d - 1 over the tokens the
# sampler scored and their number (d = trainer_logp - sampler_logp); the units, sum and sum of squares of the weights
# the correction applies (none when it is off).
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


def _prefixed(fields: list[tuple], prefix: str) -> list[tuple]:
    return [(prefix + name, *rest) for name, *rest in fields]


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class DiagnosticsAccumulator:
    """Running sums of the diagnostics of one mode (train or eval) between two log steps.

    Args:
        ratio_stats (`bool`): accumulate the ratio distribution, the loss split and the reward spread; when `False`
            only TRL's own metrics (kl, entropy, clip ratios) are kept.
        quantiles (`list[float]`): ratio quantiles to report.
        histograms (`bool`): build the histograms for loggers that draw them.
        clip_metrics (`str`): one of `ops.loss_types.CLIP_METRICS`: which clip metrics the loss type has.
        loss_terms (`tuple[str, ...]`): the terms of `LOSS_TERMS` to report as `loss/<term>`.
        extra_metrics (`tuple[str, ...]`): further per-micro-batch metrics, each added as a `(sum, count)` pair by
            `add_loss_step` and reported as the pooled sum over the pooled count (like TRL's own).
        sampler_mismatch (`bool`): also pool the sampler/trainer mismatch of `add_sampler_mismatch` (vLLM).
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
        self.step_layout = FieldLayout([*STEP_FIELDS, *extras])
        window = []
        if ratio_stats:
            window += [*_prefixed(RATIO_FIELDS, RATIO_PREFIX), *((term, "sum") for term in LOSS_TERMS)]
            window += [("optimizer_steps", "sum"), *LENGTH_FIELDS]
        if sampler_mismatch:
            window += [*_prefixed(RATIO_FIELDS, f"{MISMATCH}/"), *((name, "sum") for name in MISMATCH_SUMS)]
        self.window_layout = FieldLayout(window)
        self.reset()

    def reset(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._window: torch.Tensor | None = None
        self._group_stds: list[torch.Tensor] = []
        self._unscored: list[torch.Tensor] = []  # [unscored, total] per generation batch

    def _add_to_window(self, values: dict[str, torch.Tensor]) -> None:
        self._window = self.window_layout.add(self._window, values)

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
            out (`GRPOLossOutput`): what `ops.policy_objective` returned for the micro-batch.
            entropies (`torch.Tensor` of shape `(N, T)`, *optional*): per-token entropies of the policy.
            loss_terms (`dict[str, torch.Tensor]`, *optional*): 0-dim loss terms in the units of the backward loss;
                default: `out.policy_loss` and `out.kl_penalty`.
            extras (`dict[str, tuple]`, *optional*): `(sum, count)` of each of `extra_metrics`.
            optimizer_step (`bool`): whether this micro-batch ends an optimizer step (in evaluation: every batch).
            carrier (`bool`): every row was skipped, the one left only carries the graph: no entropy is logged for
                it where every process's micro-batch is one (TRL's mean would take a 0 from it).
        """
        mask, device = out.mask, out.mask.device
        dtype = _accumulation_dtype(device)
        units = out.clip_units_per_row.to(dtype)
        low, high = out.low_clipped_per_row.to(dtype), out.high_clipped_per_row.to(dtype)
        with_units = units > 0
        nan = torch.full((), math.nan, dtype=dtype, device=device)  # a fill, not a host-to-device copy
        values = {
            KL: out.per_token_kl.to(dtype).sum(),
            ENTROPY: torch.where(mask, entropies.detach(), 0).to(dtype).sum() if entropies is not None else nan,
            "low": low.sum(),
            "high": high.sum(),
            "region": (low + high).sum(),  # a token cannot be both: low needs A < 0, high A > 0
            "tokens": mask.sum().to(dtype),
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
        # The ratio statistics, beside the loss, from the log ratios it computed
        window = {
            RATIO_PREFIX + name: value for name, value in ratio_sums(out.log_ratio, mask, dtype, out.ratio).items()
        }
        terms = {"policy": out.policy_loss, "kl_penalty": out.kl_penalty} if loss_terms is None else loss_terms
        window.update({term: value.detach().to(dtype) for term, value in terms.items()})
        window["optimizer_steps"] = torch.full((), float(optimizer_step), dtype=dtype, device=device)
        self._add_to_window(window)

    def add_rewards(
        self, rewards: torch.Tensor, num_generations: int, lengths: torch.Tensor | None = None, first_row: int = 0
    ) -> None:
        """Add the rewards of one generation batch, already gathered from every process. Device ops only.

        Args:
            rewards (`torch.Tensor` of shape `(N,)`): total reward per completion, NaN for unscored ones, ordered
                group-contiguously.
            num_generations (`int`): the group size G.
            lengths (`torch.Tensor` of shape `(n,)`, *optional*): this process's completion lengths, rows
                `first_row` to `first_row + n - 1` of `rewards` (TRL's process slice), for the length/reward sums.
            first_row (`int`): see `lengths`.
        """
        if not self.ratio_stats:
            return
        grouped = rewards.detach().to(_accumulation_dtype(rewards.device)).reshape(-1, num_generations)
        scored = ~torch.isnan(grouped)
        std = group_reward_stds(grouped, scored)
        self._group_stds.append(std)
        total = torch.full((), scored.numel(), dtype=torch.int64, device=scored.device)
        self._unscored.append(torch.stack([(~scored).sum(), total]))
        if lengths is not None:
            self._add_to_window(length_moments(grouped.flatten(), std, lengths, first_row, num_generations))

    def add_sampler_mismatch(self, mismatch) -> None:
        """Add the sampler/trainer mismatch of one generation batch. Device ops only.

        Args:
            mismatch (`extras.vllm.mismatch.SamplerMismatch`): its `log_ratio`, `units` and `outside` (`(N, T)`, or
                `(N, 1)` per sequence), `token_log_ratio` and `scored` (`(N, T)`) and `applied` (the correction's
                weights, or `None`).
        """
        if not self.sampler_mismatch:
            return
        units, scored = mismatch.units, mismatch.scored
        dtype = _accumulation_dtype(units.device)
        k3 = torch.where(scored, kl_estimator(mismatch.token_log_ratio.to(dtype)), 0.0)
        sums = {"outside": (mismatch.outside & units).sum(), "k3_sum": k3.sum(), "k3_tokens": scored.sum()}
        if mismatch.applied is not None:
            applied = torch.where(units, mismatch.applied.to(dtype), 0.0)
            sums.update(applied_units=units.sum(), applied_sum=applied.sum(), applied_square_sum=applied.pow(2).sum())
        window = {f"{MISMATCH}/{name}": value for name, value in ratio_sums(mismatch.log_ratio, units, dtype).items()}
        self._add_to_window(window | {name: value.to(dtype) for name, value in sums.items()})

    def pack(self) -> torch.Tensor | None:
        """This process's sums as one 1-dim vector (what the log step gathers), or `None` if nothing was added."""
        if not self._steps:
            return None
        steps = torch.cat(self._steps)
        window = self._window if self._window is not None else self.window_layout.identity(steps.device, steps.dtype)
        return torch.cat([steps, window])

    def summarize(self, gathered: torch.Tensor | None) -> DiagnosticsSummary:
        """Read the statistics off the gathered sums of all processes and reset.

        Args:
            gathered (`torch.Tensor` of shape `(num_processes, L)`, *optional*): the packed vectors of every
                process, `None` when no micro-batch was added since the last log (reward statistics only).
        """
        summary = DiagnosticsSummary()
        window = None
        if gathered is not None:
            gathered = gathered.to(torch.float64).cpu()
            steps_width = len(self._steps) * self.step_layout.width
            steps = gathered[:, :steps_width].reshape(gathered.shape[0], len(self._steps), -1)
            self._summarize_trl_metrics(self.step_layout.unpack(self.step_layout.reduce(steps)), summary)
            window = self.window_layout.unpack(self.window_layout.reduce(gathered[:, steps_width:]))
            if self.ratio_stats:
                self._summarize_ratio_and_loss(window, summary)
            if self.sampler_mismatch:
                self._summarize_mismatch(window, summary)
        elif self._window is not None:  # no loss step since the last log: this process's own sums
            window = self.window_layout.unpack(self._window.to(torch.float64).cpu())
        if self.ratio_stats and window is not None:
            summarize_length_correlation(window, summary.scalars)
        if self._group_stds:
            group_stds = torch.cat(self._group_stds).to(torch.float64).cpu()
            summarize_reward_spread(group_stds, summary.scalars, summary.histograms if self.histograms else None)
            unscored, total = torch.stack(self._unscored).sum(dim=0).tolist()
            summary.scalars[FRAC_REWARD_UNSCORED] = unscored / total
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
            for name in ("low_min", "high_max"):
                summary.per_step[f"{CLIP_RATIO_PREFIX}{name}"] = torch.where(
                    torch.isinf(steps[name]), math.nan, steps[name]
                ).tolist()
        elif self.clip_metrics == "cispo":
            summary.per_step[CISPO_CLIP_RATIO] = (steps["high"] / units).tolist()
        for name in self.extra_metrics:
            counted = steps[f"{name}/count"] > 0  # a carrier micro-batch adds (0, 0)
            summary.per_step[name] = (steps[f"{name}/sum"] / steps[f"{name}/count"])[counted].tolist()

    def _ratios(self, window: dict[str, torch.Tensor], prefix: str, summary: DiagnosticsSummary) -> dict | None:
        """The ratio statistics under `prefix`, with their mean, extremes, quantiles and histogram reported there."""
        values = {name.removeprefix(prefix): value for name, value in window.items() if name.startswith(prefix)}
        ratio = summarize_ratios(values, self.quantiles, histogram=self.histograms)
        if ratio is None:
            return None
        for name in ("mean", "min", "max"):
            summary.scalars[prefix + name] = ratio[name]
        for quantile, value in zip(self.quantiles, ratio["quantiles"], strict=True):
            summary.scalars[quantile_metric_name(quantile).replace(RATIO_PREFIX, prefix)] = value
        if self.histograms:
            summary.histograms[prefix.removesuffix("/")] = ratio["histogram"]
        return ratio

    def _summarize_ratio_and_loss(self, window: dict[str, torch.Tensor], summary: DiagnosticsSummary) -> None:
        # Trainer logs the mean over optimizer steps of each step's summed micro-batch losses: so are the terms.
        optimizer_steps = max(window["optimizer_steps"].item(), 1.0)
        for term in self.loss_terms:
            summary.scalars[f"{LOSS_PREFIX}{term}"] = window[term].item() / optimizer_steps
        ratio = self._ratios(window, RATIO_PREFIX, summary)
        if ratio is not None:
            summary.scalars[f"{RATIO_PREFIX}std"] = ratio["std"]
            if ratio["nan_count"] > 0:
                summary.scalars[RATIO_NAN_COUNT] = ratio["nan_count"]

    def _summarize_mismatch(self, window: dict[str, torch.Tensor], summary: DiagnosticsSummary) -> None:
        ratio = self._ratios(window, f"{MISMATCH}/", summary)
        if ratio is None:
            return
        units = ratio["units"]
        summary.scalars[f"{MISMATCH}/outside_fraction"] = window["outside"].item() / units
        # Effective sample size over the number of units, (sum w)^2 / (N sum w^2), in (0, 1]: 1 when every weight is
        # equal, 1/N when one weight carries all. The raw ratios' sums are kept as sums of r - 1.
        deviation, squares = window[f"{MISMATCH}/deviation_sum"].item(), window[f"{MISMATCH}/square_sum"].item()
        summary.scalars[f"{MISMATCH}/ess"] = _ess(units, units + deviation, units + 2 * deviation + squares)
        if window["applied_units"].item() > 0:
            summary.scalars[IMPORTANCE_SAMPLING_RATIO_ESS] = _ess(
                window["applied_units"].item(), window["applied_sum"].item(), window["applied_square_sum"].item()
            )
        if window["k3_tokens"].item() > 0:
            summary.scalars[SAMPLER_K3_KL] = window["k3_sum"].item() / window["k3_tokens"].item()


def _ess(units: float, weight_sum: float, square_sum: float) -> float:
    """`(sum w)^2 / (N * sum w^2)`: the effective sample size of N weights as a share of N (0 if every weight is 0)."""
    return weight_sum**2 / (units * square_sum) if square_sum > 0 else 0.0
