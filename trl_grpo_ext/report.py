"""`report.png`: training curves of reward, KL, clip fraction and the importance-ratio band, from the log history."""

from __future__ import annotations

import os

__all__ = ["plot_training_report"]


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and "step" in entry:
            steps.append(entry["step"])
            values.append(value)
    return steps, values


def plot_training_report(
    log_history: list[dict],
    path: str | os.PathLike,
    title: str | None = None,
    clip_range: tuple[float, float] = (0.2, 0.2),
) -> str | None:
    """Draw four panels (reward, KL, clip fraction, ratio p05/p50/p95 band) over training steps into `path`.

    Args:
        log_history: `trainer.state.log_history`.
        path: the PNG to write.
        title: figure title.
        clip_range: `(epsilon_low, epsilon_high)`, drawn as dashed lines at `1 - epsilon_low` and `1 + epsilon_high`.

    Returns:
        The path written, or `None` when the history holds no training metrics (nothing is written then).
    """
    train_entries = [entry for entry in log_history if "loss" in entry]
    if not train_entries:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (reward_ax, kl_ax), (clip_ax, ratio_ax) = axes

    reward_keys = ["reward"] + sorted(
        {key for entry in log_history for key in entry if key.startswith("rewards/") and key.endswith("/mean")}
    )
    for key in reward_keys:
        steps, values = _series(log_history, key)
        if steps:
            reward_ax.plot(steps, values, label=key, linewidth=2 if key == "reward" else 1)
    reward_ax.set_title("reward")

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

    low_steps, low = _series(log_history, "ratio/p05")
    high_steps, high = _series(log_history, "ratio/p95")
    if low_steps and low_steps == high_steps:
        ratio_ax.fill_between(low_steps, low, high, alpha=0.3, label="p05-p95")
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

    for ax in axes.flat:
        if ax.has_data():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = os.fspath(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
