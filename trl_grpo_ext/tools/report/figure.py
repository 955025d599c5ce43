"""`report.png`: the training curves of a log history on nine panels, with the alarm episodes shaded on the panel
they concern (docs/diagnostics.md, "The report command")."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ...guardrails.anomaly import Episode

from ...guardrails.alarms import DEFAULTS, HELDOUT_KEY, ZERO_SPREAD_KEYS
from ...metrics import (
    CLIP_RATIO_HIGH_MEAN,
    CLIP_RATIO_LOW_MEAN,
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_MAX_LENGTH,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_MIN_LENGTH,
    ENTROPY,
    FRAC_REWARD_ZERO_STD,
    GRAD_NORM,
    KL,
    LOSS,
    LOSS_KL_PENALTY,
    LOSS_POLICY,
    RATIO_MAX,
    RATIO_MIN,
    RATIO_P05,
    RATIO_P50,
    RATIO_P95,
    REWARD,
    REWARD_STD_FRAC_ZERO_GROUPS,
    REWARD_STD_GROUP_MAX,
    REWARD_STD_GROUP_MEAN,
    REWARD_STD_GROUP_MIN,
    REWARDS_PREFIX,
)
from .health import HEALTHY


class Panel(NamedTuple):
    """One panel of the report: its title, the metrics it draws (`*` for any name part), the alarms shaded on it and
    the label of its y axis."""

    title: str
    metrics: tuple[str, ...]
    alarms: tuple[str, ...]
    ylabel: str


#: The panels, row by row.
PANELS = (
    Panel(
        "reward",
        (REWARD, "rewards/*/mean", "heldout/*/mean@*"),
        ("reward_vs_heldout", "plateau", "reward_drop", "reward_composition"),
        "reward",
    ),
    Panel(
        "reward spread: std inside each group",
        (REWARD_STD_GROUP_MEAN, *ZERO_SPREAD_KEYS),
        ("zero_std", "no_spread", "flat_groups", "reward_scale"),
        "std of the rewards of a group",
    ),
    Panel("KL to the reference", (KL,), ("kl_jump", "kl_high", "kl_growth"), "KL (mean per token)"),
    Panel(
        "clip fraction (tokens in the flat region)",
        (CLIP_RATIO_REGION_MEAN, CLIP_RATIO_LOW_MEAN, CLIP_RATIO_HIGH_MEAN),
        ("clip_fraction", "clip_asymmetry"),
        "share of tokens",
    ),
    Panel(
        "importance ratio r = pi / pi_old",
        (RATIO_P50, RATIO_P05, RATIO_P95),
        ("ratio_p95", "ratio_max"),
        "ratio (completion tokens)",
    ),
    Panel("loss = policy + kl_penalty", (LOSS, LOSS_POLICY, LOSS_KL_PENALTY), (), "loss"),
    Panel("entropy", (ENTROPY,), ("entropy_collapse",), "entropy (nats per token)"),
    Panel(
        "completion length (tokens)",
        (COMPLETIONS_MEAN_LENGTH, COMPLETIONS_CLIPPED_RATIO),
        ("truncation", "truncation_sustained", "length_drift", "length_growth", "length_in_group"),
        "tokens",
    ),
    Panel(
        "gradient norm",
        (GRAD_NORM,),
        ("grad_norm_spike", "no_gradient", "vanishing_gradient"),
        "gradient norm (before clipping)",
    ),
)
#: The label of the right axis of a panel that draws a share there.
RIGHT_LABELS = {
    REWARD_STD_FRAC_ZERO_GROUPS: "share of groups",
    FRAC_REWARD_ZERO_STD: "share of completions",
    COMPLETIONS_CLIPPED_RATIO: "share truncated",
}


def _logged(log_history: list[dict], pattern: str) -> bool:
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", ".+") + "$")
    return any(regex.match(key) for entry in log_history for key in entry if isinstance(entry[key], (int, float)))


def missing_panels(log_history: list[dict]) -> list[tuple[str, tuple[str, ...]]]:
    """The `(title, metrics)` of the panels of `PANELS` for which none of the metrics was logged."""
    return [
        (panel.title, panel.metrics) for panel in PANELS if not any(_logged(log_history, key) for key in panel.metrics)
    ]


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    """The steps and values of `key`, finite values only: an infinite one cannot be drawn (nor framed), a NaN is no
    value; the report's lines name the steps of both."""
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        drawable = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if drawable and "step" in entry:
            steps.append(entry["step"])
            values.append(value)
    return steps, values


def _band(ax, log_history: list[dict], low_key: str, high_key: str, label: str) -> tuple[list, list]:
    """Shade `low_key`..`high_key` where both were logged at the same steps; returns the two series' values."""
    low_steps, low = _series(log_history, low_key)
    high_steps, high = _series(log_history, high_key)
    if low_steps and low_steps == high_steps:
        ax.fill_between(low_steps, low, high, alpha=0.3, label=label)
    return low, high


def build_report_figure(
    log_history: list[dict],
    title: str | None = None,
    clip_range: tuple[float, float] = (0.2, 0.2),
    episodes: list[Episode] | None = None,
    thresholds: Mapping[str, float | None] | None = None,
    verdict: str | None = None,
) -> Figure | None:
    """The report as a matplotlib `Figure` of the nine `PANELS` over training steps. A series equal to one already
    drawn on the reward panel is named in that line's label; a panel whose metrics were not logged says so.

    Args:
        log_history: `trainer.state.log_history`.
        title: the run's name, in the figure's title ("<title>: GRPO training report").
        clip_range: `(epsilon_low, epsilon_high)`, drawn at `1 - epsilon_low` and `1 + epsilon_high`.
        episodes: alarm episodes (`health.assess(...).episodes`), shaded on the panel that names the alarm.
        thresholds: the run's alarm thresholds by alarm name (`AlarmSettings.thresholds`, `None` for an alarm off);
            default: `GRPOConfigExt`'s.
        verdict: the run's verdict (`RunHealth.headline()`), under the title: green where healthy, red otherwise.

    Returns:
        The figure, or `None` when the history holds no training metrics.
    """
    if not any(LOSS in entry for entry in log_history):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    thresholds = DEFAULTS | dict(thresholds or {})
    figure = Figure(figsize=(15, 11))
    FigureCanvasAgg(figure)  # a renderer, to measure the legends that the titles sit above
    axes = figure.subplots(3, 3, sharex=True)
    (reward_ax, spread_ax, kl_ax), (clip_ax, ratio_ax, loss_ax), (entropy_ax, length_ax, grad_ax) = axes
    right_axes: dict[Axes, Axes] = {}
    readings: dict[Axes, str] = {}

    reward_keys = [REWARD] + sorted(
        {key for entry in log_history for key in entry if key.startswith(REWARDS_PREFIX) and key.endswith("/mean")}
    )
    heldout_keys = sorted({key for entry in log_history for key in entry if HELDOUT_KEY.match(key)})
    drawn: list[tuple[list, list, object]] = []  # (steps, values, line): a series equal to one drawn joins its label
    for key in reward_keys + heldout_keys:
        steps, values = _series(log_history, key)
        if not steps:
            continue
        same = next((line for s, v, line in drawn if s == steps and _close(v, values)), None)
        if same is not None:
            same.set_label(f"{same.get_label()} = {key}")
            continue
        style = {"linewidth": 2 if key == REWARD else 1} if key in reward_keys else {"marker": "o", "markersize": 3}
        (line,) = reward_ax.plot(steps, values, "--" if key in heldout_keys else "-", label=key, **style)
        drawn.append((steps, values, line))

    readings[spread_ax] = _spread_panel(spread_ax, log_history, thresholds["zero_std"], right_axes)
    readings[kl_ax] = _kl_panel(kl_ax, log_history, thresholds["kl_high"])

    for key in (CLIP_RATIO_REGION_MEAN, CLIP_RATIO_LOW_MEAN, CLIP_RATIO_HIGH_MEAN):
        steps, values = _series(log_history, key)
        if steps:
            clip_ax.plot(steps, values, label=key.split("/")[1].replace("_mean", ""))

    _ratio_panel(ratio_ax, log_history, clip_range)

    for key in (LOSS, LOSS_POLICY, LOSS_KL_PENALTY):
        steps, values = _series(log_history, key)
        if steps:
            loss_ax.plot(steps, values, label=key, linewidth=2 if key == LOSS else 1)

    steps, values = _series(log_history, ENTROPY)
    if steps:
        entropy_ax.plot(steps, values, label=ENTROPY)

    _band(length_ax, log_history, COMPLETIONS_MIN_LENGTH, COMPLETIONS_MAX_LENGTH, "min-max")
    steps, values = _series(log_history, COMPLETIONS_MEAN_LENGTH)
    if steps:
        length_ax.plot(steps, values, label="mean", linewidth=2)
    right = _right_axis(length_ax, log_history, COMPLETIONS_CLIPPED_RATIO)
    if right is not None:
        right_axes[length_ax] = right

    steps, values = _series(log_history, GRAD_NORM)
    if steps:
        grad_ax.plot(steps, values, label=GRAD_NORM)

    for ax, panel in zip(axes.flat, PANELS, strict=True):
        if not any(_logged(log_history, key) for key in panel.metrics):
            ax.text(
                0.5, 0.5, f"not logged: {', '.join(panel.metrics)}", ha="center", va="center", transform=ax.transAxes
            )
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        _shade_alarms(ax, [episode for episode in episodes or [] if episode.name in panel.alarms])
        _legend_above(ax, right_axes.get(ax), readings.get(ax))
        ax.set_title(panel.title, pad=_height_above(ax) + 8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    _header(figure, f"{title}: GRPO training report" if title else "GRPO training report", verdict)
    return figure


def _header(figure: Figure, title: str, verdict: str | None) -> None:
    """The figure's title and, under it, the run's verdict, above every panel's title and legend."""
    top = 1 - 6 / (figure.get_figheight() * 72)  # 6 points from the top edge
    heading = figure.suptitle(title, y=top, va="top")
    texts = [heading]
    if verdict is not None:
        line = 1.6 * heading.get_fontsize() / (figure.get_figheight() * 72)
        color = "tab:green" if verdict == HEALTHY else "tab:red"
        texts.append(figure.text(0.5, top - line, verdict, ha="center", va="top", fontsize=10, color=color))
    renderer = figure.canvas.get_renderer()
    bottom = min(text.get_window_extent(renderer).y0 for text in texts) / figure.bbox.height
    figure.tight_layout(rect=(0, 0, 1, bottom - 0.005))
    # tight_layout leaves the legends above the axes out of its count: what still reaches into the header moves down
    reach = max(
        artist.get_window_extent(renderer).y1
        for ax in figure.axes
        for artist in (ax.title, ax.get_legend())
        if artist is not None and artist.get_visible()
    )
    overlap = (reach - bottom * figure.bbox.height) / figure.bbox.height + 0.005
    if overlap > 0:
        figure.subplots_adjust(top=figure.subplotpars.top - overlap)


def _spread_panel(
    ax: Axes, log_history: list[dict], zero_std_fraction: float | None, right_axes: dict[Axes, Axes]
) -> str | None:
    """The mean std of the groups, their min-max band where it changes (a 0/1 reward gives the same two edges at
    every step), the share of groups without spread on a right axis with the `zero_std` threshold. Returns the
    reading: that share at the end and on average, the band's fixed edges where it was left out."""
    low_steps, low = _series(log_history, REWARD_STD_GROUP_MIN)
    high_steps, high = _series(log_history, REWARD_STD_GROUP_MAX)
    fixed = bool(low_steps) and low_steps == high_steps and not (_varies(low) or _varies(high))
    if not fixed:
        _band(ax, log_history, REWARD_STD_GROUP_MIN, REWARD_STD_GROUP_MAX, "group min-max")
    steps, values = _series(log_history, REWARD_STD_GROUP_MEAN)
    if steps:
        ax.plot(steps, values, label="group mean", linewidth=2)
    parts = []
    key = next((key for key in ZERO_SPREAD_KEYS if _logged(log_history, key)), None)
    if key is not None:
        right = _right_axis(ax, log_history, key)
        right_axes[ax] = right
        steps, values = _series(log_history, key)
        mean = sum(values) / len(values)
        unit = RIGHT_LABELS[key].removeprefix("share of ")
        parts.append(f"no spread: {values[-1]:.0%} of {unit} at step {steps[-1]}, {mean:.0%} on average")
        if zero_std_fraction is not None:
            # A mark on the right edge, not a line across the panel: a line of the right axis's scale would cross
            # the left axis's curves, and read as their threshold.
            from matplotlib.transforms import blended_transform_factory  # matplotlib: only when drawing

            edge = blended_transform_factory(right.transAxes, right.transData)
            right.plot(
                [1.0],
                [zero_std_fraction],
                marker="<",
                markersize=9,
                linestyle="none",
                color="tab:red",
                transform=edge,
                clip_on=False,
                label="zero_std alarm (right)",
            )
            parts[-1] += f"; zero_std alarm at {zero_std_fraction:.0%}"
    if fixed:
        parts.append(f"std of a group from {low[0]:.3g} to {high[0]:.3g} at every step (no band)")
    return "\n".join(parts) or None


def _kl_panel(ax: Axes, log_history: list[dict], kl_max: float | None) -> str | None:
    """The KL, with the `kl_high` threshold where it is within twice the KL's peak (further up it would flatten the
    curve). Returns the reading: the peak against that threshold."""
    steps, values = _series(log_history, KL)
    if not steps:
        return None
    ax.plot(steps, values, label=KL)
    peak = max(range(len(values)), key=values.__getitem__)
    reading = f"peak {values[peak]:.3g} at step {steps[peak]}"
    if kl_max is None:
        return reading + "; alarm kl_high off"
    if kl_max <= 2 * values[peak]:
        ax.axhline(kl_max, color="tab:red", linestyle="--", linewidth=0.8, label="kl_high alarm")
    return reading + f", {values[peak] / kl_max:.0%} of the kl_high alarm's {kl_max:g}"


def _varies(values: list[float]) -> bool:
    return any(not math.isclose(value, values[0], rel_tol=1e-6, abs_tol=1e-9) for value in values)


def _legend_above(ax: Axes, right: Axes | None, reading: str | None) -> None:
    """One legend for `ax` and its right axis, above the axes (off the curves), titled with the panel's reading."""
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if not handles:
        return
    ax.legend(
        handles,
        labels,
        loc="lower left",
        bbox_to_anchor=(0, 1.01),
        borderaxespad=0,
        ncol=min(2, len(handles)),
        fontsize=7,
        frameon=False,
        title=reading,
        title_fontsize=8,
        alignment="left",
    )


def _height_above(ax: Axes) -> float:
    """The height of `ax`'s legend, in points (0 without one): the title goes above it."""
    legend = ax.get_legend()
    if legend is None:
        return 0.0
    extent = legend.get_window_extent(ax.figure.canvas.get_renderer())
    return extent.height * 72 / ax.figure.dpi


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def _right_axis(ax: Axes, log_history: list[dict], key: str) -> Axes | None:
    """A share in [0, 1] on its own axis at the right of `ax`; returns that axis, `None` where `key` was not logged."""
    steps, values = _series(log_history, key)
    if not steps:
        return None
    right = ax.twinx()
    right.plot(steps, values, ":", color="tab:red", label=f"{key} (right)")
    right.set_ylim(-0.05, 1.05)
    right.set_ylabel(RIGHT_LABELS.get(key, key))
    return right


def _ratio_panel(ax, log_history: list[dict], clip_range: tuple[float, float]) -> None:
    """The p05-p95 band and the median, framed with the clip range; the min and max where they stay in that frame,
    else a note of their extremes."""
    low, high = _band(ax, log_history, RATIO_P05, RATIO_P95, "p05-p95")
    steps, values = _series(log_history, RATIO_P50)
    if steps:
        ax.plot(steps, values, "-", label="p50")
    bottom = top = None
    if low and high:
        epsilon_low, epsilon_high = clip_range
        for bound in (1 - epsilon_low, 1 + epsilon_high):
            ax.axhline(bound, color="grey", linestyle="--", linewidth=0.8)
        spread = max(high) - min(low)
        bottom = min(min(low), 1 - epsilon_low) - 0.25 * spread - 0.05
        top = max(max(high), 1 + epsilon_high) + 0.25 * spread + 0.05
        if math.isfinite(bottom) and math.isfinite(top):  # values near the float range overflow the margin
            ax.set_ylim(bottom, top)
        else:
            bottom = top = None
    off_scale = []
    for key, extreme in ((RATIO_MIN, min), (RATIO_MAX, max)):
        steps, values = _series(log_history, key)
        if not steps:
            continue
        name = key.split("/")[1]
        label = f"{name} ({'lowest' if extreme is min else 'highest'} {extreme(values):.3g})"
        if bottom is None or all(bottom <= value <= top for value in values):
            ax.plot(steps, values, ":", label=label)
        else:
            off_scale.append(label)
    if off_scale:
        ax.text(
            0.99,
            0.02,
            "off scale: " + ", ".join(off_scale),
            ha="right",
            va="bottom",
            fontsize=8,
            transform=ax.transAxes,
        )


def _shade_alarms(ax, episodes: list[Episode]) -> None:
    """Each episode's steps shaded, half a step wider on each side so that a one-step episode shows."""
    named = set()
    for episode in episodes:
        if episode.start is None:
            continue
        end = episode.end if episode.end is not None else episode.start
        label = None if episode.name in named else f"alarm {episode.name}"
        named.add(episode.name)
        ax.axvspan(episode.start - 0.5, end + 0.5, color="tab:red", alpha=0.12, label=label)


def plot_training_report(
    log_history: list[dict],
    path: str | os.PathLike,
    title: str | None = None,
    clip_range: tuple[float, float] = (0.2, 0.2),
    episodes: list[Episode] | None = None,
    thresholds: Mapping[str, float | None] | None = None,
    verdict: str | None = None,
) -> str | None:
    """Draw `build_report_figure` (the same arguments) into the PNG `path`; the path, or `None` when nothing was
    drawn."""
    figure = build_report_figure(
        log_history, title=title, clip_range=clip_range, episodes=episodes, thresholds=thresholds, verdict=verdict
    )
    if figure is None:
        return None
    path = os.fspath(path)
    figure.savefig(path, dpi=100)
    return path
