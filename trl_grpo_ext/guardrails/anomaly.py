"""Guardrails of a long run: non-finite updates, anomaly warnings, and reward functions that fail.

- `NonFiniteGuard` decides, from the gradient norm of each optimizer step, whether the step may reach the weights.
  A non-finite norm (a NaN or infinite loss or gradient anywhere, on any process) skips the step or stops training.
- `AnomalyMonitor` reads the logged metrics and warns, once per episode, when most groups carry no learning signal,
  the clip fraction stays high, the importance-ratio tail explodes or the KL jumps, saying what to change.
- `GuardedReward` wraps a reward function so that an exception names the function and the failing completion.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.utils import logging

__all__ = ["AnomalyMonitor", "GuardedReward", "NonFiniteGuard", "NonFiniteTrainingError", "RewardFunctionError"]

logger = logging.get_logger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Training stopped because updates were non-finite; the last good state was checkpointed."""


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the completion it failed on."""


class NonFiniteGuard:
    """Decides what happens to an optimizer step whose gradient norm is not finite.

    Args:
        policy (`str`): `"skip"` drops the step (counted), `"stop"` stops training, `"off"` lets it through.
        max_consecutive_skips (`int`): with `"skip"`, stop once this many steps in a row were skipped.
    """

    def __init__(self, policy: str = "skip", max_consecutive_skips: int = 10):
        if policy not in ("skip", "stop", "off"):
            raise ValueError(f"`nonfinite_policy` must be 'skip', 'stop' or 'off', got {policy!r}.")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0
        self.skipped = 0

    def decide(self, grad_norm_is_finite: bool) -> str:
        """`"step"`, `"skip"` or `"stop"` for the current optimizer step."""
        if self.policy == "off" or grad_norm_is_finite:
            self.consecutive = 0
            return "step"
        if self.policy == "stop":
            return "stop"
        self.consecutive += 1
        if self.max_consecutive_skips > 0 and self.consecutive > self.max_consecutive_skips:
            return "stop"
        self.skipped += 1
        return "skip"


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


def _is_batch_list(value, size: int) -> bool:
    return isinstance(value, list) and len(value) == size


class GuardedReward:
    """A reward function whose exceptions say which function failed and on which completion.

    On an exception, the function is called again on one completion at a time to find the first one that
    fails; the error names the function, that completion's index in the batch, its prompt and its text. Keeps the
    wrapped function's name (TRL logs `rewards/<name>/mean`).
    """

    def __init__(self, func: Callable, name: str):
        self.func = func
        self.__name__ = name

    def _failing_index(self, kwargs: dict) -> int | None:
        size = len(kwargs["completions"])
        for index in range(size):
            single = {key: [value[index]] if _is_batch_list(value, size) else value for key, value in kwargs.items()}
            try:
                result = self.func(**single)
                if inspect.iscoroutine(result):
                    result.close()
                    return None
            except Exception:  # noqa: BLE001 - looking for the completion that reproduces the error
                return index
        return None

    def _error(self, error: Exception, kwargs: dict) -> RewardFunctionError:
        index = self._failing_index(kwargs)
        if index is None:
            where = "on the batch (no single completion reproduces it)"
        else:
            prompt = kwargs.get("prompts", [None] * (index + 1))[index]
            where = (
                f"on completion {index} of the batch (prompt {prompt!r}, completion {kwargs['completions'][index]!r})"
            )
        return RewardFunctionError(
            f"Reward function '{self.__name__}' raised {type(error).__name__}: {error} {where}."
        )

    def __call__(self, **kwargs):
        try:
            return self.func(**kwargs)
        except Exception as error:
            raise self._error(error, kwargs) from error


class GuardedAsyncReward(GuardedReward):
    """`GuardedReward` for `async` reward functions."""

    async def __call__(self, **kwargs):
        try:
            return await self.func(**kwargs)
        except Exception as error:
            raise RewardFunctionError(
                f"Reward function '{self.__name__}' raised {type(error).__name__}: {error} on a batch of "
                f"{len(kwargs.get('completions', []))} completions."
            ) from error
