"""Crash-safe checkpoints and exact resume for GRPO.

Two things make a GRPO run resumable to the bit:

- A checkpoint appears under its final name (`checkpoint-<step>`) only once it is complete. It is written into a
  staging folder (`_checkpoint-in-progress/`, ignored by `push_to_hub` and by `get_last_checkpoint`) and renamed
  when every file is in place, so a process killed while writing leaves nothing that a resume would pick.
- TRL keeps, between optimizer steps, the completions it generated for the coming steps (`num_iterations > 1`, or
  more generation batches than accumulation steps) and a micro-step counter that schedules generation. Neither is
  in Trainer's checkpoint; resuming without them regenerates at a different step and the run diverges. They are
  saved per process in `grpo_state_rank<k>.pt` and restored on resume.

`StepStart` remembers that state, and the random number generators, at the start of an optimizer step, so that a
step stopped half-way (a non-finite update) can still be checkpointed as the state before it.

`CheckpointingMixin` wires this into a `GRPOTrainer` subclass through Trainer's own save and load hooks.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

__all__ = [
    "STAGING_DIR",
    "CheckpointingMixin",
    "StepStart",
    "capture_rng",
    "grpo_state_path",
    "load_grpo_state",
    "publish_checkpoint",
    "save_grpo_state",
]

STAGING_DIR = "_checkpoint-in-progress"


def grpo_state_path(checkpoint_dir: str, process_index: int) -> str:
    return os.path.join(checkpoint_dir, f"grpo_state_rank{process_index}.pt")


def _to_device(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def save_grpo_state(
    checkpoint_dir: str, process_index: int, step: int, buffered_inputs: list | None, extras: dict | None = None
) -> None:
    """Save TRL's micro-step counter and buffered generations of this process (moved to the CPU), and `extras`: the
    resume state of the mixed-in concerns (e.g. the non-finite guard's counters)."""
    state = {"step": step, "buffered_inputs": _to_device(buffered_inputs, "cpu"), "extras": extras or {}}
    temporary = grpo_state_path(checkpoint_dir, process_index) + ".tmp"
    torch.save(state, temporary)
    os.replace(temporary, grpo_state_path(checkpoint_dir, process_index))


def load_grpo_state(checkpoint_dir: str, process_index: int, device: torch.device | str) -> dict | None:
    """The state `save_grpo_state` wrote for this process, with tensors on `device`; `None` if there is none."""
    path = grpo_state_path(checkpoint_dir, process_index)
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["buffered_inputs"] = _to_device(state["buffered_inputs"], device)
    return state


def _fsync_directory(path: str) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def publish_checkpoint(staged: str, final: str) -> None:
    """Move a completely written checkpoint folder to its final name, replacing an older one of the same name.

    The final name appears in one `rename`: a reader sees either no checkpoint or a complete one.
    """
    for root, _, files in os.walk(staged):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
    if os.path.exists(final):
        retired = final + ".replaced"
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(final, retired)
        os.rename(staged, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staged, final)
    _fsync_directory(os.path.dirname(final))


def capture_rng() -> dict[str, Any]:
    """The Python, NumPy, torch CPU (and CUDA) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclass
class StepStart:
    """TRL's generation schedule and the random number generators at the start of an optimizer step.

    Attributes:
        step (`int`): TRL's micro-step counter `_step`.
        buffered_inputs (`list` or `None`): TRL's `_buffered_inputs` (the same objects: TRL replaces the list when it
            generates, it does not change it in place).
        rng (`dict`): the Python, NumPy, torch CPU (and CUDA) generator states.
    """

    step: int
    buffered_inputs: list | None
    rng: dict[str, Any] = field(default_factory=capture_rng)

    def restore_rng(self) -> None:
        """Put the generators back to where they were when this was captured."""
        random.setstate(self.rng["python"])
        np.random.set_state(self.rng["numpy"])
        torch.random.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])


class CheckpointingMixin:
    """Crash-safe checkpoints that are uploaded once complete, and exact resume, for a `GRPOTrainer` subclass.

    Trainer's and TRL's save code write to `<self._get_output_dir()>/checkpoint-<step>`: while a checkpoint is being
    written, `_get_output_dir` names the staging folder, so that every file lands there first.
    """

    _saving_into_staging = False

    def _resume_extras(self) -> dict:
        """State of other concerns to save with each checkpoint; a mixin adds its own and calls `super()`."""
        return {}

    def _restore_resume_extras(self, extras: dict) -> None:
        """Restore what `_resume_extras` saved (a mixin takes its own and calls `super()`)."""

    def _get_output_dir(self, trial) -> str:
        """Trainer's run folder; while a checkpoint is being written, its staging folder inside it."""
        run_dir = super()._get_output_dir(trial=trial)
        return os.path.join(run_dir, STAGING_DIR) if self._saving_into_staging else run_dir

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Trainer asks for the upload from inside its save, i.e. of the staging folder, which is renamed right after;
        # `_save_checkpoint` asks again with the published folder once it is complete.
        if not self._saving_into_staging:
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into a staging folder, give it its final name once complete, then upload it."""
        final_run_dir = self._get_output_dir(trial=trial)
        staging_run_dir = os.path.join(final_run_dir, STAGING_DIR)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging_run_dir, ignore_errors=True)  # left over by a process killed while saving
        self.accelerator.wait_for_everyone()
        self._saving_into_staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_into_staging = False
        staged = os.path.join(staging_run_dir, folder)
        os.makedirs(staged, exist_ok=True)
        rank = self.accelerator.process_index
        save_grpo_state(staged, rank, self._step, self._buffered_inputs, self._resume_extras())
        best = self.state.best_model_checkpoint
        if best and STAGING_DIR in best:
            # Trainer named the best checkpoint by the folder it was writing: the staging one, renamed below.
            self.state.best_model_checkpoint = best.replace(os.path.join(STAGING_DIR, ""), "")
            state_file = os.path.join(staged, "trainer_state.json")
            if self.args.should_save and os.path.isfile(state_file):
                self.state.save_to_json(state_file)
        self.accelerator.wait_for_everyone()
        final = os.path.join(final_run_dir, folder)
        if self.args.should_save:
            publish_checkpoint(staged, final)
            shutil.rmtree(staging_run_dir, ignore_errors=True)
            rotate_checkpoints(
                output_dir=final_run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state = load_grpo_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
        if state is not None:
            # Resume TRL's generation schedule where the checkpoint left it, with the completions it had buffered.
            self._step = state["step"]
            self._buffered_inputs = state["buffered_inputs"]
            self._restore_resume_extras(state.get("extras", {}))
