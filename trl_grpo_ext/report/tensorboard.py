"""A run's log history from its TensorBoard event files, for a folder without a trainer state (stock TRL with
`save_strategy="no"` and `report_to="tensorboard"` leaves only `runs/<date>_<host>/events.out.tfevents.*`).

transformers' `TensorBoardCallback` writes each logged value as a scalar tagged `train/<key>` (`eval/<key>` for an
evaluation's `eval_<key>`); the entries are rebuilt one per step, with TRL's `log_history` keys. Reading needs the
optional `tensorboard` package (the `recipes` extra).
"""

from __future__ import annotations

import os

__all__ = ["EVENT_FILE_PREFIX", "event_files", "history_from_event_files"]

EVENT_FILE_PREFIX = "events.out.tfevents."
INSTALL = "pip install tensorboard, or the recipes extra: pip install 'trl-grpo-ext[recipes]'"


def event_files(run_dir: str) -> list[str]:
    """The TensorBoard event files under `run_dir` (any depth), sorted."""
    found = []
    for folder, _, names in os.walk(run_dir):
        found += [os.path.join(folder, name) for name in names if name.startswith(EVENT_FILE_PREFIX)]
    return sorted(found)


def _history_key(tag: str) -> str:
    """`train/loss` -> `loss`, `eval/reward` -> `eval_reward`; other tags as they are."""
    if tag.startswith("train/"):
        return tag.removeprefix("train/")
    if tag.startswith("eval/"):
        return "eval_" + tag.removeprefix("eval/")
    return tag


def history_from_event_files(paths: list[str]) -> list[dict]:
    """The log history written in the event files `paths`: one entry per step (its `step` included), in step order;
    where two files hold a value for the same tag and step, the one written last is kept.

    Raises:
        ImportError: `tensorboard` is not installed (the message says how to install it).
    """
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        raise ImportError(f"reading TensorBoard event files needs tensorboard: {INSTALL}") from None
    latest: dict[tuple[str, int], tuple[float, float]] = {}  # (key, step) -> (wall time, value)
    for path in paths:
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                number = _scalar(value)
                if number is None:
                    continue
                key = (_history_key(value.tag), int(event.step))
                if key not in latest or event.wall_time >= latest[key][0]:
                    latest[key] = (event.wall_time, number)
    entries: dict[int, dict] = {}
    for (key, step), (_, number) in latest.items():
        entries.setdefault(step, {})[key] = number
    return [{**entries[step], "step": step} for step in sorted(entries)]


def _scalar(value) -> float | None:
    """The number of a summary value: a `simple_value` (TensorBoard's own writer), or a 0-dim float tensor (the
    loader upgrades simple values to tensors)."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor" and value.metadata.plugin_data.plugin_name in ("scalars", ""):
        tensor = value.tensor
        if tensor.float_val:
            return float(tensor.float_val[0])
        if tensor.double_val:
            return float(tensor.double_val[0])
        if tensor.tensor_content:
            import numpy as np
            from tensorboard.util import tensor_util

            array = tensor_util.make_ndarray(tensor)
            return float(array) if np.ndim(array) == 0 else None
    return None
