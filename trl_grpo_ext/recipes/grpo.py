"""GRPO recipe: train `GRPOTrainerExt` on a dataset with reward functions, from a YAML config or CLI flags.

    trl-grpo-ext grpo --config <config.yaml> [--field value ...]
    accelerate launch --config_file <accelerate.yaml> -m trl_grpo_ext grpo --config <config.yaml>
    accelerate launch --config_file <accelerate.yaml> <path of this file> --config <config.yaml>

(`python recipes/grpo.py ...` in a clone of the repository runs this script too.) Every field of the script
arguments below, of `GRPOConfigExt` and of `trl.ModelConfig` is a YAML key and a `--flag`; flags override the
YAML. The output folder ends up holding the model (or LoRA adapter) and tokenizer, TensorBoard logs, `report.png`
(once a training step was logged) and a model card, ready for `push_to_hub`. `--resume_from_checkpoint true`
resumes from the last checkpoint in the output folder, a path from that checkpoint; false (or unset) starts fresh.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class GRPOScriptArguments:
    """Data, rewards and evaluation of a recipe run."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A local folder or file (json, jsonl, parquet, csv) or a Hub dataset id."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration (e.g. 'main')."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split for evaluation."})
    dataset_format: str = field(
        default="prompt",
        metadata={
            "help": "How rows become prompts: 'prompt' (rows already have a `prompt` column) or 'gsm8k' "
            "(`question` -> prompt, `answer` -> `solution`, the final number)."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "If set, prompts become conversations: this system message, then the prompt as user."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["exact_match"],
        metadata={
            "help": "Reward functions: this package's (exact_match, gsm8k_accuracy, think_answer_format), TRL's by "
            "the names `trl grpo` takes (accuracy_reward and reasoning_accuracy_reward, which need math-verify: pip "
            "install 'trl-grpo-ext[math]'; think_format_reward; get_soft_overlong_punishment, over this run's "
            "max_completion_length), or import paths such as my_rewards.length_reward. Weights: --reward_weights."
        },
    )
    eval_samples: int = field(
        default=0,
        metadata={
            "help": "Held-out evaluation on this many test prompts, before and after training (and every "
            "eval_every_steps): eval_k completions each, sampled exactly as training samples; every reward function "
            "is a metric, printed as mean@k and pass@k (held-out accuracy for exact-match rewards) and added to the "
            "model card. 0 switches it off."
        },
    )
    eval_k: int = field(
        default=1,
        metadata={"help": "Completions sampled per held-out prompt (the k of mean@k and pass@k)."},
    )
    eval_every_steps: int = field(
        default=0,
        metadata={
            "help": "Also evaluate the held-out prompts every this many steps during training, logged as "
            "heldout/<reward>/mean@<k> and heldout/<reward>/pass@<k>. 0: before and after training only."
        },
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads per process (1 was fastest for tiny models on 2 cores)."},
    )
    console: str = field(
        default="compact",
        metadata={
            "help": "What the console shows per log step: 'compact' (a progress bar, unless disable_tqdm, and one "
            "line of the key signals with the alarms that start) or 'raw' (transformers' dict of every logged "
            "value).",
            "choices": ["compact", "raw"],
        },
    )


def apply_eval_fields(script_args: GRPOScriptArguments, training_args) -> None:
    """Set the trainer's held-out fields from the recipe's `eval_k` and `eval_every_steps`.

    Raises:
        ValueError: a value out of range, held-out settings without `eval_samples`, or a `heldout_*` field of the
            training config set to something else than the recipe's field says.
    """
    from trl_grpo_ext import GRPOConfigExt

    if script_args.eval_k < 1 or script_args.eval_every_steps < 0:
        raise ValueError(
            f"eval_k must be >= 1 and eval_every_steps >= 0, got {script_args.eval_k} and "
            f"{script_args.eval_every_steps}."
        )
    if not script_args.eval_samples and (script_args.eval_k != 1 or script_args.eval_every_steps):
        raise ValueError("eval_k and eval_every_steps need eval_samples > 0 (the number of held-out prompts).")
    defaults = GRPOConfigExt.__dataclass_fields__
    for ours, theirs in (("eval_k", "heldout_num_generations"), ("eval_every_steps", "heldout_every_steps")):
        value, current = getattr(script_args, ours), getattr(training_args, theirs)
        if current not in (defaults[theirs].default, value):
            raise ValueError(f"{ours}={value} and {theirs}={current} disagree: set {ours} only.")
        setattr(training_args, theirs, value)
    too_large = [k for k in training_args.heldout_pass_at or [] if k > script_args.eval_k]
    if too_large:
        raise ValueError(f"heldout_pass_at={training_args.heldout_pass_at} needs eval_k >= {max(too_large)}.")


def output_summary(output_dir: str, since: float, logged: bool, logging_steps: float) -> str:
    """One line naming what this run wrote into `output_dir`: files older than `since` (left by an earlier run) do not
    count, and a missing `report.png` is named with its reason."""

    def written(name: str) -> bool:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            return any(
                os.path.getmtime(os.path.join(root, file)) >= since
                for root, _, files in os.walk(path)
                for file in files
            )
        return os.path.isfile(path) and os.path.getmtime(path) >= since

    parts = []
    if written("adapter_model.safetensors"):
        parts.append("LoRA adapter")
    elif any(written(name) for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        parts.append("model")
    parts += [
        label
        for name, label in (
            ("tokenizer_config.json", "tokenizer"),
            ("README.md", "model card README.md"),
            ("report.png", "report.png"),
            ("runs", "TensorBoard runs/"),
        )
        if written(name)
    ]
    line = f"Output folder: {output_dir} ({', '.join(parts) or 'nothing written'})"
    if not written("report.png"):
        if not logged:
            reason = f"no training step was logged (the run was shorter than logging_steps={logging_steps:g})"
        elif importlib.util.find_spec("matplotlib") is None:
            reason = "matplotlib is not installed (pip install 'trl-grpo-ext[recipes]')"
        else:
            reason = "see the warnings above"
        line += f"; no report.png: {reason}"
    return line


def resolve_resume_from_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder that `resume_from_checkpoint` names, or None to start fresh.

    A flag's value arrives as a string and a YAML key's as a bool. The words that transformers' argument parser reads
    as booleans (true/false, yes/no, t/f, y/n, 1/0, any case) mean what `Trainer.train(resume_from_checkpoint=...)`
    makes of a bool: false starts fresh, true resumes from the last `checkpoint-<step>` folder in `output_dir`.
    "last" means true as well; an empty value or None, false. Anything else is a checkpoint folder's path.

    Raises:
        ValueError: true with no checkpoint in `output_dir` (as `Trainer.train` does), or a path that is not a
            checkpoint folder; both name the folder.
    """
    from argparse import ArgumentTypeError

    from transformers.hf_argparser import string_to_bool
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    if isinstance(value, str):
        word = value.strip()
        if word.lower() == "last":
            value = True
        elif not word:
            value = None
        else:
            try:
                value = string_to_bool(word)
            except ArgumentTypeError:
                value = word
    if value is None or value is False:
        return None
    if value is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=true: no checkpoint-<step> folder in output_dir {output_dir!r} to resume "
                "from. Pass a checkpoint folder's path, or `--resume_from_checkpoint false` to start fresh."
            )
        return last
    if not os.path.isdir(value):
        raise ValueError(f"resume_from_checkpoint: there is no checkpoint folder at {value!r}.")
    if not os.path.isfile(os.path.join(value, TRAINER_STATE_NAME)):
        raise ValueError(
            f"resume_from_checkpoint: {value!r} is not a checkpoint folder (it has no {TRAINER_STATE_NAME}). Pass "
            "a checkpoint-<step> folder, or `--resume_from_checkpoint true` for the last one in output_dir."
        )
    return value


#: The loggers of `report_to` that transformers refuses only once the model is loaded when they are missing.
CHECKED_LOGGERS = ("tensorboard", "trackio", "wandb")
RECIPES_EXTRA = 'pip install "trl-grpo-ext[recipes]"'


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


DESCRIPTION = "Train with GRPO (GRPOTrainerExt) from a YAML config and flags; every config field is a flag."
USAGE = "%(prog)s --config <yaml> [--field value ...]"


def make_parser(prog: str | None = None, description: str = DESCRIPTION, usage: str = USAGE):
    """The recipe's `TrlParser` over (script arguments, `GRPOConfigExt`, `trl.ModelConfig`).

    Args:
        prog: the command name shown by `--help`.
        description: the line `--help` shows before the arguments.
        usage: the usage line (argparse's own would list every field).
    """
    from trl import ModelConfig, TrlParser

    from trl_grpo_ext import GRPOConfigExt

    return TrlParser(
        (GRPOScriptArguments, GRPOConfigExt, ModelConfig), prog=prog, description=description, usage=usage
    )


def main(script_args: GRPOScriptArguments, training_args, model_args) -> dict:
    """Train, evaluate, save and (if asked) push.

    Returns:
        `dict`: `{"before": ..., "after": ...}`, each the held-out metrics of `HeldoutEvaluationMixin.evaluate_heldout`
        (`heldout/<reward>/mean@<k>`, `heldout/<reward>/pass@<k>`), empty without `eval_samples`.
    """
    import torch
    from transformers import AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from trl_grpo_ext import GRPOTrainerExt
    from trl_grpo_ext.console import CONSOLE_MODES, ConsoleCallback
    from trl_grpo_ext.recipes.data import load_recipe_dataset
    from trl_grpo_ext.recipes.rewards import resolve_reward_funcs

    started = time.time()
    if script_args.console not in CONSOLE_MODES:
        raise ValueError(f"`console` must be one of {CONSOLE_MODES}, got {script_args.console!r}.")
    if script_args.num_threads:
        torch.set_num_threads(script_args.num_threads)
    if model_args.model_name_or_path is None:
        raise ValueError("Set `model_name_or_path` (a local folder or a Hub model id).")
    # Before anything loads, so that a wrong value fails at once.
    resume = resolve_resume_from_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    check_loggers_installed(training_args.report_to)
    dataset = load_recipe_dataset(
        script_args.dataset_name,
        script_args.dataset_config,
        dataset_format=script_args.dataset_format,
        system_prompt=script_args.system_prompt,
        required_splits=[script_args.dataset_train_split],
    )
    train_dataset = dataset[script_args.dataset_train_split]
    test_dataset = dataset[script_args.dataset_test_split] if script_args.dataset_test_split in dataset else None
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args.max_completion_length)
    if script_args.eval_samples and test_dataset is None:
        raise ValueError(f"eval_samples={script_args.eval_samples} needs a '{script_args.dataset_test_split}' split.")
    apply_eval_fields(script_args, training_args)
    heldout = None
    if script_args.eval_samples:
        heldout = test_dataset.select(range(min(script_args.eval_samples, len(test_dataset))))

    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, padding_side="left"
    )
    trainer = GRPOTrainerExt(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        heldout_metrics=reward_funcs if heldout is not None else None,
        heldout_dataset=heldout,
    )

    if script_args.console == "compact":
        ConsoleCallback.install(trainer)

    # Every process samples its share of the held-out prompts (sampled as training samples); all get the result.
    before = trainer.evaluate_heldout(log=False) if heldout is not None else {}
    trainer.train(resume_from_checkpoint=resume)
    after = trainer.evaluate_heldout(log=False) if heldout is not None else {}

    trainer.card_metrics = {f"held-out {name.removeprefix('heldout/')} (before)": v for name, v in before.items()}
    trainer.card_metrics.update({f"held-out {name.removeprefix('heldout/')} (after)": v for name, v in after.items()})
    if training_args.push_to_hub:
        # Saves the model and tokenizer, writes the card and report, and uploads the output folder, once.
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    else:
        trainer.save_model(training_args.output_dir)
        trainer.create_model_card(dataset_name=script_args.dataset_name)
    if heldout is not None and trainer.accelerator.is_main_process:
        each = (
            "one sampled completion each"
            if script_args.eval_k == 1
            else f"{script_args.eval_k} sampled completions each"
        )
        print(f"\nHeld-out evaluation on {len(heldout)} test prompts, {each}:")
        for name in before:
            label = name.removeprefix("heldout/").replace("/", " ")
            print(f"  {label}: {before[name]:.3f} before GRPO -> {after[name]:.3f} after")
    if trainer.accelerator.is_main_process:
        logged = any("loss" in entry for entry in trainer.state.log_history)
        print(output_summary(training_args.output_dir, started, logged, training_args.logging_steps))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return {"before": before, "after": after}


def parse_args(
    argv: list[str] | None = None,
    prog: str | None = None,
    description: str = DESCRIPTION,
    usage: str = USAGE,
    defaults: dict | None = None,
) -> tuple:
    """Parse `argv` (default: the command line) into (script arguments, `GRPOConfigExt`, `trl.ModelConfig`).

    Args:
        prog, description, usage: see `make_parser`.
        defaults: field values that replace the dataclasses' defaults, as a config file's do; `--config` and flags
            override them.

    Raises:
        ValueError: for a field of `defaults` that no dataclass has.
    """
    parser = make_parser(prog, description, usage)
    if defaults:
        unknown = parser.set_defaults_with_config(**defaults)
        if unknown:
            raise ValueError(f"Unknown fields in the defaults: {unknown}.")
    return parser.parse_args_and_config(argv)


def run(
    argv: list[str] | None = None, prog: str | None = None, optional_tensorboard: bool = False, **parse_kwargs
) -> int:
    """Parse `argv` (default: the command line, see `parse_args`) and run the recipe; the exit status (`--help`
    exits with 0).

    Args:
        optional_tensorboard: run without TensorBoard when it is not installed, saying so (the demo), instead of
            refusing a `report_to` that names it.
    """
    from trl_grpo_ext.recipes.cpu_engines import enable_sharded_engines_on_cpu

    enable_sharded_engines_on_cpu()  # an FSDP/DeepSpeed launch on CPU-only processes: shard for real (a check run)
    script_args, training_args, model_args = parse_args(argv, prog, **parse_kwargs)
    if optional_tensorboard:
        drop_tensorboard_if_missing(training_args)
    main(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(run())
