"""`report.png`: training curves of reward, reward spread inside groups, KL, clip fraction, the importance-ratio band,
the loss split, entropy, completion length and gradient norm, from the log history, with the alarm episodes
shaded on the panel they concern."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..guardrails.anomaly import Episode

from ..guardrails.alarms import HELDOUT_KEY

__all__ = ["PANELS", "build_report_figure", "missing_panels", "plot_training_report"]

#: The panels, row by row: title, the metrics it draws (`*` for any name part), the alarms shaded on it.
PANELS = (
    ("reward", ("reward", "rewards/*/mean", "heldout/*/mean@*"), ("reward_vs_heldout",)),
    (
        "reward spread: std inside each group",
        ("reward_std/group_mean", "frac_reward_zero_std"),
        ("zero_std", "no_spread"),
    ),
    ("KL to the reference", ("kl", "loss/kl_penalty"), ("kl_jump",)),
    (
        "clip fraction (tokens in the flat region)",
        ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"),
        ("clip_fraction",),
    ),
    ("importance ratio r = pi / pi_old", ("ratio/p50", "ratio/p05", "ratio/p95"), ("ratio_p95", "ratio_max")),
    ("loss = policy + kl_penalty", ("loss", "loss/policy", "loss/kl_penalty"), ()),
    ("entropy", ("entropy",), ("entropy_collapse",)),
    (
        "completion length (tokens)",
        ("completions/mean_length", "completions/clipped_ratio"),
        ("truncation", "length_drift", "length_in_group"),
    ),
    ("gradient norm", ("grad_norm",), ("grad_norm_spike",)),
)


def _logged(log_history: list[dict], pattern: str) -> bool:
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", ".+") + "$")
    return any(regex.match(key) for entry in log_history for key in entry if isinstance(entry[key], (int, float)))


def missing_panels(log_history: list[dict]) -> list[tuple[str, tuple[str, ...]]]:
    """The `(title, metrics)` of the panels of `PANELS` for which none of the metrics was logged."""
    return [(title, keys) for title, keys, _ in PANELS if not any(_logged(log_history, key) for key in keys)]


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and "step" in entry:
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
) -> Figure | None:
    """The report as a matplotlib `Figure` of the nine `PANELS` over training steps: reward (total, per function,
    held-out metrics); reward spread inside groups (`reward_std/group_mean`, its `group_min`-`group_max` band, and
    `frac_reward_zero_std`, the share of completions whose group had no spread, on its own axis); KL; clip fraction;
    ratio p05/p50/p95 band with min and max; the loss and its split (`loss/policy`, `loss/kl_penalty`); entropy;
    completion length (mean, min-max band, and the truncated share on its own axis); gradient norm. A panel whose
    metrics were not logged (a stock TRL run has no `ratio/*`) says so.

    Args:
        log_history: `trainer.state.log_history`.
        title: figure title.
        clip_range: `(epsilon_low, epsilon_high)`, drawn as dashed lines at `1 - epsilon_low` and `1 + epsilon_high`.
        episodes: alarm episodes (`AnomalyMonitor.episodes`, `health.assess(...).episodes`), shaded over their steps
            on the panel of `PANELS` that names the alarm.

    Returns:
        The figure, or `None` when the history holds no training metrics (a run shorter than `logging_steps`).
    """
    if not any("loss" in entry for entry in log_history):
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 10))
    axes = figure.subplots(3, 3, sharex=True)
    (reward_ax, spread_ax, kl_ax), (clip_ax, ratio_ax, loss_ax), (entropy_ax, length_ax, grad_ax) = axes

    reward_keys = ["reward"] + sorted(
        {key for entry in log_history for key in entry if key.startswith("rewards/") and key.endswith("/mean")}
    )
    for key in reward_keys:
        steps, values = _series(log_history, key)
        if steps:
            reward_ax.plot(steps, values, label=key, linewidth=2 if key == "reward" else 1)
    for key in sorted({key for entry in log_history for key in entry if HELDOUT_KEY.match(key)}):
        steps, values = _series(log_history, key)
        if steps:
            reward_ax.plot(steps, values, "o--", label=key, markersize=3)
    reward_ax.set_title("reward")

    # No spread inside a group means zero advantage: that group teaches nothing but the KL term.
    _band(spread_ax, log_history, "reward_std/group_min", "reward_std/group_max", "group min-max")
    steps, values = _series(log_history, "reward_std/group_mean")
    if steps:
        spread_ax.plot(steps, values, label="group mean", linewidth=2)
    _right_axis(spread_ax, log_history, "frac_reward_zero_std")
    spread_ax.set_title("reward spread: std inside each group")

    for key in ("kl", "loss/kl_penalty"):
        steps, values = _series(log_history, key)
        if steps:
            kl_ax.plot(steps, values, label=key)
    kl_ax.set_title("KL to the reference")

    for key in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        steps, values = _series(log_history, key)
        if steps:
            clip_ax.plot(steps, values, label=key.split("/")[1].replace("_mean", ""))
    clip_ax.set_title("clip fraction (tokens in the flat region)")

    _ratio_panel(ratio_ax, log_history, clip_range)

    for key in ("loss", "loss/policy", "loss/kl_penalty"):
        steps, values = _series(log_history, key)
        if steps:
            loss_ax.plot(steps, values, label=key, linewidth=2 if key == "loss" else 1)
    loss_ax.set_title("loss = policy + kl_penalty")

    steps, values = _series(log_history, "entropy")
    if steps:
        entropy_ax.plot(steps, values, label="entropy")
    entropy_ax.set_title("entropy")

    _band(length_ax, log_history, "completions/min_length", "completions/max_length", "min-max")
    steps, values = _series(log_history, "completions/mean_length")
    if steps:
        length_ax.plot(steps, values, label="mean", linewidth=2)
    _right_axis(length_ax, log_history, "completions/clipped_ratio")
    length_ax.set_title("completion length (tokens)")

    steps, values = _series(log_history, "grad_norm")
    if steps:
        grad_ax.plot(steps, values, label="grad_norm")
    grad_ax.set_title("gradient norm")

    for ax, (_, keys, alarms) in zip(axes.flat, PANELS, strict=True):
        if ax.has_data():
            ax.legend(fontsize=8, loc="upper left")
        if not any(_logged(log_history, key) for key in keys):
            ax.text(0.5, 0.5, f"not logged: {', '.join(keys)}", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
        _shade_alarms(ax, [episode for episode in episodes or [] if episode.name in alarms])
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def _right_axis(ax, log_history: list[dict], key: str) -> None:
    """A share in [0, 1] on its own axis at the right of `ax`."""
    steps, values = _series(log_history, key)
    if steps:
        right = ax.twinx()
        right.plot(steps, values, ":", color="tab:red", label=f"{key} (right)")
        right.set_ylim(-0.05, 1.05)
        right.legend(fontsize=8, loc="lower right")


def _ratio_panel(ax, log_history: list[dict], clip_range: tuple[float, float]) -> None:
    low, high = _band(ax, log_history, "ratio/p05", "ratio/p95", "p05-p95")
    for key, style in (("ratio/p50", "-"), ("ratio/min", ":"), ("ratio/max", ":")):
        steps, values = _series(log_history, key)
        if steps:
            label = key.split("/")[1]
            if key == "ratio/min":
                label += f" (lowest {min(values):.3g})"
            elif key == "ratio/max":
                label += f" (highest {max(values):.3g})"
            ax.plot(steps, values, style, label=label)
    if low and high:
        # Frame the p05-p95 band and the clip range 1 +- epsilon; single extreme tokens (min, max) may leave it.
        epsilon_low, epsilon_high = clip_range
        for bound in (1 - epsilon_low, 1 + epsilon_high):
            ax.axhline(bound, color="grey", linestyle="--", linewidth=0.8)
        spread = max(high) - min(low)
        ax.set_ylim(
            min(min(low), 1 - epsilon_low) - 0.25 * spread - 0.05,
            max(max(high), 1 + epsilon_high) + 0.25 * spread + 0.05,
        )
    ax.set_title("importance ratio r = pi / pi_old")


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
    if named:
        ax.legend(fontsize=8, loc="upper left")


def plot_training_report(
    log_history: list[dict],
    path: str | os.PathLike,
    title: str | None = None,
    clip_range: tuple[float, float] = (0.2, 0.2),
    episodes: list[Episode] | None = None,
) -> str | None:
    """Draw `build_report_figure` (see there for the arguments) into the PNG `path`.

    Returns:
        The path written, or `None` when the history holds no training metrics (nothing is written then).
    """
    figure = build_report_figure(log_history, title=title, clip_range=clip_range, episodes=episodes)
    if figure is None:
        return None
    path = os.fspath(path)
    figure.savefig(path, dpi=100)
    return path
