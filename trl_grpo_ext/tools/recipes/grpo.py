"""The GRPO recipe (open-r1 style): `GRPOTrainerExt` on a dataset with reward functions, from a YAML config and flags
(`trl-grpo-ext grpo --config <yaml> [--field value ...]`; docs/recipes.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

from transformers import TrainerCallback

from ...config_checks import reward_weights_problem
from ...metrics import HELDOUT_PREFIX, LOSS
from .arguments import (
    ConfigError,
    check_loggers_installed,
    check_model_is_local_or_hub,
    drop_tensorboard_if_missing,
    fresh_output_dir,
    resume_checkpoint,
)
from .arguments import parse_args as _parse_args

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
            "heldout_every_steps): heldout_num_generations completions each, sampled exactly as training samples; "
            "every reward function is a metric, printed as mean@k and pass@k (held-out accuracy for exact-match "
            "rewards) and added to the model card. 0 switches it off."
        },
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads per process (1 was fastest for tiny models on 2 cores)."},
    )


def main(script_args: GRPOScriptArguments, training_args, model_args) -> dict:
    """Train, evaluate, save and (if asked) push; the held-out scores `{"before": ..., "after": ...}` (empty without
    `eval_samples`)."""
    import torch
    from transformers import AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from trl_grpo_ext import GRPOTrainerExt
    from trl_grpo_ext.tools.recipes.data import load_recipe_dataset
    from trl_grpo_ext.tools.recipes.rewards import resolve_reward_funcs

    started = time.time()
    if script_args.num_threads:
        torch.set_num_threads(script_args.num_threads)
    if model_args.model_name_or_path is None:
        raise ConfigError("Set `model_name_or_path` (a local folder or a Hub model id).")
    # Before anything loads, so that a wrong value fails at once.
    resume = resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    check_loggers_installed(training_args.report_to)
    if not script_args.eval_samples and training_args.heldout_every_steps:
        # eval_samples 0 switches the held-out evaluation off (`trl-grpo-ext demo --eval_samples 0`), its schedule too.
        print(
            f"eval_samples is 0: no held-out evaluation (heldout_every_steps={training_args.heldout_every_steps} is "
            "left unused; set eval_samples to the number of held-out test prompts for one)."
        )
        training_args.heldout_every_steps = 0

    try:  # a reward or dataset that the config names wrongly: said in one line, the rewards first (nothing to load)
        reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args.max_completion_length)
        wrong_weights = reward_weights_problem(training_args.reward_weights, script_args.reward_funcs)
        if wrong_weights is not None:
            raise ValueError(wrong_weights)
        dataset = load_recipe_dataset(
            script_args.dataset_name,
            script_args.dataset_config,
            dataset_format=script_args.dataset_format,
            system_prompt=script_args.system_prompt,
            required_splits=[script_args.dataset_train_split],
        )
    except ValueError as error:
        raise ConfigError(" ".join(str(error).split())) from error
    train_dataset = dataset[script_args.dataset_train_split]
    test_dataset = dataset.get(script_args.dataset_test_split)
    heldout = None
    if script_args.eval_samples:
        if test_dataset is None:
            raise ConfigError(
                f"eval_samples={script_args.eval_samples} needs a '{script_args.dataset_test_split}' split."
            )
        heldout = test_dataset.select(range(min(script_args.eval_samples, len(test_dataset))))

    check_model_is_local_or_hub(model_args.model_name_or_path)  # before transformers asks the Hub for it
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

    # Logged at step 0, so that the held-out curve of report.png starts there.
    before = {}
    if heldout is not None:
        trainer.add_callback(_EvaluateWhenTrainingBegins(trainer, before))
    trainer.train(resume_from_checkpoint=resume)
    after = _heldout_at_last_step(trainer) if heldout is not None else {}
    if after:
        trainer.save_state()  # the output folder's trainer_state.json holds the held-out curve for `report`

    trainer.card_metrics = {f"held-out {name.removeprefix(HELDOUT_PREFIX)} (before)": v for name, v in before.items()}
    trainer.card_metrics.update(
        {f"held-out {name.removeprefix(HELDOUT_PREFIX)} (after)": v for name, v in after.items()}
    )
    if training_args.push_to_hub:
        # Saves the model and tokenizer, writes the card and report, and uploads the output folder, once.
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    else:
        trainer.save_model(training_args.output_dir)
        trainer.create_model_card(dataset_name=script_args.dataset_name)
    if trainer.accelerator.is_main_process:
        if heldout is not None:
            k = training_args.heldout_num_generations
            each = "one sampled completion each" if k == 1 else f"{k} sampled completions each"
            print(f"\nHeld-out evaluation on {len(heldout)} test prompts, {each}:")
            print("\n".join(heldout_lines(before, after)))
        logged = any(LOSS in entry for entry in trainer.state.log_history)
        print(output_summary(training_args.output_dir, started, logged, training_args.logging_steps))
    _end_training(trainer)
    return {"before": before, "after": after}


def _end_training(trainer) -> None:
    """Wait for every process, shut a colocated vLLM engine down, then end accelerate's training."""
    # The engine tears its process groups down at exit: after `end_training()` they are gone and vLLM prints an error.
    trainer.accelerator.wait_for_everyone()
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)  # colocate mode: TRL's `vllm.LLM`
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine is not None:
        engine.shutdown()
    trainer.accelerator.end_training()


class _EvaluateWhenTrainingBegins(TrainerCallback):
    """The held-out evaluation before training, logged at step 0 inside `train()` (whose fresh state would drop an
    entry logged before), its values into `values`; a resumed run takes those its history logged at step 0."""

    def __init__(self, trainer, values: dict):
        self.trainer, self.values = trainer, values

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.values.update(_heldout_scores(self.trainer.evaluate_heldout(log=True)))
            return
        for entry in state.log_history:
            if entry.get("step") == 0 and any(key.startswith(HELDOUT_PREFIX) for key in entry):
                self.values.update(_heldout_scores(entry))
                return


def _heldout_at_last_step(trainer) -> dict[str, float]:
    """The held-out values logged at the last step (the evaluation is seeded), else a new evaluation, logged."""
    for entry in reversed(trainer.state.log_history):
        if entry.get("step") != trainer.state.global_step:
            break
        values = _heldout_scores(entry)
        if values:
            return values
    return _heldout_scores(trainer.evaluate_heldout(log=True))


def _heldout_scores(values: dict) -> dict[str, float]:
    """The held-out scores among `values`, without the sample sizes (`.../scored@<k>`)."""
    return {key: value for key, value in values.items() if key.startswith(HELDOUT_PREFIX) and "/scored@" not in key}


def heldout_lines(before: dict[str, float], after: dict[str, float]) -> list[str]:
    """One console line per held-out score of `after`, with its value `before` where there is one; a `pass@k` equal
    to its `mean@k` before and after is left out."""
    lines = []
    for name in after:
        metric, _, statistic = name.rpartition("/")
        mean = f"{metric}/mean@{statistic.removeprefix('pass@')}"
        if statistic.startswith("pass@") and mean in after:
            if after[mean] == after[name] and before.get(mean) == before.get(name):
                continue
        label = name.removeprefix(HELDOUT_PREFIX).replace("/", " ")
        if name in before:
            lines.append(f"  {label}: {before[name]:.3f} before GRPO -> {after[name]:.3f} after")
        else:  # resumed from a checkpoint of a run that did not evaluate before training
            lines.append(f"  {label}: {after[name]:.3f} after (no evaluation before GRPO in the run resumed)")
    return lines


def output_summary(output_dir: str, since: float, logged: bool, logging_steps: float) -> str:
    """One line naming what this run wrote into `output_dir` (files newer than `since`), and why `report.png` is
    missing where it is."""

    def written(name: str) -> bool:
        path = os.path.join(output_dir, name)
        files = (
            [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
            if os.path.isdir(path)
            else [path]
        )
        return any(os.path.isfile(f) and os.path.getmtime(f) >= since for f in files)

    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    parts = ["LoRA adapter"] if written("adapter_model.safetensors") else []
    parts += ["model"] if not parts and any(written(name) for name in weights) else []
    labels = {"tokenizer_config.json": "tokenizer", "README.md": "model card README.md", "report.png": "report.png"}
    parts += [label for name, label in {**labels, "runs": "TensorBoard runs/"}.items() if written(name)]
    line = f"Output folder: {output_dir} ({', '.join(parts) or 'nothing written'})"
    if not written("report.png"):
        if not logged:
            reason = f"no training step was logged (the run was shorter than logging_steps={logging_steps:g})"
        elif importlib.util.find_spec("matplotlib") is None:
            reason = "matplotlib is not installed (pip install matplotlib)"
        else:
            reason = "see the warnings above"
        line += f"; no report.png: {reason}"
    return line


DESCRIPTION = "Train with GRPO (GRPOTrainerExt) from a YAML config and flags; every config field is a flag."
USAGE = "%(prog)s --config <yaml> [--field value ...]"


def parse_args(argv: list[str] | None = None, prog: str | None = None, **kwargs) -> tuple:
    """(script arguments, `GRPOConfigExt`, `trl.ModelConfig`) from `argv` (`arguments.parse_args`)."""
    kwargs = {"description": DESCRIPTION, "usage": USAGE, **kwargs}
    return _parse_args(GRPOScriptArguments, argv, prog=prog, **kwargs)


def name_deepspeed_cpu_accelerator(training_args) -> None:
    """`DS_ACCELERATOR=cpu` unless set, without an accelerator or with `use_cpu`: DeepSpeed, where installed, then
    takes its CPU accelerator without a warning."""
    import torch

    if training_args.use_cpu or not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run(
    argv: list[str] | None = None,
    prog: str | None = None,
    optional_tensorboard: bool = False,
    new_folder_per_run: bool = False,
    **parse_kwargs,
) -> int:
    """Parse `argv` (default: the command line) and run the recipe; the exit status.

    Args:
        optional_tensorboard: run without TensorBoard where it is missing (the demo), saying so.
        new_folder_per_run: write into a fresh folder when `output_dir` holds an earlier run (the demo).
    """
    try:
        script_args, training_args, model_args = parse_args(argv, prog, **parse_kwargs)
        name_deepspeed_cpu_accelerator(training_args)
        if optional_tensorboard:
            drop_tensorboard_if_missing(training_args)
        if new_folder_per_run:
            fresh_output_dir(training_args)
        main(script_args, training_args, model_args)
    except ConfigError as error:  # a mistake in the command line or config: one line, no traceback
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
