"""The recipe's command line: the parser over (script arguments, `GRPOConfigExt`, `trl.ModelConfig`), whose every
mistake is a one-line `ConfigError` (exit status 2), and the checks that run before anything loads."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import socket
import sys
import textwrap
import urllib.parse

from trl import TrlParser

from ...config import GRPOConfigExt, removed_field_problem

#: The loggers of `report_to` that transformers refuses only once the model is loaded when they are missing.
CHECKED_LOGGERS = ("tensorboard", "trackio", "wandb")

#: The fields of TRL and transformers that `--help` lists after the recipe's and this package's own.
USUAL_TRAINING_FIELDS = (
    "output_dir",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "num_generations",
    "max_completion_length",
    "temperature",
    "num_iterations",
    "epsilon_high",
    "scale_rewards",
    "reward_weights",
    "use_vllm",
    "vllm_mode",
    "logging_steps",
    "log_completions",
    "report_to",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "resume_from_checkpoint",
    "seed",
    "push_to_hub",
    "hub_model_id",
)
USUAL_MODEL_FIELDS = (
    "model_name_or_path",
    "dtype",
    "attn_implementation",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
)


class ConfigError(ValueError):
    """A mistake in the recipe's command line or config file, or a setting that cannot run; its message is one line."""


def looks_like_a_local_path(name: str) -> bool:
    """Whether `name` can only be a local path: a Hub id is `name` or `owner/name`."""
    return os.path.isabs(name) or name.startswith(".") or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_model_is_local_or_hub(name: str) -> None:
    """A `ConfigError` at once (transformers retries the Hub for tens of seconds first) for a `model_name_or_path`
    that cannot load: a local path that does not exist, or a name neither local nor in the Hub cache while offline
    (`HF_HUB_OFFLINE`, or the Hub out of reach)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if os.path.isdir(name):
        return
    where = f"resolved against {os.getcwd()}: {os.path.abspath(name)}"
    if looks_like_a_local_path(name):
        raise ConfigError(
            f"No model folder at model_name_or_path={name!r} ({where}). Relative paths in a config are resolved "
            "from the folder the command runs in: run it from the folder the config expects, or give an absolute "
            "path."
        )
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else None
    if why is None and not _hub_reachable(constants.ENDPOINT):
        why = f"the Hub ({constants.ENDPOINT}) cannot be reached"
    if why:
        raise ConfigError(
            f"No local model folder at model_name_or_path={name!r} ({where}), no copy in the Hub cache, and {why}: "
            "give the path of a local model folder, or download the model first (`hf download <model id>` on a "
            "machine with access)."
        )


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to `endpoint` opens within `timeout` seconds (always true behind a proxy)."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    url = urllib.parse.urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


def nearest(name: str, known, flag: bool = False) -> str:
    """`" (did you mean 'x'?)"` (`--x` for a `flag`) for the name of `known` closest to `name`, or `""`."""
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if not matches:
        return ""
    return f" (did you mean --{matches[0]}?)" if flag else f" (did you mean {matches[0]!r}?)"


def _number_or_text(value: str | None):
    """A command line's value as the number (or `None`) it spells, else as it is."""
    if value in ("None", "null"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each field under its name only (`--learning_rate`, not also `--learning-rate`, which parses all the same)."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.dest == "help":
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return action.option_strings[0]
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{action.option_strings[0]} {metavar}"


#: The end of a help text's first sentence: a period after a word, then a capital (not "e.g. 'main'").
_SENTENCE_END = re.compile(r"(?<=[\w)`'\]])\.\s+(?=[A-Z])")


class ShortHelpFormatter(HelpFormatter):
    """`--help`'s: a field on one line when it fits, else the flag on its line and, below it, its help text's first
    sentence, whole, wrapped to the terminal and indented, then its default. `--help-all` shows every help text
    whole."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.dest == "help":
            return super()._format_action_invocation(action)
        flag = action.option_strings[0]
        choices = f" {{{','.join(map(str, action.choices))}}}" if action.choices else ""
        return flag + choices if self._current_indent + len(flag + choices) <= self._width else flag

    def _format_action(self, action) -> str:
        indent = " " * self._current_indent
        flag, summary = self._format_action_invocation(action), self._summary(action)
        if len(f"{indent}{flag}  {summary}") <= self._width:
            return f"{indent}{flag}  {summary}\n"
        # At least 40 columns of text, however narrow the terminal, so that a sentence is not one word a line.
        lines = textwrap.wrap(summary, max(self._width - len(indent) - 4, 40), break_on_hyphens=False)
        return f"{indent}{flag}\n" + "".join(f"{indent}    {line}\n" for line in lines)

    def _summary(self, action) -> str:
        """The help text's first sentence, whole, and the default."""
        text, default = self._expand_help(action), f" (default: {action.default})"
        text, default = (text.removesuffix(default), default) if text.endswith(default) else (text, "")
        sentences = _SENTENCE_END.split(text, maxsplit=1)
        return sentences[0] + ("." if len(sentences) > 1 else "") + default


class HelpAllAction(argparse.Action):
    """`--help-all`: print the help of every field, in full, and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(parser.format_help(full=True))
        parser.exit()


class RecipeParser(TrlParser):
    """`trl.TrlParser` (every dataclass field a flag, `--config <yaml>` for their values) without abbreviations,
    whose every mistake is a one-line `ConfigError` (naming the nearest key or flag), whose `--help` lists the
    `short_help` fields by `help_groups` with their first sentence, and `--help-all` every flag in full.

    Args:
        dataclass_types: as `TrlParser` takes them.
        help_groups: `(title, field names)` per `--help` section; fields in none stay in the first, untitled one.
        short_help: the fields that `--help` lists (default: every field).
        kwargs: `prog`, `description`, `usage` (argparse's).
    """

    def __init__(
        self,
        dataclass_types,
        help_groups: list[tuple[str, set[str]]] = (),
        short_help: set[str] | None = None,
        **kwargs,
    ):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)
        self.short_help = self.known_keys() if short_help is None else set(short_help)
        self.add_argument(
            "--help-all", action=HelpAllAction, dest=argparse.SUPPRESS, help="show every flag, in full, and exit"
        )
        for title, names in help_groups:
            group = self.add_argument_group(title)
            for action in [action for action in self._optionals._group_actions if action.dest in names]:
                self._optionals._group_actions.remove(action)
                group._group_actions.append(action)

    def format_help(self, full: bool = False) -> str:
        """The text of `--help`, or of `--help-all` when `full`: every flag, each help text whole."""
        if full:
            return super().format_help()
        fields = self.known_keys()

        def shown(action) -> bool:  # `-h` and `--help-all`, or a field of `short_help` by its own name
            return action.dest not in fields or (
                action.dest in self.short_help and action.option_strings[0] == f"--{action.dest}"
            )

        formatter = ShortHelpFormatter(self.prog)
        formatter.add_usage(self.usage, [action for action in self._actions if shown(action)], [])
        formatter.add_text(self.description)
        for group in self._action_groups:
            actions = [action for action in group._group_actions if shown(action)]
            if actions:
                formatter.start_section(group.title)
                formatter.add_arguments(actions)
                formatter.end_section()
        formatter.add_text(
            f"These are {len(fields & self.short_help)} of the {len(fields)} fields, each with the first sentence of "
            "its help text."
        )
        formatter.add_text("Every field, in full: %(prog)s --help-all")
        return formatter.format_help()

    def error(self, message: str):
        raise ConfigError(_one_line(message))

    def known_keys(self) -> set[str]:
        """The field names: each a config key and a `--flag`."""
        return {action.dest for action in self._actions if action.dest != argparse.SUPPRESS and action.dest != "help"}

    def parse_args_and_config(self, args=None, **_) -> tuple:
        """One instance per dataclass from `args` (default: the command line): `--config <yaml>` sets defaults (its
        `env:` mapping environment variables, as `TrlParser` does), flags override them. Raises `ConfigError`."""
        args = list(sys.argv[1:] if args is None else args)
        for index, arg in enumerate(args):
            if arg == "--config" or arg.startswith("--config="):
                if arg == "--config" and index + 1 == len(args):
                    raise ConfigError("--config needs the path of a YAML file.")
                path = arg.split("=", 1)[1] if "=" in arg else args[index + 1]
                del args[index : index + (1 if "=" in arg else 2)]
                self._apply_config(path)
                break
        try:
            *outputs, remaining = self.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        except ConfigError:
            raise
        except ValueError as error:  # a dataclass's own check of its values (GRPOConfigExt, TrainingArguments)
            raise ConfigError(_one_line(error)) from error
        if remaining:
            flag = next((arg for arg in remaining if arg.startswith("-")), None)
            if flag is None:
                raise ConfigError(f"unrecognized argument {remaining[0]!r} (the form is --field value)")
            name = flag.lstrip("-").split("=", 1)[0].replace("-", "_")
            given = flag.split("=", 1)[1] if "=" in flag else next(iter(remaining[remaining.index(flag) + 1 :]), None)
            removed = removed_field_problem(name, _number_or_text(given))
            if removed is not None:
                raise ConfigError(f"unrecognized argument {flag}: {removed}")
            raise ConfigError(f"unrecognized argument {flag}{nearest(name, self.known_keys(), flag=True)}")
        return tuple(outputs)

    def _apply_config(self, path: str) -> None:
        import yaml

        try:
            with open(path) as handle:
                config = yaml.safe_load(handle)
        except OSError as error:
            raise ConfigError(f"--config {path}: {error.strerror or error}") from error
        except yaml.YAMLError as error:
            raise ConfigError(f"--config {path} is not valid YAML: {_one_line(error)}") from error
        if config is None:
            return
        if not isinstance(config, dict):
            raise ConfigError(f"--config {path} must hold a mapping of field: value, not a {type(config).__name__}.")
        env = config.pop("env", None) or {}
        if not isinstance(env, dict):
            raise ConfigError(f"--config {path}: `env` must be a mapping of variable: value.")
        known = self.known_keys()
        unknown = [key for key in config if key not in known]
        removed = [removed_field_problem(str(key), config[key]) for key in unknown]
        if any(removed):
            raise ConfigError(f"--config {path}: " + " ".join(problem for problem in removed if problem))
        if unknown:
            keys = ", ".join(f"{key!r}{nearest(str(key), known)}" for key in unknown)
            raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} in {path}: {keys}")
        for key, value in env.items():
            os.environ[key] = str(value)
        self.set_defaults_with_config(**config)


def help_groups(script_arguments) -> list[tuple[str, set[str]]]:
    """The `--help` sections of the recipe: its own arguments, `GRPOConfigExt`'s own fields (and the TRL fields whose
    default it changes), TRL's and transformers' fields, `trl.ModelConfig`'s."""
    from dataclasses import fields

    from trl import GRPOConfig, ModelConfig

    own = set(vars(GRPOConfigExt).get("__annotations__", {}))
    trl_fields = {field.name for field in fields(GRPOConfig)} - own
    return [
        (f"recipe ({script_arguments.__name__})", {field.name for field in fields(script_arguments)}),
        ("trl_grpo_ext (GRPOConfigExt's fields, and TRL's whose default it changes)", own),
        ("TRL (GRPOConfig) and transformers (TrainingArguments)", trl_fields),
        ("model (trl.ModelConfig)", {field.name for field in fields(ModelConfig)}),
    ]


def make_parser(script_arguments, prog: str | None = None, description: str | None = None, usage: str | None = None):
    """`RecipeParser` over (`script_arguments`, `GRPOConfigExt`, `trl.ModelConfig`), whose `--help` lists the
    recipe's and this package's fields, then `USUAL_TRAINING_FIELDS` and `USUAL_MODEL_FIELDS`."""
    from trl import ModelConfig

    groups = help_groups(script_arguments)
    (_, recipe_fields), (_, own_fields) = groups[:2]
    return RecipeParser(
        (script_arguments, GRPOConfigExt, ModelConfig),
        help_groups=groups,
        short_help=recipe_fields | own_fields | set(USUAL_TRAINING_FIELDS) | set(USUAL_MODEL_FIELDS),
        prog=prog,
        description=description,
        usage=usage,
    )


def parse_args(script_arguments, argv=None, *, defaults: dict | None = None, **parser_kwargs) -> tuple:
    """Parse `argv` (default: the command line) into (script arguments, `GRPOConfigExt`, `trl.ModelConfig`);
    `defaults` replace the dataclasses' defaults, as a config file's do. Raises `ConfigError`, or `ValueError` for
    a field of `defaults` that no dataclass has."""
    parser = make_parser(script_arguments, **parser_kwargs)
    if defaults:
        unknown = parser.set_defaults_with_config(**defaults)
        if unknown:
            raise ValueError(f"Unknown fields in the defaults: {unknown}.")
    return parser.parse_args_and_config(argv)


def resume_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder that `resume_from_checkpoint` names (`true`/`last`: the last one of `output_dir`; a
    path), or `None` to start fresh (`false`, empty). Raises `ConfigError` where there is no such checkpoint."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    if not _resumes(value):
        return None
    if (value.strip().lower() if isinstance(value, str) else value) in (True, "true", "yes", "1", "t", "y", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ConfigError(
                f"resume_from_checkpoint=true: no checkpoint-<step> folder in output_dir {output_dir!r} to resume "
                "from. Pass a checkpoint folder's path, or `--resume_from_checkpoint false` to start fresh."
            )
        return last
    if not os.path.isfile(os.path.join(value, TRAINER_STATE_NAME)):
        raise ConfigError(
            f"resume_from_checkpoint: {value!r} is not a checkpoint folder (it has no {TRAINER_STATE_NAME}). Pass a "
            "checkpoint-<step> folder, or `--resume_from_checkpoint true` for the last one in output_dir."
        )
    return value


def _logger_installed(name: str) -> bool:
    from transformers import integrations

    return getattr(integrations, f"is_{name}_available")()


def check_loggers_installed(report_to: list[str] | str | None) -> None:
    """A `ConfigError` before anything loads for a `report_to` that names a logger of `CHECKED_LOGGERS` that is not
    installed (transformers fails only once the model is loaded)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in CHECKED_LOGGERS and not _logger_installed(name):
            raise ConfigError(
                f"report_to names {name}, which is not installed: pip install {name}, or leave it out of report_to."
            )


def drop_tensorboard_if_missing(training_args) -> bool:
    """Drop TensorBoard from `report_to` where it is not installed, saying so; whether it was dropped."""
    if "tensorboard" not in (training_args.report_to or []) or _logger_installed("tensorboard"):
        return False
    # After `TrainingArguments.__post_init__`, `report_to` is a list and "none" is `[]`.
    training_args.report_to = [name for name in training_args.report_to if name != "tensorboard"]
    print("TensorBoard is not installed: this run writes no TensorBoard logs (pip install tensorboard for them).")
    return True


def _resumes(value: str | bool | None) -> bool:
    """Whether `resume_from_checkpoint` (a flag's string or a YAML key's bool) asks to resume."""
    word = value.strip().lower() if isinstance(value, str) else value
    return word not in (None, False, "", "false", "no", "0", "f", "n")


def fresh_output_dir(training_args) -> str | None:
    """Point `training_args.output_dir` at the first free `<output_dir>-2`, `-3`, ... when it holds an earlier run
    and this one does not resume, saying so; the new folder, or `None`."""
    folder = training_args.output_dir
    if _resumes(training_args.resume_from_checkpoint) or not os.path.isdir(folder) or not os.listdir(folder):
        return None
    number = 2
    while os.path.isdir(f"{folder}-{number}") and os.listdir(f"{folder}-{number}"):
        number += 1
    fresh = f"{folder}-{number}"
    training_args.output_dir = fresh
    logging_dir = getattr(training_args, "logging_dir", None)  # a field of TrainingArguments before transformers 5.x
    if isinstance(logging_dir, str) and logging_dir.startswith(folder + os.sep):
        training_args.logging_dir = fresh + logging_dir[len(folder) :]
    print(
        f"{folder} holds an earlier run: this run writes to {fresh} (--output_dir names another folder; "
        "--resume_from_checkpoint true continues the earlier run)."
    )
    return fresh
