"""A run's log history from the TensorBoard event files transformers' `TensorBoardCallback` writes (`train/<key>`,
`eval/<key>` scalars), for a folder without a trainer state. Needs the optional `tensorboard` package."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

EVENT_FILE_PREFIX = "events.out.tfevents."
#: The tag of the training arguments transformers' `TensorBoardCallback` records at the start of each training.
ARGS_TAG = "args/text_summary"
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


@dataclass
class EventFilesRun:
    """The run that wrote a folder's event files last (`read_event_files`).

    Attributes:
        history (`list[dict]`): its log history, one entry per step, in step order.
        files (`list[str]`): the event files it was read from, in the order written.
        others (`list[tuple[str, int]]`): `(file, last step)` of each file of another run.
        args (`dict | None`): its training arguments as the trainer recorded them, if any.
    """

    history: list[dict]
    files: list[str] = field(default_factory=list)
    others: list[tuple[str, int]] = field(default_factory=list)
    args: dict | None = None


def read_event_files(paths: list[str]) -> EventFilesRun:
    """The run that wrote the event files `paths` last: the file with the latest first event and, before its first
    step, each earlier file with steps before that one and none after its last (the stretches it was resumed from);
    the other files are another run's. Raises `ImportError` without `tensorboard`."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        raise ImportError(f"reading TensorBoard event files needs tensorboard: {INSTALL}") from None
    stretches = []  # (first wall time, path, {(key, step): (wall time, value)})
    args: dict[str, str] = {}  # path -> the `args` text it records
    for path in paths:
        values: dict[tuple[str, int], tuple[float, float]] = {}
        first = None
        for event in EventFileLoader(path).Load():
            first = event.wall_time if first is None else min(first, event.wall_time)
            for value in event.summary.value:
                if value.tag == ARGS_TAG and (text := _text(value)) is not None:
                    args[path] = text
                number = _scalar(value)
                key = (_history_key(value.tag), int(event.step))
                if number is not None and (key not in values or event.wall_time >= values[key][0]):
                    values[key] = (event.wall_time, number)
        if values:
            stretches.append((first, path, values))
    if not stretches:
        return EventFilesRun([])
    stretches.sort(key=lambda stretch: (stretch[0], stretch[1]))
    *earlier, (_, last_path, latest) = stretches
    start, end = min(step for _, step in latest), max(step for _, step in latest)
    kept, files, others = dict(latest), [last_path], []
    for _, path, values in reversed(earlier):
        steps = [step for _, step in values]
        if min(steps) < start and max(steps) <= end:
            kept.update({key: value for key, value in values.items() if key[1] < start})
            start = min(steps)
            files.insert(0, path)
        else:
            others.append((path, max(steps)))
    entries: dict[int, dict] = {}
    for (key, step), (_, number) in kept.items():
        entries.setdefault(step, {})[key] = number
    history = [{**entries[step], "step": step} for step in sorted(entries)]
    recorded = next((args[path] for path in reversed(files) if path in args), None)
    return EventFilesRun(history, files, others[::-1], _json_object(recorded))


def _json_object(text: str | None) -> dict | None:
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _text(value) -> str | None:
    """The string of a text summary (`SummaryWriter.add_text`)."""
    if value.WhichOneof("value") != "tensor" or not value.tensor.string_val:
        return None
    return value.tensor.string_val[0].decode("utf-8", errors="replace")


def _scalar(value) -> float | None:
    """The number of a summary value: a `simple_value`, or a 0-dim float tensor."""
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
