"""Datasets for the recipes: load a local folder/file or a Hub dataset, and turn rows into GRPO prompts."""

from __future__ import annotations

import os
from collections.abc import Callable

from datasets import DatasetDict, load_dataset

from .arguments import looks_like_a_local_path
from .rewards import gsm8k_solution

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _gsm8k_rows(row: dict) -> dict:
    return {"prompt": row["question"], "solution": gsm8k_solution(row["answer"])}


#: dataset_format -> (columns it needs, row mapping or None when rows are used as they are)
DATASET_FORMATS: dict[str, tuple[tuple[str, ...], Callable[[dict], dict] | None]] = {
    "prompt": (("prompt",), None),
    "gsm8k": (("question", "answer"), _gsm8k_rows),
}


def _load(name: str, config: str | None) -> DatasetDict:
    if os.path.isdir(name):
        loaded = load_dataset(name, name=config)
    elif os.path.isfile(name):
        extension = os.path.splitext(name)[1].lower()
        if extension not in _FILE_BUILDERS:
            raise ValueError(f"Cannot read dataset file {name!r}: expected one of {sorted(_FILE_BUILDERS)}.")
        loaded = load_dataset(_FILE_BUILDERS[extension], data_files={"train": name})
    elif looks_like_a_local_path(name):  # not a Hub id ("name" or "owner/name"): a local path that does not exist
        raise ValueError(
            f"No dataset folder or file at {name!r} (resolved from the current folder: {os.path.abspath(name)}). "
            "Relative paths in a config are resolved from the folder the command runs in."
        )
    else:
        try:
            loaded = load_dataset(name, name=config)
        except FileNotFoundError as error:  # a Hub id that is neither local nor reachable
            raise ValueError(f"No local dataset and no Hub dataset {name!r}: {error}") from error
    return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})


def _missing_columns_fix(columns: list[str], dataset_format: str) -> str:
    """What to do about a split without the columns `dataset_format` needs."""
    fitting = [
        f"dataset_format: {other} (it reads {', '.join(needed)})"
        for other, (needed, _) in DATASET_FORMATS.items()
        if other != dataset_format and all(column in columns for column in needed)
    ]
    fixes = [f"set {fitting[0]}"] if fitting else []
    if dataset_format == "prompt":
        source = next((column for column in columns if column.lower() in _PROMPT_LIKE), "<column>")
        fixes.append(
            f"rename the column that holds the prompts to `prompt` (e.g. `dataset.rename_column({source!r}, "
            "'prompt')` before saving it)"
        )
    fixes.append(f"or add a format of your own to DATASET_FORMATS (known: {sorted(DATASET_FORMATS)})")
    return "Fix: " + "; ".join(fixes) + "."


#: Column names that usually hold the prompt, for the rename that the error of a dataset without `prompt` suggests.
_PROMPT_LIKE = ("question", "query", "problem", "instruction", "input", "text", "content", "messages")


def load_recipe_dataset(
    name: str | None,
    config: str | None = None,
    *,
    dataset_format: str = "prompt",
    system_prompt: str | None = None,
    required_splits: list[str] | tuple[str, ...] = ("train",),
) -> DatasetDict:
    """Load `name` (a local folder of json/jsonl/parquet/csv files named by split, one file, or a Hub id) as GRPO
    rows: a `prompt` (a conversation with `system_prompt`) and the reward functions' columns. Raises `ValueError`
    for what cannot be loaded or lacks the format's columns (listing the columns found)."""
    if not name:
        raise ValueError("Set `dataset_name`: a local folder or file, or a Hub dataset id.")
    if dataset_format not in DATASET_FORMATS:
        raise ValueError(f"Unknown dataset_format {dataset_format!r}; expected one of {sorted(DATASET_FORMATS)}.")
    needed, mapping = DATASET_FORMATS[dataset_format]
    try:
        dataset = _load(name, config)
    except ValueError as error:  # e.g. a split file without rows
        raise ValueError(f"Cannot load dataset {name!r}: {error}") from error
    for split in required_splits:
        if split not in dataset:
            raise ValueError(f"Dataset {name!r} has no split {split!r}; it has {sorted(dataset)}.")
    formatted = {}
    for split, rows in dataset.items():
        if len(rows) == 0:
            raise ValueError(f"Split {split!r} of dataset {name!r} is empty.")
        missing = [column for column in needed if column not in rows.column_names]
        if missing:
            raise ValueError(
                f"Split {split!r} of dataset {name!r} has no column {missing} (dataset_format={dataset_format!r}); "
                f"its columns are {rows.column_names}. {_missing_columns_fix(rows.column_names, dataset_format)}"
            )
        if mapping is not None:
            rows = rows.map(mapping)
        if system_prompt is not None:
            rows = rows.map(
                lambda row: {
                    "prompt": [
                        {"role": "system", "content": system_prompt},
                        {"role": "user", "content": row["prompt"]},
                    ]
                }
            )
        formatted[split] = rows
    return DatasetDict(formatted)
