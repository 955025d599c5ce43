"""This package's sections, added to the model card TRL's `create_model_card` wrote (docs/recipes.md, "What a run
leaves in `output_dir`"): the quick start that loads the result, the objective that ran, the configuration, the final
metrics, the training health and `report.png`. TRL's front matter, title, "Training procedure" and "Citations" stay
as TRL wrote them."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import ModelCard
from transformers.utils import logging
from trl.trainer.utils import get_config_model_id

from ...guardrails.anomaly import AlarmSettings
from ...metrics import (
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    FRAC_REWARD_ZERO_STD,
    KL,
    LOSS,
    RATIO_P05,
    RATIO_P50,
    RATIO_P95,
    REWARD,
    REWARD_STD_GROUP_MEAN,
)
from ..report.figure import plot_training_report
from ..report.health import assess
from .fields import card_config, user_lora_settings
from .objective import OBJECTIVE, format_value, objective_formula, objective_options, resolve_options
from .quick_start import first_training_prompt, is_hub_dataset_id, is_hub_id, quick_start_lines, weights_folder

logger = logging.get_logger(__name__)

#: The tags first in the front matter, in this order (TRL writes its tags as a set).
LEADING_TAGS = ("generated_from_trainer", "trl", "grpo", "trl_grpo_ext")
CARD_METRICS = (
    REWARD,
    REWARD_STD_GROUP_MEAN,
    FRAC_REWARD_ZERO_STD,
    KL,
    CLIP_RATIO_REGION_MEAN,
    RATIO_P05,
    RATIO_P50,
    RATIO_P95,
    ENTROPY,
    COMPLETIONS_MEAN_LENGTH,
    LOSS,
)
#: Framework versions listed besides TRL's: label, distribution (this package's first, the others after TRL's).
EXTRA_FRAMEWORKS = (("trl_grpo_ext", "trl-grpo-ext"), ("PEFT", "peft"), ("Accelerate", "accelerate"))
_HEADING = re.compile(r"#{1,6} ")


def final_metrics(log_history: list[dict], keys: tuple[str, ...] = CARD_METRICS) -> dict[str, float]:
    """The last logged value of each training metric in `keys` (rewards are logged only at generating steps)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        if LOSS in entry:
            for key in keys:
                value = entry.get(key)
                if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
                    metrics[key] = value
    return metrics


def _sections(text: str) -> list[list[str]]:
    """The lines of `text` cut before each heading outside a fenced code block; the first part has no heading."""
    parts, fenced = [[]], False
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and _HEADING.match(line):
            parts.append([])
        parts[-1].append(line)
    return parts


def _framework_versions(lines: list[str]) -> list[str]:
    """TRL's "Framework versions" section with this package's version first and PEFT's and accelerate's after."""
    extra = {}
    for label, distribution in EXTRA_FRAMEWORKS:
        try:
            extra[label] = f"- {label}: {version(distribution)}"
        except PackageNotFoundError:
            continue
    first = [extra.pop("trl_grpo_ext")] if "trl_grpo_ext" in extra else []
    listed = [line for line in lines[1:] if line.strip()]
    return [lines[0], "", *first, *listed, *extra.values(), ""]


def extend_card(
    trl_card: str,
    *,
    is_adapter: bool,
    config: dict,
    metrics: Mapping[str, float],
    objective: Mapping | None = None,
    dataset_name: str | list[str] | None = None,
    hub_model_id: str | None = None,
    model_path: str | None = None,
    weights_saved: bool = True,
    prompt: str | None = None,
    base_model_path: str | None = None,
    lora: dict | None = None,
    alarms: list[str] | None = None,
    alarms_off: bool = False,
    report_image: str | None = "report.png",
) -> str:
    """`trl_card` (the text of TRL's `README.md` for the run) with this package's parts.

    The front matter gets the `trl_grpo_ext` tag (and `lora`, `library_name: peft` for an adapter), only Hub dataset
    ids in `datasets`, and `pipeline_tag`. TRL's introduction and quick start are replaced (they name a Hub
    repository that a run not pushed has not got); "Objective", "Training configuration", "Final metrics",
    "Training health" and "Training report" go before TRL's "Training procedure"; this package, PEFT and accelerate
    join TRL's "Framework versions".

    Args:
        trl_card: the card TRL's `create_model_card` wrote.
        is_adapter: a PEFT adapter rather than a full model.
        config: the configuration rows (`card_config(args)`).
        metrics: the final metrics' rows (`final_metrics`, and any more).
        objective: the objective's options (`objective_options(args)`); default: those among `config`'s keys.
        dataset_name: the training set (a name or a list); only Hub ids go into the front matter.
        hub_model_id, model_path, weights_saved, prompt, base_model_path: where the quick start loads the model from
            (`quick_start_lines`).
        lora: LoRA settings as the user set them (`user_lora_settings`).
        alarms: the health findings (`RunHealth.problem_lines()`) for "Training health"; `None` leaves it out.
        alarms_off: the run had its alarms off (`warn_on_anomalies=False`).
        report_image: the path of `report.png` relative to the card, or `None`.
    """
    card = ModelCard(trl_card)
    data = card.data
    model_name, base_model = data.model_name, data.base_model
    rest = sorted(set(data.tags or []) - set(LEADING_TAGS) - {"lora"})
    data.tags = [*LEADING_TAGS, *(["lora"] if is_adapter else []), *rest]
    data.library_name = "peft" if is_adapter else "transformers"
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
    hub_datasets = [name for name in datasets if is_hub_dataset_id(name)]
    data.datasets = (hub_datasets[0] if isinstance(dataset_name, str) else hub_datasets) if hub_datasets else None
    data.pipeline_tag = "text-generation"

    objective = resolve_options(config if objective is None else objective)
    formula = objective_formula(objective)
    loss = f"the `{objective['loss_type']}` objective of TRL (below)"
    loss = "the DeepSeekMath objective" if formula == OBJECTIVE else loss
    names = [f"[{n}](https://huggingface.co/datasets/{n})" if is_hub_id(n) else f"`{n}`" for n in datasets]
    on = f" on the {', '.join(names)} dataset{'s' if len(names) > 1 else ''}" if names else ""
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a locally built base model"
    what = "a LoRA adapter for" if is_adapter else "a fine-tune of"
    introduction = (
        f"This model is {what} {base}{on}, trained with GRPO (group relative policy optimisation) by the "
        f"`GRPOTrainerExt` of `trl_grpo_ext`: a TRL `GRPOTrainer` whose loss is {loss}."
    )
    repo = hub_model_id or model_path or model_name
    weights_saved = weights_saved or hub_model_id is not None
    ours = ["## Objective", "", "For each prompt, G completions are sampled and scored; token t of completion i:", ""]
    ours += [formula, "", "## Training configuration", "", "| field | value |", "| --- | --- |"]
    ours += [f"| `{key}` | {format_value(value)} |" for key, value in config.items() if value is not None]
    ours += [f"| `lora_{key}` | {format_value(value)} |" for key, value in (lora or {}).items() if value is not None]
    ours += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
    ours += [f"| `{key}` | {format_value(value)} |" for key, value in metrics.items()]
    if alarms is not None:
        ours += ["", "## Training health", ""]
        if alarms_off:
            ours += ["The alarms were off in this run (`warn_on_anomalies=False`).", ""]
        if alarms_off and not alarms:
            ours += ["The other health checks (non-finite values, gradient norm, counts) found nothing."]
        elif alarms:
            ours += ["Problems found in training (each with the steps concerned and what to change):", ""]
            ours += [f"- {alarm}" for alarm in alarms]
        else:
            ours += [
                "No alarm was raised during training (unscored rewards, truncation, reward spread, KL, clipping, "
                "ratio, entropy, gradient norm, length, held-out metric) and the health checks found nothing."
            ]
    if report_image:
        ours += ["", "## Training report", ""]
        ours += [f"![Training curves: reward, reward spread, KL, clip fraction, ratio, loss]({report_image})"]

    quick_start = quick_start_lines(repo, is_adapter, prompt, base_model_path, weights_saved)
    lines = []
    for part in _sections(card.text):
        heading = part[0] if _HEADING.match(part[0]) else None
        if heading is not None and heading.startswith("# "):  # the title: our introduction replaces TRL's
            lines += [heading, "", introduction, ""]
        elif heading == "## Quick start":
            lines, quick_start = lines + quick_start, []
        elif heading == "## Training procedure":
            lines, ours = [*lines, *quick_start, *ours, "", *part], []
        elif heading == "### Framework versions":
            lines += _framework_versions(part)
        elif heading is not None:
            lines += part
    lines += [*quick_start, *ours]  # where TRL's card had no such section
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines).strip("\n") + "\n"


def add_to_model_card(
    trainer,
    dataset_name: str | list[str] | None = None,
    *,
    peft_config=None,
    card_metrics: Mapping[str, float] | None = None,
) -> None:
    """Add this package's parts (`extend_card`) to the `README.md` that TRL's `create_model_card` wrote into
    `trainer.args.output_dir`, and draw `report.png` there. Call it on the main process.

    Args:
        trainer (`GRPOTrainer`): the run.
        dataset_name: as `create_model_card` takes it.
        peft_config: the `peft_config` as the user gave it (before PEFT expanded its `target_modules`); default: the
            wrapped model's own.
        card_metrics: more rows of the final metrics (a recipe's held-out scores before and after training).
    """
    from peft import PeftModel

    args, history = trainer.args, trainer.state.log_history
    path = os.path.join(args.output_dir, "README.md")
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    is_adapter = isinstance(unwrapped, PeftModel)
    settings = AlarmSettings.from_config(args)
    health = assess(history, settings.monitor(live=True))  # no alarm where the run had none
    report = None
    try:
        report = plot_training_report(
            history,
            os.path.join(args.output_dir, "report.png"),
            title=os.path.basename(os.path.normpath(args.output_dir)),
            clip_range=(trainer.epsilon_low, trainer.epsilon_high),
            episodes=health.episodes,
            thresholds=settings.thresholds,
            verdict=health.headline(),
        )
    except ImportError:  # the card is written at every checkpoint: said once
        logger.warning_once("matplotlib is not installed: no report.png (pip install matplotlib).")
    model_id = get_config_model_id(trainer.model.config)
    model_path, weights_saved = weights_folder(trainer, is_adapter)
    with open(path, encoding="utf-8") as handle:
        trl_card = handle.read()
    card = extend_card(
        trl_card,
        is_adapter=is_adapter,
        config=card_config(args),
        metrics={**final_metrics(history), **(card_metrics or {})},
        objective=objective_options(args),
        dataset_name=dataset_name,
        hub_model_id=trainer.hub_model_id,
        model_path=model_path,
        weights_saved=weights_saved,
        prompt=first_training_prompt(trainer.train_dataset),
        base_model_path=model_id if is_adapter and model_id and os.path.isdir(model_id) else None,
        lora=user_lora_settings(peft_config or unwrapped.peft_config["default"]) if is_adapter else None,
        alarms=health.problem_lines(),
        alarms_off=not settings.enabled,
        report_image="report.png" if report else None,
    )
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(card)
