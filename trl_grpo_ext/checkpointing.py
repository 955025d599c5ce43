"""Crash-safe checkpoints and exact resume for GRPO.

Two things make a GRPO run resumable to the bit:

- A checkpoint appears under its final name (`checkpoint-<step>`) only once it is complete. It is written into a
  staging folder (`_checkpoint-in-progress/`, ignored by `push_to_hub` and by `get_last_checkpoint`) and renamed
  when every file is in place, so a process killed while writing leaves nothing that a resume would pick.
- TRL keeps, between optimizer steps, the completions it generated for the coming steps (`num_iterations > 1`, or
  more generation batches than accumulation steps) and a micro-step counter that schedules generation. Neither is
  in Trainer's checkpoint; resuming without them regenerates at a different step and the run diverges. They are
  saved per process in `grpo_state_rank<k>.pt` and restored on resume.

The state of this package's other concerns that a resumed run needs (the non-finite guard's counters, dynamic
sampling's prompt stream, ...) is registered once, by name, in `Checkpoints.resumable`: objects with `state_dict()` and
`load_state_dict()` that every save and load walks. `StepStart` remembers TRL's schedule, the random number generators
and the registered objects marked `rewind` at the start of an optimizer step, so that a step stopped half-way (a
non-finite update) can still be checkpointed as the state before it.

`Checkpoints` does this for `GRPOTrainerExt`, whose save and load hooks (Trainer's own) call it.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

__all__ = [
    "STAGING_DIR",
    "Checkpoints",
    "Resumable",
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
    resume state of this package's other concerns (`Checkpoints.resumable`, by name)."""
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
        extras (`dict`): the state of each registered object marked `rewind` (`Checkpoints.register`).
    """

    step: int
    buffered_inputs: list | None
    rng: dict[str, Any] = field(default_factory=capture_rng)
    extras: dict[str, dict] = field(default_factory=dict)

    def restore_rng(self) -> None:
        """Put the generators back to where they were when this was captured."""
        random.setstate(self.rng["python"])
        np.random.set_state(self.rng["numpy"])
        torch.random.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])


class Resumable(Protocol):
    """What `Checkpoints.resumable` holds: an object whose state a resumed run continues from."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _StepStartCallback(TrainerCallback):
    """Keeps, at the start of every optimizer step, what a checkpoint of the state before that step needs."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints
        self.epoch_rng = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Before the epoch's data-loader iterator draws from the generators: a run resumed at the start of an epoch
        # restores them before creating that iterator, so this is the state a checkpoint of the epoch's first step
        # must hold. Later steps are resumed after their batches were drawn, as captured at their beginning.
        self.epoch_rng = capture_rng()

    def on_step_begin(self, args, state, control, **kwargs):
        rng, self.epoch_rng = self.epoch_rng, None
        self.checkpoints.capture_step_start(rng)


class Checkpoints:
    """Crash-safe checkpoints that are uploaded once complete, exact resume, and the checkpoint of the state before a
    step, for a `GRPOTrainer` (see the module docstring).

    Trainer's and TRL's save code write to `<trainer._get_output_dir()>/checkpoint-<step>`: while `staged_save` runs,
    `output_dir` names the staging folder, so that every file lands there first.

    Args:
        trainer (`GRPOTrainer`): the trainer whose hooks call this (its state, accelerator and TRL's schedule are
            read and written).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        #: name -> object saved with every checkpoint (`Resumable`); see `register`.
        self.resumable: dict[str, Resumable] = {}
        self._rewind: set[str] = set()
        self.step_start: StepStart | None = None
        self.staging = False

    def register(self, name: str, state: Resumable, *, rewind: bool = False) -> None:
        """Save `state` with every checkpoint under `name` and restore it on resume.

        Args:
            rewind (`bool`): the object changes during an optimizer step; the checkpoint of the state before a step
                (`save_state_before_step`) holds its state at the step's start.
        """
        if name in self.resumable:
            raise ValueError(f"A resumable state named {name!r} is registered already.")
        self.resumable[name] = state
        if rewind:
            self._rewind.add(name)

    def track_step_start(self) -> None:
        """Capture the state at the start of every optimizer step (needed by `save_state_before_step`)."""
        self.trainer.add_callback(_StepStartCallback(self))

    def capture_step_start(self, rng: dict | None = None) -> None:
        trainer = self.trainer
        rewound = {name: self.resumable[name].state_dict() for name in self._rewind}
        self.step_start = StepStart(trainer._step, trainer._buffered_inputs, rng=rng or capture_rng(), extras=rewound)

    def output_dir(self, run_dir: str) -> str:
        """Trainer's run folder; while a checkpoint is being written, its staging folder inside it."""
        return os.path.join(run_dir, STAGING_DIR) if self.staging else run_dir

    @contextmanager
    def staged_save(self, trial) -> Iterator[None]:
        """Around Trainer's `_save_checkpoint`: the checkpoint is written into a staging folder, given its final name
        once complete (with this package's state), then uploaded."""
        trainer = self.trainer
        final_run_dir = trainer._get_output_dir(trial=trial)
        staging_run_dir = os.path.join(final_run_dir, STAGING_DIR)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        if trainer.args.should_save:
            shutil.rmtree(staging_run_dir, ignore_errors=True)  # left over by a process killed while saving
        trainer.accelerator.wait_for_everyone()
        self.staging = True
        try:
            yield
        finally:
            self.staging = False
        staged = os.path.join(staging_run_dir, folder)
        os.makedirs(staged, exist_ok=True)
        extras = {name: state.state_dict() for name, state in self.resumable.items()}
        save_grpo_state(staged, trainer.accelerator.process_index, trainer._step, trainer._buffered_inputs, extras)
        best = trainer.state.best_model_checkpoint
        if best and STAGING_DIR in best:
            # Trainer named the best checkpoint by the folder it was writing: the staging one, renamed below.
            trainer.state.best_model_checkpoint = best.replace(os.path.join(STAGING_DIR, ""), "")
            state_file = os.path.join(staged, "trainer_state.json")
            if trainer.args.should_save and os.path.isfile(state_file):
                trainer.state.save_to_json(state_file)
        trainer.accelerator.wait_for_everyone()
        final = os.path.join(final_run_dir, folder)
        if trainer.args.should_save:
            publish_checkpoint(staged, final)
            shutil.rmtree(staging_run_dir, ignore_errors=True)
            rotate_checkpoints(
                output_dir=final_run_dir,
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
            )
        trainer.accelerator.wait_for_everyone()
        # A node that no saving process shares a file system with (several nodes, no shared storage, no
        # `save_on_each_node`): nobody published its staging folder. Its processes' states go into its own
        # checkpoint folder, where a copy of the main node's checkpoint joins them for a resume.
        own = grpo_state_path(staged, trainer.accelerator.process_index)
        if os.path.isfile(own):
            os.makedirs(final, exist_ok=True)
            os.replace(own, grpo_state_path(final, trainer.accelerator.process_index))
        trainer.accelerator.wait_for_everyone()
        if not trainer.args.should_save and trainer.accelerator.is_local_main_process:
            shutil.rmtree(staging_run_dir, ignore_errors=True)
        if trainer.args.push_to_hub:
            trainer._push_from_checkpoint(final)

    def may_push(self) -> bool:
        """Whether Trainer's upload may run now: not from inside a save (of the staging folder, renamed right after);
        `staged_save` asks again with the published folder once it is complete."""
        return not self.staging

    def load(self, checkpoint: str | None) -> None:
        """Resume TRL's generation schedule where `checkpoint` left it, with the completions it had buffered, and
        every registered state."""
        if checkpoint is None:
            return
        trainer = self.trainer
        state = load_grpo_state(checkpoint, trainer.accelerator.process_index, trainer.accelerator.device)
        if state is None:
            return
        trainer._step = state["step"]
        trainer._buffered_inputs = state["buffered_inputs"]
        extras = state.get("extras", {})
        for name, resumable in self.resumable.items():
            if name in extras:
                resumable.load_state_dict(extras[name])

    def save_state_before_step(self) -> str:
        """Write (unless it exists) the checkpoint of the state at the start of the current optimizer step, nothing
        of the step having reached the weights; returns its folder."""
        trainer = self.trainer
        checkpoint = os.path.join(
            trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        )
        if os.path.isdir(checkpoint):  # it holds this very state already, and is never rewritten
            return checkpoint
        start = self.step_start
        if start is not None:
            trainer._step = start.step
            trainer._buffered_inputs = start.buffered_inputs
            start.restore_rng()
            for name, state in start.extras.items():
                self.resumable[name].load_state_dict(state)
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        return checkpoint
