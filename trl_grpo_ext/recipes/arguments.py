"""The recipe's command line: the parser over (script arguments, `GRPOConfigExt`, `trl.ModelConfig`) and the checks
that must run before anything loads (the checkpoint to resume from, the loggers of `report_to`)."""

from __future__ import annotations

import os

__all__ = [
    "CHECKED_LOGGERS",
    "check_loggers_installed",
    "drop_tensorboard_if_missing",
    "make_parser",
    "parse_args",
    "resume_checkpoint",
]

#: The loggers of `report_to` that transformers refuses only once the model is loaded when they are missing.
CHECKED_LOGGERS = ("tensorboard", "trackio", "wandb")
RECIPES_EXTRA = 'pip install "trl-grpo-ext[recipes]"'


def make_parser(script_arguments, prog: str | None = None, description: str | None = None, usage: str | None = None):
    """`TrlParser` over (`script_arguments`, `GRPOConfigExt`, `trl.ModelConfig`): every field is a YAML key and a flag.

    Args:
        script_arguments (`type`): the recipe's own dataclass.
        prog, description, usage: what `--help` shows (argparse's own usage line would list every field).
    """
    from trl import ModelConfig, TrlParser

    from trl_grpo_ext import GRPOConfigExt

    return TrlParser((script_arguments, GRPOConfigExt, ModelConfig), prog=prog, description=description, usage=usage)


def parse_args(script_arguments, argv=None, *, defaults: dict | None = None, **parser_kwargs) -> tuple:
    """Parse `argv` (default: the command line) into (script arguments, `GRPOConfigExt`, `trl.ModelConfig`).

    Args:
        defaults: field values that replace the dataclasses' defaults, as a config file's do; `--config` and flags
            override them.
        parser_kwargs: `prog`, `description`, `usage` (see `make_parser`).

    Raises:
        ValueError: for a field of `defaults` that no dataclass has.
    """
    parser = make_parser(script_arguments, **parser_kwargs)
    if defaults:
        unknown = parser.set_defaults_with_config(**defaults)
        if unknown:
            raise ValueError(f"Unknown fields in the defaults: {unknown}.")
    return parser.parse_args_and_config(argv)


def resume_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder that `resume_from_checkpoint` names, or `None` to start fresh.

    `true` (or `last`) is the last `checkpoint-<step>` folder of `output_dir`, as `Trainer.train(True)` takes it;
    `false`, an empty value or `None` start fresh; anything else is a checkpoint folder's path. A flag's value
    arrives as a string, a YAML key's as a bool.

    Raises:
        ValueError: `true` with no checkpoint in `output_dir`, or a path that is not a checkpoint folder.
    """
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    word = value.strip().lower() if isinstance(value, str) else value
    if word in (None, False, "", "false", "no", "0", "f", "n"):
        return None
    if word in (True, "true", "yes", "1", "t", "y", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=true: no checkpoint-<step> folder in output_dir {output_dir!r} to resume "
                "from. Pass a checkpoint folder's path, or `--resume_from_checkpoint false` to start fresh."
            )
        return last
    if not os.path.isfile(os.path.join(value, TRAINER_STATE_NAME)):
        raise ValueError(
            f"resume_from_checkpoint: {value!r} is not a checkpoint folder (it has no {TRAINER_STATE_NAME}). Pass a "
            "checkpoint-<step> folder, or `--resume_from_checkpoint true` for the last one in output_dir."
        )
    return value


def _logger_installed(name: str) -> bool:
    from transformers import integrations

    return getattr(integrations, f"is_{name}_available")()


def check_loggers_installed(report_to: list[str] | str | None) -> None:
    """Refuse, before anything loads, a `report_to` that names TensorBoard, trackio or W&B when it is not installed
    (transformers would fail only once the model is loaded, with a traceback).

    Raises:
        ValueError: one line naming the logger and the command that installs it.
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in CHECKED_LOGGERS and not _logger_installed(name):
            install = RECIPES_EXTRA if name == "tensorboard" else f"pip install {name}"
            raise ValueError(
                f"report_to names {name}, which is not installed: {install}, or leave it out of report_to."
            )


def drop_tensorboard_if_missing(training_args) -> bool:
    """The demo logs to TensorBoard when it is installed (the `recipes` extra); after a plain `pip install
    trl-grpo-ext` it runs without it, saying so once. Returns whether TensorBoard was dropped from `report_to`."""
    if "tensorboard" not in (training_args.report_to or []) or _logger_installed("tensorboard"):
        return False
    # After `TrainingArguments.__post_init__`, `report_to` is a list and "none" is `[]`.
    training_args.report_to = [name for name in training_args.report_to if name != "tensorboard"]
    print(f"TensorBoard is not installed: this run writes no TensorBoard logs ({RECIPES_EXTRA} for them).")
    return True
