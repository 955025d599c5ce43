"""The model card (`README.md`) that a training run leaves in its output folder, ready for the Hugging Face Hub.

`build_model_card` writes the text; `ModelCardMixin.create_model_card` (Trainer's hook) gathers what it needs from a
trainer and also draws `report.png`.
"""

from __future__ import annotations

import enum
import math
import os
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import ModelCardData
from transformers.utils import logging
from trl.trainer.utils import get_config_model_id

__all__ = ["build_model_card", "final_metrics", "CARD_CONFIG_FIELDS", "CARD_METRICS", "ModelCardMixin"]

logger = logging.get_logger(__name__)

CARD_CONFIG_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "num_iterations",
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "seed",
)
CARD_METRICS = (
    "reward",
    "reward_std/group_mean",
    "frac_reward_zero_std",
    "kl",
    "clip_ratio/region_mean",
    "ratio/p05",
    "ratio/p50",
    "ratio/p95",
    "entropy",
    "completions/mean_length",
    "loss",
)

OBJECTIVE = r"""```
r_it = exp(logp_it - old_logp_it)
S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
K_it = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1
loss = -(1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it),   A_i = (R_i - mean_group R) / (std_group R + 1e-4)
```"""


def final_metrics(log_history: list[dict], keys: tuple[str, ...] = CARD_METRICS) -> dict[str, float]:
    """The last logged value of each training metric in `keys` (rewards are logged only at generating steps)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        if "loss" not in entry:
            continue
        for key in keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
                metrics[key] = value
    return metrics


def _is_hub_id(name: str | None) -> bool:
    """`owner/name` that is not a local path."""
    return bool(name) and name.count("/") == 1 and not os.path.exists(name)


def _format(value) -> str:
    """A value as a user writes it in a config: `constant` for `SchedulerType.CONSTANT`, `0.001` for 1e-3."""
    if isinstance(value, enum.Enum):  # str(SchedulerType.CONSTANT) is "SchedulerType.CONSTANT"
        value = value.value
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(_format(item) for item in value)
    return str(value)


def _package_versions() -> list[str]:
    lines = []
    for package in ("trl_grpo_ext", "trl", "transformers", "peft", "torch", "datasets", "accelerate"):
        distribution = "trl-grpo-ext" if package == "trl_grpo_ext" else package
        try:
            lines.append(f"- {package}: {version(distribution)}")
        except PackageNotFoundError:
            continue
    return lines


def build_model_card(
    *,
    model_name: str,
    base_model: str | None,
    is_adapter: bool,
    config: dict,
    metrics: dict[str, float],
    extra_metrics: dict[str, float] | None = None,
    tags: list[str] | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    report_image: str | None = "report.png",
    lora: dict | None = None,
) -> str:
    """A model card with YAML front matter (`library_name`, `base_model` where known, `tags`), the objective, the
    training configuration, the final metrics, the report image and a usage snippet.

    Args:
        model_name: title of the card.
        base_model: Hub id of the base model, or `None` (a local path is not a Hub id and is left out).
        is_adapter: a PEFT adapter (`library_name: peft`, tag `lora`) rather than a full model.
        config: training configuration fields to list (see `CARD_CONFIG_FIELDS`).
        metrics: final training metrics (see `final_metrics`).
        extra_metrics: more rows for the metrics table, e.g. held-out accuracy before and after training.
        tags, dataset_name, hub_model_id: card metadata.
        report_image: relative path of the training report image, or `None`.
        lora: LoRA settings to list (rank, alpha, target modules).
    """
    all_tags = ["trl", "grpo", "trl_grpo_ext"] + (["lora"] if is_adapter else []) + list(tags or [])
    data = ModelCardData(
        library_name="peft" if is_adapter else "transformers",
        base_model=base_model,
        tags=list(dict.fromkeys(all_tags)),
        datasets=[dataset_name] if _is_hub_id(dataset_name) else None,
        pipeline_tag="text-generation",
    )
    repo = hub_model_id or model_name
    what = "a LoRA adapter for" if is_adapter else "a fine-tune of"
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a locally built base model"
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {model_name}",
        "",
        f"This model is {what} {base}, trained with GRPO (group relative policy optimisation) by the "
        "`GRPOTrainerExt` of `trl_grpo_ext`: a TRL `GRPOTrainer` whose loss is the DeepSeekMath objective.",
        "",
        "## Objective",
        "",
        "For each prompt, G completions are sampled and scored; token t of completion i:",
        "",
        OBJECTIVE,
        "",
        "## Training configuration",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    lines += [f"| `{key}` | {_format(value)} |" for key, value in config.items() if value is not None]
    if lora:
        lines += [f"| `lora_{key}` | {_format(value)} |" for key, value in lora.items() if value is not None]
    lines += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| `{key}` | {_format(value)} |" for key, value in {**metrics, **(extra_metrics or {})}.items()]
    if report_image:
        lines += [
            "",
            "## Training report",
            "",
            f"![Training curves: reward, reward spread, KL, clip fraction, ratio, loss]({report_image})",
        ]
    lines += ["", "## Usage", "", "```python"]
    if is_adapter:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")',
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
        'inputs = tokenizer(["<your prompt>"], return_tensors="pt").to(model.device)',
        "output = model.generate(**inputs, max_new_tokens=64)",
        'print(tokenizer.decode(output[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
        "## Framework versions",
        "",
        *_package_versions(),
        "",
    ]
    return "\n".join(lines)


class ModelCardMixin:
    """`create_model_card` for a `GRPOTrainer` subclass: this module's card and the training report."""

    #: Extra rows for the model card's metrics table (e.g. held-out accuracy measured by a recipe).
    card_metrics: dict[str, float] | None = None

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        """Write `README.md` (a Hub model card) and `report.png` (training curves) into `args.output_dir`.

        Called by `Trainer.push_to_hub` and at every checkpoint, like TRL's own card, which it replaces: front matter
        with `library_name`, `base_model` (when it is a Hub id), tags (`trl`, `grpo`, `trl_grpo_ext`, and `lora` for
        adapters); the objective; the training configuration; the final metrics; the report image; usage.
        """
        if not self.is_world_process_zero():
            return
        from peft import PeftModel

        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model_id = get_config_model_id(self.model.config)
        base_model = model_id if model_id and not os.path.isdir(model_id) else None
        unwrapped = self.accelerator.unwrap_model(self.model)
        is_adapter = isinstance(unwrapped, PeftModel)
        report = None
        try:
            from .report import plot_training_report

            report = plot_training_report(
                self.state.log_history,
                os.path.join(output_dir, "report.png"),
                title=model_name,
                clip_range=(self.epsilon_low, self.epsilon_high),
            )
        except ImportError:
            logger.warning("matplotlib is not installed: no report.png (pip install 'trl-grpo-ext[recipes]').")
        lora = None
        if is_adapter:
            peft_config = unwrapped.peft_config["default"]
            targets = peft_config.target_modules
            lora = {
                "r": getattr(peft_config, "r", None),
                "alpha": getattr(peft_config, "lora_alpha", None),
                "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
            }
        card = build_model_card(
            model_name=model_name or os.path.basename(os.path.normpath(output_dir)),
            base_model=base_model,
            is_adapter=is_adapter,
            config={key: getattr(self.args, key, None) for key in CARD_CONFIG_FIELDS},
            metrics=final_metrics(self.state.log_history),
            extra_metrics=self.card_metrics,
            tags=[tags] if isinstance(tags, str) else tags,
            dataset_name=dataset_name,
            hub_model_id=self.hub_model_id,
            report_image="report.png" if report else None,
            lora=lora,
        )
        with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)
