"""The model card (`README.md`) that a training run leaves in its output folder, ready for the Hugging Face Hub.

`build_model_card` writes the text; `ModelCardMixin.create_model_card` (Trainer's hook) gathers what it needs from a
trainer and also draws `report.png`. The card's objective is the one that ran (`objective_formula`): the loss type's
policy term and aggregation (`ops.loss_types`) and the options that change it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import ModelCardData
from transformers import is_wandb_available
from transformers.utils import logging
from trl.trainer.utils import get_comet_experiment_url, get_config_model_id, get_trackio_space_url

from .card_objective import (
    OBJECTIVE,
    OBJECTIVE_FIELDS,
    format_value,
    objective_formula,
    objective_options,
    resolve_options,
)

__all__ = [
    "build_model_card",
    "final_metrics",
    "objective_formula",
    "objective_options",
    "run_urls",
    "CARD_CONFIG_FIELDS",
    "CARD_METRICS",
    "OBJECTIVE_FIELDS",
    "ModelCardMixin",
]

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


#: The configuration fields that decide the objective a run trains (`objective_options`, `objective_formula`).
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


def run_urls() -> dict[str, str | None]:
    """The links of the experiment-tracking runs in progress, found as TRL's own card finds them: `wandb.run.url`,
    and TRL's `get_trackio_space_url` and `get_comet_experiment_url`; `None` for a tracker without a run."""
    wandb_url = None
    if is_wandb_available():
        import wandb

        if wandb.run is not None:
            wandb_url = wandb.run.url
    return {"wandb_url": wandb_url, "trackio_url": get_trackio_space_url(), "comet_url": get_comet_experiment_url()}


def _is_hub_id(name: str | None) -> bool:
    """`owner/name` that is not a local path."""
    return bool(name) and name.count("/") == 1 and not os.path.exists(name)


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
    objective: Mapping | None = None,
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    comet_url: str | None = None,
    alarms: list[str] | None = None,
) -> str:
    """A model card with YAML front matter (`library_name`, `base_model` where known, `model_name`, `datasets`,
    `tags`), the objective, the training configuration, the final metrics, the report image, the links of the
    tracked runs and a usage snippet.

    Args:
        model_name: title of the card, and `model_name` of its front matter (as TRL writes it).
        base_model: Hub id of the base model, or `None` (a local path is not a Hub id and is left out).
        is_adapter: a PEFT adapter (`library_name: peft`, tag `lora`) rather than a full model.
        config: training configuration fields to list (see `CARD_CONFIG_FIELDS`).
        metrics: final training metrics (see `final_metrics`).
        extra_metrics: more rows for the metrics table, e.g. held-out accuracy before and after training.
        tags, hub_model_id: card metadata.
        dataset_name: the training set, written to the front matter's `datasets` as TRL writes it (a Hub id or not);
            linked to the Hub when it is a Hub id.
        report_image: relative path of the training report image, or `None`.
        lora: LoRA settings to list (rank, alpha, target modules).
        objective: the options of the objective that ran (`objective_options(args)`, see `objective_formula`); by
            default the `OBJECTIVE_FIELDS` among `config`'s keys, and `GRPOConfigExt`'s defaults for the others.
        wandb_url, trackio_url, comet_url: links of the Weights & Biases, Trackio and Comet runs (`run_urls()`).
        alarms: the alarms raised during training, one line each (`health.assess(...).alarm_lines()`), for a
            "Training health" section; an empty list says that none was raised, `None` leaves the section out.
    """
    objective = resolve_options(config if objective is None else objective)
    formula = objective_formula(objective)
    if formula == OBJECTIVE:
        loss = "the DeepSeekMath objective"
    else:
        loss = f"the `{objective['loss_type']}` objective of TRL (below)"
    all_tags = ["trl", "grpo", "trl_grpo_ext"] + (["lora"] if is_adapter else []) + list(tags or [])
    data = ModelCardData(
        library_name="peft" if is_adapter else "transformers",
        base_model=base_model,
        tags=list(dict.fromkeys(all_tags)),
        datasets=dataset_name,
        model_name=model_name,
        pipeline_tag="text-generation",
    )
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
    names = [
        f"[{name}](https://huggingface.co/datasets/{name})" if _is_hub_id(name) else f"`{name}`" for name in datasets
    ]
    on = f" on the {', '.join(names)} dataset{'s' if len(names) > 1 else ''}" if names else ""
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
        f"This model is {what} {base}{on}, trained with GRPO (group relative policy optimisation) by the "
        f"`GRPOTrainerExt` of `trl_grpo_ext`: a TRL `GRPOTrainer` whose loss is {loss}.",
        "",
        "## Objective",
        "",
        "For each prompt, G completions are sampled and scored; token t of completion i:",
        "",
        formula,
        "",
        "## Training configuration",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    lines += [f"| `{key}` | {format_value(value)} |" for key, value in config.items() if value is not None]
    if lora:
        lines += [f"| `lora_{key}` | {format_value(value)} |" for key, value in lora.items() if value is not None]
    lines += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| `{key}` | {format_value(value)} |" for key, value in {**metrics, **(extra_metrics or {})}.items()]
    if alarms is not None:
        lines += ["", "## Training health", ""]
        if alarms:
            lines += ["Alarms raised during training (each with the steps it held and what to change):", ""]
            lines += [f"- {alarm}" for alarm in alarms]
        else:
            lines += [
                "No alarm was raised during training (truncation, reward spread, KL, clipping, ratio, entropy, "
                "gradient norm, length, held-out metric)."
            ]
    runs = [
        f"- [Visualize in {tracker}]({url})"
        for tracker, url in (("Weights & Biases", wandb_url), ("Trackio", trackio_url), ("Comet", comet_url))
        if url
    ]
    if report_image or runs:
        lines += ["", "## Training report"]
    if report_image:
        lines += ["", f"![Training curves: reward, reward spread, KL, clip fraction, ratio, loss]({report_image})"]
    if runs:
        lines += ["", *runs]
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
        with `library_name`, `base_model` (when it is a Hub id), `model_name` and `datasets` (as TRL writes them),
        tags (`trl`, `grpo`, `trl_grpo_ext`, and `lora` for adapters); the objective that runs; the training
        configuration; the final metrics; the alarms raised (the rules of `args`' `warn_*` thresholds, replayed over
        the log history); the report image (alarm episodes shaded) and the links of the W&B, Trackio and Comet runs
        that TRL's card links; usage.
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
        from .guardrails.anomaly import AnomalyMonitor
        from .health import assess

        health = assess(self.state.log_history, AnomalyMonitor.from_config(self.args))
        report = None
        try:
            from .report import plot_training_report

            report = plot_training_report(
                self.state.log_history,
                os.path.join(output_dir, "report.png"),
                title=model_name,
                clip_range=(self.epsilon_low, self.epsilon_high),
                episodes=health.episodes,
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
            objective=objective_options(self.args),
            alarms=health.alarm_lines(),
            **run_urls(),
        )
        with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)
