"""What a run cannot start with: processes that a launcher started but that accelerate runs apart (`check_launch`),
a training set without prompts (`check_train_dataset`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["LAUNCHER_WORLD_SIZE_VARIABLES", "check_launch", "check_train_dataset", "launched_processes"]

# What launchers set to the number of processes they started: torchrun (`accelerate launch`), then the MPI launchers
# that accelerate reads too (MPICH/Intel MPI, Open MPI, MVAPICH).
LAUNCHER_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_processes(environ: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """The first launcher variable of `environ` that says more than one process was started, and its count; None
    when none does (a plain `python` run, or a launch of one process)."""
    for name in LAUNCHER_WORLD_SIZE_VARIABLES:
        try:
            count = int(environ.get(name, ""))
        except ValueError:
            continue
        if count > 1:
            return name, count
    return None


def check_launch(accelerator: Any, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a launch of several processes that `accelerator` runs as independent single-process runs.

    Args:
        accelerator: the trainer's `accelerate.Accelerator` (anything with `num_processes`; `distributed_type` is
            named in the message when it has one).
        environ: the process environment.

    Raises:
        ValueError: when a launcher variable (`WORLD_SIZE`, ...) of `environ` is above 1 but
            `accelerator.num_processes` is 1; the message says why and what to set.
    """
    launched = launched_processes(environ)
    if launched is None or accelerator.num_processes != 1:
        return
    name, count = launched
    distributed_type = getattr(accelerator, "distributed_type", None)
    kind = getattr(distributed_type, "value", distributed_type)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = f" (CUDA_VISIBLE_DEVICES={visible!r} here)" if visible is not None else ""
    raise ValueError(
        f"The launcher started {count} processes ({name}={count}), but accelerate runs this one on its own "
        f"(num_processes=1, distributed_type={kind}): each process would train a model of its own and write "
        f"the same output_dir. On a CPU-only machine or with no GPU visible{devices}, set use_cpu=True "
        "(`use_cpu: true` in the recipe config, or `--use_cpu true`) so that the processes train together over "
        "gloo. With GPUs, check that CUDA_VISIBLE_DEVICES shows them to every process and that the accelerate "
        "config's distributed_type and num_processes match the machine."
    )


def check_train_dataset(train_dataset, environment_factory) -> None:
    """Refuse, before any model is loaded, a training set that cannot produce a batch.

    Args:
        train_dataset: the trainer's `train_dataset` argument; only a `datasets.Dataset` is checked.
        environment_factory: the trainer's `environment_factory` argument (with one, the prompts need no column).

    Raises:
        ValueError: for an empty `datasets.Dataset`, or one without a `prompt` column and no `environment_factory`.
    """
    from datasets import Dataset

    if not isinstance(train_dataset, Dataset):
        return  # an IterableDataset cannot be checked without reading it; None is TRL's to judge
    if len(train_dataset) == 0:
        raise ValueError("`train_dataset` is empty: GRPO needs at least one prompt.")
    if environment_factory is None and "prompt" not in train_dataset.column_names:
        raise ValueError(
            f"`train_dataset` has no 'prompt' column (its columns are {train_dataset.column_names}); rename the "
            "column holding the prompts to 'prompt'."
        )
