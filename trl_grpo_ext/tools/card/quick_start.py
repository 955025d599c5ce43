"""The model card's quick start: where the trained model is loaded from, and the code that loads it, which runs as
written from any folder."""

from __future__ import annotations

import os
import re

from datasets import Dataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

# A Hub repository id: `name` or `owner/name`, each part letters, digits, `-`, `_` and `.` (not leading).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str | None) -> bool:
    """`owner/name` that is not a local path."""
    return bool(name) and name.count("/") == 1 and not os.path.exists(name)


def is_hub_dataset_id(name: str | None) -> bool:
    """Whether `name` is shaped as a Hub dataset id (`owner/name`, or a bare `name` such as `gsm8k`) and is not an
    existing local path: what the card's front matter may hold in `datasets`."""
    return bool(name) and _HUB_ID.fullmatch(name) is not None and ".." not in name and not os.path.exists(name)


def quick_start_lines(
    repo: str,
    is_adapter: bool,
    prompt: str | None = None,
    base_model: str | None = None,
    weights_saved: bool = True,
) -> list[str]:
    """The "Quick start" section: load the model (or adapter) from `repo` (a Hub id, or an absolute folder) and
    generate from `prompt`; where the base model of an adapter is a local folder, say so; where no weights were
    saved yet, how to save them."""
    prompt = "<your prompt>" if prompt is None else prompt
    lines = ["## Quick start", "", "```python"]
    if is_adapter:
        # PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing` when it wraps the base model.
        lines += [
            "import warnings",
            "",
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            "with warnings.catch_warnings():  # PEFT <= 0.21 reads transformers' deprecated is_gradient_checkpointing",
            '    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)',
            f'    model = AutoPeftModelForCausalLM.from_pretrained("{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        ]
    lines += [
        f'inputs = tokenizer([{prompt!r}], return_tensors="pt").to(model.device)',
        "output = model.generate(**inputs, max_new_tokens=64)",
        'print(tokenizer.decode(output[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
    ]
    if not weights_saved:
        saved = "adapter" if is_adapter else "model"
        lines += [
            f"No {saved} was saved with this card yet: `trainer.save_model()` (or a checkpoint, `save_strategy`) "
            f"writes it into `{repo}`, from where the quick start loads it.",
            "",
        ]
    if is_adapter and base_model is not None and not is_hub_id(base_model):
        lines += [
            f"The adapter's base model is the local folder `{base_model}` (`base_model_name_or_path` in "
            "`adapter_config.json`): the quick start runs where that folder exists.",
            "",
        ]
    return lines


def first_training_prompt(dataset) -> str | None:
    """The first `prompt` of a map-style `datasets.Dataset` where it is a string (not of a stream, which reading would
    consume), else `None`."""
    if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names or len(dataset) == 0:
        return None
    prompt = dataset[0]["prompt"]
    return prompt if isinstance(prompt, str) else None


_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
#: The files that hold a model's (or a LoRA adapter's) weights in a saved folder.
WEIGHT_FILES = {
    False: ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    True: ("adapter_model.safetensors", "adapter_model.bin"),
}


def weights_folder(trainer, is_adapter: bool) -> tuple[str, bool]:
    """The absolute folder the quick start loads the model from, and whether weights are there (or being written):
    the checkpoint being saved; else the output folder if it holds them; else the newest checkpoint that does, up to
    the current step (a later one is another run's); else the output folder."""
    output_dir = os.path.abspath(trainer.args.output_dir)
    step = trainer.state.global_step
    checkpoints = getattr(trainer, "_checkpoints", None)  # GRPOTrainerExt's (`checkpointing.Checkpoints`)
    if checkpoints is not None and checkpoints.staging:
        return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"), True

    def holds_weights(folder: str) -> bool:
        return any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES[is_adapter])

    if holds_weights(output_dir):
        return output_dir, True
    saved = []
    for folder in sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []:
        match = _CHECKPOINT.fullmatch(os.path.basename(folder))
        if match is not None and int(match.group(1)) <= step and holds_weights(folder):
            saved.append(folder)
    return (saved[-1], True) if saved else (output_dir, False)
