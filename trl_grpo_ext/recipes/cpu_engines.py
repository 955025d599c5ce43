"""FSDP2 and DeepSpeed ZeRO on CPU processes (gloo), for checking a sharded run on a machine without GPUs.

`accelerate launch` with an FSDP or DeepSpeed config on a machine without GPUs does not fail: accelerate 1.x enables
those engines only for GPU-like process groups, so every process silently trains its own unsharded copy of the model
(`accelerator.distributed_type` is `NO`, or `MULTI_CPU` with `use_cpu`). Both engines do run on CPU tensors over gloo
(FSDP2's `fully_shard`, DeepSpeed's CPU accelerator), so `enable_sharded_engines_on_cpu` makes accelerate pick them:
it reports the processes to accelerate as a multi-GPU group that talks through gloo and places tensors on the CPU.

It is a check path, not a way to train fast: GPUs are where these engines pay off. Where CUDA is available, or the
launcher asked for no sharded engine, it does nothing.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["enable_sharded_engines_on_cpu", "requested_engine"]

_PATCHED = "_trl_grpo_ext_cpu_engines"


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def requested_engine() -> str | None:
    """The sharded engine `accelerate launch` asked for through its environment: `"fsdp"`, `"deepspeed"` or `None`."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return None


def enable_sharded_engines_on_cpu() -> str | None:
    """Let accelerate start the FSDP or DeepSpeed engine that `accelerate launch` asked for on CPU-only processes.

    Call it at the start of the launched script, before `TrainingArguments` (or `GRPOConfigExt`) is created. With
    DeepSpeed it selects DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`) and, since its shared-memory all-reduce
    is a C++ extension compiled at first use (minutes), leaves the collectives to gloo.

    Returns:
        `str` or `None`: the engine enabled (`"fsdp"` or `"deepspeed"`), or `None` when there is nothing to do (not
        launched by a distributed launcher, no sharded engine asked for, or CUDA available).

    Raises:
        RuntimeError: when accelerate's process state already exists: it is created once per process.
        ValueError: for DeepSpeed with `use_cpu=True` (accelerate never starts DeepSpeed for a `cpu` state; the CPU
            is selected through `DS_ACCELERATOR=cpu` instead, so set `use_cpu=False`).
    """
    import torch

    engine = requested_engine()
    if engine is None or "LOCAL_RANK" not in os.environ or torch.cuda.is_available():
        return None
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState, _PATCHED, False):
        return engine
    if PartialState._shared_state:
        raise RuntimeError(
            "enable_sharded_engines_on_cpu() must run before accelerate's state is created (before the training "
            "arguments or an Accelerator): call it at the start of the script."
        )
    # accelerate's device placement reads this before anything else: every tensor stays on the CPU.
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    if engine == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # `deepspeed.comm.torch` as an attribute is the torch package (re-exported): take the module itself.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    def prepare_backend(state, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        if cpu and engine == "deepspeed":
            raise ValueError(
                "DeepSpeed on CPU processes needs use_cpu=False (DeepSpeed's CPU accelerator is selected through "
                "DS_ACCELERATOR=cpu); accelerate never starts DeepSpeed for a `cpu` state."
            )
        if cpu and not torch.distributed.is_initialized():
            # A `cpu` state skips the process-group set-up of GPU groups; the launcher's environment has everything.
            torch.distributed.init_process_group("gloo")
        # accelerate enables FSDP and DeepSpeed only for GPU-like groups; gloo serves their collectives on the CPU.
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend
    setattr(PartialState, _PATCHED, True)
    return engine
