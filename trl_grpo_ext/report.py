"""`report.png`: training curves of reward, reward spread inside groups, KL, clip fraction, the importance-ratio band
and the loss split, from the log history."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["build_report_figure", "plot_training_report"]


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
) -> Figure | None:
    """The report as a matplotlib `Figure` of six panels over training steps: reward (total and per function);
    reward spread inside groups (`reward_std/group_mean`, its `group_min`-`group_max` band, and
    `frac_reward_zero_std`, the share of completions whose group had no spread, on its own axis); KL; clip fraction;
    ratio p05/p50/p95 band with min and max; the loss and its split (`loss/policy`, `loss/kl_penalty`).

    Args:
        log_history: `trainer.state.log_history`.
        title: figure title.
        clip_range: `(epsilon_low, epsilon_high)`, drawn as dashed lines at `1 - epsilon_low` and `1 + epsilon_high`.

    Returns:
        The figure, or `None` when the history holds no training metrics (a run shorter than `logging_steps`).
    """
    if not any("loss" in entry for entry in log_history):
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 7))
    axes = figure.subplots(2, 3, sharex=True)
    (reward_ax, spread_ax, kl_ax), (clip_ax, ratio_ax, loss_ax) = axes

    reward_keys = ["reward"] + sorted(
        {key for entry in log_history for key in entry if key.startswith("rewards/") and key.endswith("/mean")}
    )
    for key in reward_keys:
        steps, values = _series(log_history, key)
        if steps:
            reward_ax.plot(steps, values, label=key, linewidth=2 if key == "reward" else 1)
    reward_ax.set_title("reward")

    # No spread inside a group means zero advantage: that group teaches nothing but the KL term.
    _band(spread_ax, log_history, "reward_std/group_min", "reward_std/group_max", "group min-max")
    steps, values = _series(log_history, "reward_std/group_mean")
    if steps:
        spread_ax.plot(steps, values, label="group mean", linewidth=2)
    steps, values = _series(log_history, "frac_reward_zero_std")
    if steps:
        zero_ax = spread_ax.twinx()
        zero_ax.plot(steps, values, ":", color="tab:red", label="frac_reward_zero_std (right)")
        zero_ax.set_ylim(-0.05, 1.05)
        zero_ax.legend(fontsize=8, loc="lower right")
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

    low, high = _band(ratio_ax, log_history, "ratio/p05", "ratio/p95", "p05-p95")
    for key, style in (("ratio/p50", "-"), ("ratio/min", ":"), ("ratio/max", ":")):
        steps, values = _series(log_history, key)
        if steps:
            label = key.split("/")[1]
            if key == "ratio/min":
                label += f" (lowest {min(values):.3g})"
            elif key == "ratio/max":
                label += f" (highest {max(values):.3g})"
            ratio_ax.plot(steps, values, style, label=label)
    if low and high:
        # Frame the p05-p95 band and the clip range 1 +- epsilon; single extreme tokens (min, max) may leave it.
        epsilon_low, epsilon_high = clip_range
        for bound in (1 - epsilon_low, 1 + epsilon_high):
            ratio_ax.axhline(bound, color="grey", linestyle="--", linewidth=0.8)
        spread = max(high) - min(low)
        ratio_ax.set_ylim(
            min(min(low), 1 - epsilon_low) - 0.25 * spread - 0.05,
            max(max(high), 1 + epsilon_high) + 0.25 * spread + 0.05,
        )
    ratio_ax.set_title("importance ratio r = pi / pi_old")

    for key in ("loss", "loss/policy", "loss/kl_penalty"):
        steps, values = _series(log_history, key)
        if steps:
            loss_ax.plot(steps, values, label=key, linewidth=2 if key == "loss" else 1)
    loss_ax.set_title("loss = policy + kl_penalty")

    for ax in axes.flat:
        if ax.has_data():
            ax.legend(fontsize=8, loc="upper left")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_training_report(
    log_history: list[dict],
    path: str | os.PathLike,
    title: str | None = None,
    clip_range: tuple[float, float] = (0.2, 0.2),
) -> str | None:
    """Draw `build_report_figure` into the PNG `path`.

    Returns:
        The path written, or `None` when the history holds no training metrics (nothing is written then).
    """
    figure = build_report_figure(log_history, title=title, clip_range=clip_range)
    if figure is None:
        return None
    path = os.fspath(path)
    figure.savefig(path, dpi=100)
    return path
