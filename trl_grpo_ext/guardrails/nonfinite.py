"""What happens to an optimizer step whose loss or gradient is NaN or infinite: `NonFiniteGuard` decides on each
step, from the global gradient norm (and, with fp16 or DeepSpeed, a flag of each micro-batch's loss kept on the
device), and `NonFiniteEnforcer` carries its verdict out for `GRPOTrainerExt`'s `training_step` and `_get_grad_norm`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..choices import NONFINITE_POLICIES

if TYPE_CHECKING:
    from ..checkpointing import Checkpoints

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteGuard",
    "NonFiniteEnforcer",
    "NonFiniteTrainingError",
    "StepVerdict",
    "report_step_skipped",
]

logger = logging.get_logger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Training stopped because an update was non-finite; the message names the last good checkpoint."""


@dataclass(frozen=True)
class StepVerdict:
    """What the guard decided for one optimizer step.

    Attributes:
        action: `"step"` (let it through), `"skip"` (drop the update), `"stop"` (stop training), or `"overflow"` (a
            routine fp16 loss-scale overflow, left to the scaler or engine that already skips it).
        applied: with `"stop"`, whether the non-finite update had already reached the weights (an engine that
            steps inside `backward` and did not skip it).
    """

    action: str
    applied: bool = False


class NonFiniteGuard:
    """Decides what happens to an optimizer step whose loss or gradient is not finite.

    Args:
        policy (`str`): `"skip"` drops the step (counted), `"stop"` stops training, `"off"` lets it through.
        max_consecutive_skips (`int`): with `"skip"`, stop once more than this many steps in a row were skipped
            (0: never).
    """

    def __init__(self, policy: str = "skip", max_consecutive_skips: int = 10):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"`nonfinite_policy` must be one of {NONFINITE_POLICIES}, got {policy!r}.")
        if max_consecutive_skips < 0:
            raise ValueError(f"`max_nonfinite_skips` must be >= 0, got {max_consecutive_skips}.")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0
        self.skipped = 0
        self._losses_finite: torch.Tensor | None = None

    def record_loss(self, loss: torch.Tensor) -> None:
        """Note whether one micro-batch's loss is finite. Device ops only: no host sync."""
        if self.policy == "off":
            return
        finite = torch.isfinite(loss.detach()).all()
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite

    def state_dict(self) -> dict[str, int]:
        """The counters a resumed run continues from."""
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))

    def pop_losses_finite(self) -> torch.Tensor | None:
        """The flag `record_loss` built since the last call (a 0-dim bool tensor, `None` if nothing was recorded)."""
        flag, self._losses_finite = self._losses_finite, None
        return flag

    def judge(
        self,
        grad_norm_is_finite: bool,
        *,
        loss_scaled: bool = False,
        engine_stepped: bool = False,
        engine_skipped: bool = False,
        any_loss_nonfinite: Callable[[], bool] = lambda: True,
    ) -> StepVerdict:
        """The verdict on the current optimizer step.

        Args:
            grad_norm_is_finite (`bool`): whether the global gradient norm is finite.
            loss_scaled (`bool`): fp16 with a loss scaler (gradient overflows are routine and handled by it).
            engine_stepped (`bool`): the engine already ran its optimizer step inside `backward` (DeepSpeed).
            engine_skipped (`bool`): that engine skipped the update (its overflow check fired).
            any_loss_nonfinite (`Callable[[], bool]`): whether any process had a non-finite loss in this step;
                called only when the answer matters, and then on every process alike (it may be a collective).

        Returns:
            [`StepVerdict`].
        """
        if self.policy == "off" or (grad_norm_is_finite and not engine_skipped):
            self.consecutive = 0
            return StepVerdict("step")
        if loss_scaled and not any_loss_nonfinite():
            return StepVerdict("overflow")
        if engine_stepped and not engine_skipped:
            return StepVerdict("stop", applied=True)
        if self.policy == "stop":
            return StepVerdict("stop")
        self.consecutive += 1
        if self.max_consecutive_skips > 0 and self.consecutive > self.max_consecutive_skips:
            return StepVerdict("stop")
        self.skipped += 1
        return StepVerdict("skip")


def report_step_skipped(optimizer, skipped: bool) -> None:
    """Make `accelerator.optimizer_step_was_skipped` report a step whose gradients the guard dropped.

    Trainer advances the learning-rate scheduler only when that property is false (the convention for updates that a
    gradient scaler skips). accelerate's `AcceleratedOptimizer` reads it from `_is_overflow`, which only its gradient
    scaler sets; without a scaler the guard sets it, for every step, to whether the step was dropped.

    Raises:
        TypeError: for an optimizer that has no such flag (not prepared by accelerate).
    """
    if not hasattr(optimizer, "_is_overflow"):
        raise TypeError(
            f"{type(optimizer).__name__} does not report skipped steps to the scheduler; nonfinite_policy='skip' "
            "needs the optimizer that accelerate prepares (AcceleratedOptimizer)."
        )
    optimizer._is_overflow = skipped


class NonFiniteEnforcer:
    """Carries the guard's verdicts out in a `GRPOTrainer`: `GRPOTrainerExt.training_step` hands it each micro-batch's
    loss, and `GRPOTrainerExt._get_grad_norm` the step's gradient norm before the optimizer step.

    Args:
        trainer (`GRPOTrainer`): its accelerator, optimizer, state and engine are read.
        guard (`NonFiniteGuard`): the decisions.
        checkpoints (`Checkpoints`): writes the checkpoint of the state before a stopped step.
    """

    def __init__(self, trainer, guard: NonFiniteGuard, checkpoints: Checkpoints):
        self.trainer, self.guard, self.checkpoints = trainer, guard, checkpoints
        if guard.policy != "off":
            checkpoints.track_step_start()

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss that went into backward, judged at the optimizer step."""
        self.guard.record_loss(loss)

    def judge_step(self, model, grad_norm):
        """Trainer's gradient norm of the step about to be taken, after the guard's verdict on it was carried out
        (the update dropped, or training stopped with `NonFiniteTrainingError`)."""
        trainer, guard = self.trainer, self.guard
        accelerator = trainer.accelerator
        losses_finite = guard.pop_losses_finite()
        if guard.policy == "off" or grad_norm is None:
            return grad_norm

        def any_loss_nonfinite() -> bool:  # one collective, reached by every process alike (see `judge`)
            flag = torch.ones((), device=accelerator.device) if losses_finite is None else losses_finite.float()
            return bool(accelerator.reduce(1.0 - flag, reduction="sum").item() > 0)

        deepspeed = trainer.is_deepspeed_enabled
        # The norm is global (gradients are already reduced across processes): every process decides alike.
        verdict = guard.judge(
            math.isfinite(float(grad_norm)),
            loss_scaled=accelerator.scaler is not None or (deepspeed and trainer.args.fp16),
            engine_stepped=deepspeed,
            engine_skipped=deepspeed and accelerator.optimizer_step_was_skipped,
            any_loss_nonfinite=any_loss_nonfinite,
        )
        own_skip_flag = not deepspeed and accelerator.scaler is None
        if own_skip_flag:
            report_step_skipped(trainer.optimizer, verdict.action == "skip")
        if verdict.action in ("step", "overflow"):
            return grad_norm
        step = trainer.state.global_step + 1
        if verdict.action == "skip":
            if own_skip_flag:
                # Optimizers leave parameters without a gradient untouched: no update, no momentum, no weight decay.
                model.zero_grad(set_to_none=True)
            # Otherwise the engine already skipped it, or the gradient scaler will: its gradients are non-finite.
            logger.warning(
                f"Step {step}: the gradient norm is {float(grad_norm)}; the update is skipped "
                f"({guard.skipped} skipped so far, nonfinite_policy='skip')."
            )
            return grad_norm
        if not deepspeed:  # the engine drops the gradients itself (and its `zero_grad` takes no `set_to_none`)
            model.zero_grad(set_to_none=True)
        self._stop(step, float(grad_norm), applied=verdict.applied)  # FSDP2: a DTensor

    def _stop(self, step: int, grad_norm: float, applied: bool) -> None:
        """Raise `NonFiniteTrainingError`, naming a checkpoint of the state before this step (written if missing)."""
        cause = f"Step {step}: the gradient norm is {grad_norm} (a NaN or infinite loss or gradient"
        if self.guard.consecutive:
            cause += f", {self.guard.consecutive} steps in a row"
        if applied:
            run_dir = self.trainer._get_output_dir(trial=None)
            last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
            raise NonFiniteTrainingError(
                f"{cause}). The DeepSpeed engine applied this update inside backward without skipping it, so the "
                f"weights in memory are no longer good; resume from the last checkpoint ({last or 'none was saved'}). "
                'Turn the engine\'s overflow check on (bf16: "check_grad_overflow": true) so that such steps are '
                "skipped, lower the learning rate, or check the rewards and inputs for NaN."
            )
        checkpoint = self.checkpoints.save_state_before_step()
        raise NonFiniteTrainingError(
            f"{cause}). Training stopped before the update reached the weights; the last good state is in "
            f"{checkpoint}. Lower the learning rate, check the rewards and inputs for NaN, or set "
            "nonfinite_policy='skip'."
        )
