"""`AnomalyMonitor`: warnings, from the logged metrics, about the failure modes a GRPO practitioner watches for.

It warns, once per episode, when most groups carry no learning signal, the clip fraction stays high, the
importance-ratio tail explodes or the KL jumps, saying what to change.
"""

from __future__ import annotations

import math
import statistics

from transformers import TrainerCallback
from transformers.utils import logging

__all__ = ["AnomalyMonitor"]

logger = logging.get_logger(__name__)


class AnomalyMonitor(TrainerCallback):
    """Warns, from the logged metrics, about the failure modes a GRPO practitioner watches for.

    Each warning fires when its condition starts and again only after the condition has cleared for a log step,
    so a long episode gives one warning, not one per log line.

    Args:
        zero_std_fraction: warn when `frac_reward_zero_std` is at least this (`None`: off).
        clip_fraction: warn when `clip_ratio/region_mean` is above this for `patience` log steps in a row.
        ratio_p95, ratio_max: warn when `ratio/p95` or `ratio/max` exceed these.
        kl_jump: warn when `kl` exceeds this factor times the median of the previous (5 to 10) logged values, taken
            as at least 0.01.
        patience: see `clip_fraction`.
    """

    KL_FLOOR = 1e-2  # a median below this counts as this: KL grows from 0 at the start of every run
    KL_HISTORY = 5  # logged values needed before a jump can be judged

    def __init__(
        self,
        *,
        zero_std_fraction: float | None = 0.9,
        clip_fraction: float | None = 0.2,
        ratio_p95: float | None = 1.5,
        ratio_max: float | None = 100.0,
        kl_jump: float | None = 10.0,
        patience: int = 3,
    ):
        self.thresholds = {
            "zero_std": zero_std_fraction,
            "clip": clip_fraction,
            "ratio_p95": ratio_p95,
            "ratio_max": ratio_max,
            "kl_jump": kl_jump,
        }
        self.patience = max(1, patience)
        self.active: dict[str, bool] = {}
        self.clip_streak = 0
        self.kl_history: list[float] = []
        self.warnings: list[str] = []  # every warning given, for callers and tests

    def _conditions(self, logs: dict) -> dict[str, str | None]:
        """Warning text per condition that holds now (`None` where it does not, absent where it was not logged)."""
        found: dict[str, str | None] = {}
        limit = self.thresholds["zero_std"]
        if limit is not None and isinstance(logs.get("frac_reward_zero_std"), (int, float)):
            value = logs["frac_reward_zero_std"]
            found["zero_std"] = (
                f"{value:.0%} of completions are in groups whose rewards are all equal: those groups give no "
                "learning signal (only the KL term). Make the prompts neither too easy nor too hard for the model, "
                "raise num_generations or temperature, or use a reward with partial credit."
                if value >= limit
                else None
            )
        limit = self.thresholds["clip"]
        if limit is not None and isinstance(logs.get("clip_ratio/region_mean"), (int, float)):
            value = logs["clip_ratio/region_mean"]
            self.clip_streak = self.clip_streak + 1 if value > limit else 0
            found["clip"] = (
                f"clip_ratio/region_mean has stayed above {limit} for {self.clip_streak} log steps ({value:.2f} now): "
                "many tokens sit in the flat, zero-gradient part of the surrogate. Lower the learning rate or "
                "num_iterations, or widen epsilon."
                if self.clip_streak >= self.patience
                else None
            )
        for key, name in (("ratio/p95", "ratio_p95"), ("ratio/max", "ratio_max")):
            limit = self.thresholds[name]
            if limit is not None and isinstance(logs.get(key), (int, float)):
                value = logs[key]
                found[name] = (
                    f"{key} = {value:.3g} exceeds {limit}: the policy moved far from the one that sampled the "
                    "completions. Lower the learning rate or num_iterations; with vLLM, check that it samples with "
                    "the same weights and sampling settings as the trainer."
                    if value > limit or not math.isfinite(value)
                    else None
                )
        limit = self.thresholds["kl_jump"]
        if limit is not None and isinstance(logs.get("kl"), (int, float)):
            value = logs["kl"]
            baseline = statistics.median(self.kl_history) if len(self.kl_history) >= self.KL_HISTORY else None
            jumped = baseline is not None and value > limit * max(baseline, self.KL_FLOOR)
            found["kl_jump"] = (
                f"kl jumped to {value:.3g}, more than {limit:g}x its recent median {baseline:.3g}: the policy is "
                "leaving the reference fast. Lower the learning rate, raise beta, or check the rewards for hacking."
                if jumped
                else None
            )
            self.kl_history = (self.kl_history + [value])[-10:]
        return found

    def check(self, logs: dict) -> list[str]:
        """Update with one log entry; return the warnings that start with it (also logged)."""
        started = []
        for name, message in self._conditions(logs).items():
            if message is not None and not self.active.get(name):
                started.append(message)
                logger.warning(message)
            self.active[name] = message is not None
        self.warnings += started
        return started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero and "loss" in logs:
            self.check(logs)
