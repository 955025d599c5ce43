"""The model card (`README.md`) that a training run leaves in its output folder, ready for the Hugging Face Hub.

`build_model_card` writes the text; `write_model_card` (what `GRPOTrainerExt.create_model_card`, Trainer's hook,
does) gathers what it needs from a trainer and also draws `report.png`. The card keeps everything stock TRL's card
has for the same run (its tags and sections, rendered by TRL: `stock.py`) and adds the objective that ran
(`objective.objective_formula`: the loss type's record, `ops.loss_types`, and the options that change it), the
configuration that acted, as the user set it (`fields.py`), the final metrics and the training report.
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

from ..guardrails.anomaly import AlarmSettings
from ..metrics import (
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
from .fields import CARD_CONFIG_FIELDS, card_config, user_lora_settings
from .objective import (
    OBJECTIVE,
    OBJECTIVE_FIELDS,
    format_value,
    objective_formula,
    objective_options,
    resolve_options,
)
from .quick_start import first_training_prompt, is_hub_dataset_id, is_hub_id, quick_start_lines, weights_folder
from .stock import TRL_TAGS, trl_card_sections, trl_card_tags

__all__ = [
    "build_model_card",
    "card_config",
    "final_metrics",
    "objective_formula",
    "objective_options",
    "run_urls",
    "CARD_CONFIG_FIELDS",
    "CARD_METRICS",
    "OBJECTIVE_FIELDS",
    "write_model_card",
]

logger = logging.get_logger(__name__)

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


def final_metrics(log_history: list[dict], keys: tuple[str, ...] = CARD_METRICS) -> dict[str, float]:
    """The last logged value of each training metric in `keys` (rewards are logged only at generating steps)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        if LOSS not in entry:
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


#: Framework versions the card lists besides TRL's (TRL, Transformers, Pytorch, Datasets, Tokenizers): label, package.
EXTRA_FRAMEWORKS = (("trl_grpo_ext", "trl-grpo-ext"), ("PEFT", "peft"), ("Accelerate", "accelerate"))


def _framework_versions(trl_versions: str) -> list[str]:
    """TRL's "Framework versions" list, with this package's version first and PEFT's and accelerate's after."""
    extra = {}
    for label, distribution in EXTRA_FRAMEWORKS:
        try:
            extra[label] = f"- {label}: {version(distribution)}"
        except PackageNotFoundError:
            continue
    first = [extra.pop("trl_grpo_ext")] if "trl_grpo_ext" in extra else []
    return [*first, *[line for line in trl_versions.splitlines() if line.strip()], *extra.values()]


def _trl_sections_tail(trl_sections: dict[str, str]) -> list[str]:
    """TRL's "Training procedure" (the tracked runs' badges, the paper line), "Framework versions" (with this
    package's additions) and "Citations" (GRPO's paper, TRL), with TRL's headings and text."""
    lines = []
    for heading, body in trl_sections.items():
        if heading.lstrip("#").strip() in ("Training procedure", "Citations"):
            lines += [heading, "", body, ""] if body else [heading, ""]
        elif heading.lstrip("#").strip() == "Framework versions":
            lines += [heading, "", *_framework_versions(body), ""]
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
    alarms_off: bool = False,
    model_path: str | None = None,
    weights_saved: bool = True,
    prompt: str | None = None,
    base_model_path: str | None = None,
) -> str:
    """A model card that holds every tag and section of stock TRL's card for the same run, and more.

    Front matter: `library_name`, `base_model` where known, `model_name`, `datasets`, `tags` (TRL's
    `generated_from_trainer`, `trl`, `grpo`, then `trl_grpo_ext`, `lora` for adapters and `tags`, where
    `trl_card_tags` puts the run's `hf_jobs` and `trackio:<url>`), `pipeline_tag`. Sections: TRL's title; what the
    model is; "Quick start"; "Objective"; "Training configuration"; "Final metrics"; "Training report" (the image);
    then TRL's own "Training procedure" (the tracked runs' badges and the paper line), "Framework versions" (TRL's
    list, with this package, PEFT and accelerate added) and "Citations" (GRPO's DeepSeekMath paper and TRL), as
    TRL's `generate_model_card` renders them (`trl_card_sections`).

    Args:
        model_name: title of the card, and `model_name` of its front matter (as TRL writes it).
        base_model: Hub id of the base model, or `None` (a local path is not a Hub id and is left out).
        is_adapter: a PEFT adapter (`library_name: peft`, tag `lora`) rather than a full model.
        config: training configuration fields to list (`card_config(args)`: those that acted in the run).
        metrics: final training metrics (see `final_metrics`).
        extra_metrics: more rows for the metrics table, e.g. held-out accuracy before and after training.
        tags: tags after TRL's and this package's (`trl_card_tags` adds the run's).
        hub_model_id: the Hub repository of the model (a run pushed to the Hub), for the quick start.
        dataset_name: the training set (one name or a list), written to the front matter's `datasets` as TRL writes
            it where it is shaped as a Hub dataset id (`is_hub_dataset_id`), left out there otherwise (a local file
            or folder); named in the text, linked to the Hub when it is an `owner/name` id.
        report_image: relative path of the training report image, or `None`.
        lora: LoRA settings to list (rank, alpha, target modules), as the user set them (`user_lora_settings`).
        objective: the options of the objective that ran (`objective_options(args)`, see `objective_formula`); by
            default the `OBJECTIVE_FIELDS` among `config`'s keys, and `GRPOConfigExt`'s defaults for the others.
        wandb_url, trackio_url, comet_url: links of the Weights & Biases, Trackio and Comet runs (`run_urls()`),
            shown as TRL shows them, in "Training procedure".
        alarms: the alarms raised during training and what else the health verdicts found, one line each
            (`health.assess(...).problem_lines()`), for a "Training health" section; an empty list says that none
            was raised, `None` leaves the section out.
        alarms_off: the run had its alarms off (`warn_on_anomalies=False`): the section says so, and `alarms` holds
            only what the other health checks found.
        model_path: the folder of the weights, for the quick start of a run not pushed (default: `model_name`); an
            absolute path loads from any folder.
        weights_saved: `model_path` holds (or is being written with) the weights; otherwise the quick start says how
            to save them there.
        prompt: a training prompt (a string) for the quick start to generate from; default: a placeholder.
        base_model_path: where the adapter's base model is read from when that is a local folder (said below the
            quick start).
    """
    objective = resolve_options(config if objective is None else objective)
    formula = objective_formula(objective)
    if formula == OBJECTIVE:
        loss = "the DeepSeekMath objective"
    else:
        loss = f"the `{objective['loss_type']}` objective of TRL (below)"
    all_tags = [*TRL_TAGS, "trl_grpo_ext"] + (["lora"] if is_adapter else []) + list(tags or [])
    all_tags = list(dict.fromkeys(all_tags))
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
    # The Hub reads `datasets` as dataset ids; a local file or folder is named in the text only.
    hub_datasets = [name for name in datasets if is_hub_dataset_id(name)]
    if isinstance(dataset_name, str) and hub_datasets:
        hub_datasets = hub_datasets[0]  # one name is written as TRL writes it: a string, not a list
    data = ModelCardData(
        library_name="peft" if is_adapter else "transformers",
        base_model=base_model,
        tags=all_tags,
        datasets=hub_datasets or None,
        licence="license",  # the key (and value) stock TRL's card writes
        model_name=model_name,
        pipeline_tag="text-generation",
    )
    names = [
        f"[{name}](https://huggingface.co/datasets/{name})" if is_hub_id(name) else f"`{name}`" for name in datasets
    ]
    on = f" on the {', '.join(names)} dataset{'s' if len(names) > 1 else ''}" if names else ""
    repo = hub_model_id or model_path or model_name
    what = "a LoRA adapter for" if is_adapter else "a fine-tune of"
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a locally built base model"
    trl_sections = trl_card_sections(
        base_model=base_model,
        model_name=model_name,
        hub_model_id=hub_model_id,
        dataset_name=dataset_name,
        tags=all_tags,
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
    )
    title = next((heading for heading in trl_sections if heading.startswith("# ")), f"# {model_name}")
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        title,
        "",
        f"This model is {what} {base}{on}, trained with GRPO (group relative policy optimisation) by the "
        f"`GRPOTrainerExt` of `trl_grpo_ext`: a TRL `GRPOTrainer` whose loss is {loss}.",
        "",
        *quick_start_lines(repo, is_adapter, prompt, base_model_path, weights_saved or hub_model_id is not None),
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
        if alarms_off:
            lines += ["The alarms were off in this run (`warn_on_anomalies=False`).", ""]
        if alarms_off and not alarms:
            lines += ["The other health checks (non-finite values, gradient norm, counts) found nothing."]
        elif alarms:
            lines += ["Problems found in training (each with the steps concerned and what to change):", ""]
            lines += [f"- {alarm}" for alarm in alarms]
        else:
            lines += [
                "No alarm was raised during training (unscored rewards, truncation, reward spread, KL, clipping, "
                "ratio, entropy, gradient norm, length, held-out metric) and the health checks found nothing."
            ]
    if report_image:
        lines += ["", "## Training report"]
        lines += ["", f"![Training curves: reward, reward spread, KL, clip fraction, ratio, loss]({report_image})"]
    lines += ["", *_trl_sections_tail(trl_sections)]
    return "\n".join(lines)


def write_model_card(
    trainer,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | list[str] | None = None,
    *,
    lora_settings: dict | None = None,
    card_metrics: Mapping[str, float] | None = None,
) -> None:
    """Write `README.md` (a Hub model card) and `report.png` (training curves) into the trainer's `args.output_dir`.

    What `GRPOTrainerExt.create_model_card` does (called by `Trainer.push_to_hub` and at every checkpoint, like TRL's
    own card, which it replaces and keeps whole: `build_model_card`): TRL's tags (`generated_from_trainer`, `trl`,
    `grpo`, `hf_jobs` on Hugging Face Jobs, `trackio:<url>` for an active trackio run) and sections, with this
    package's objective, configuration (the fields that acted, as the user set them), final metrics and report; the
    alarms raised (the rules of `args`' `warn_*` thresholds, replayed over the log history). The quick start loads
    the model from where it is: the output folder when it holds the weights, else the checkpoint being written (the
    card is written at every checkpoint) or the newest checkpoint with weights, else it says how to save them.

    Args:
        trainer (`GRPOTrainer`): the run.
        model_name, dataset_name, tags: as `Trainer.create_model_card` takes them.
        lora_settings (`dict`, *optional*): the LoRA settings as the user gave them (`fields.user_lora_settings` of
            the `peft_config`, read before PEFT expanded it); default: the wrapped model's own.
        card_metrics (`Mapping`, *optional*): extra rows of the metrics table (e.g. held-out accuracy of a recipe).
    """
    if not trainer.is_world_process_zero():
        return
    from peft import PeftModel

    args = trainer.args
    output_dir = args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    model_id = get_config_model_id(trainer.model.config)
    base_model = model_id if model_id and not os.path.isdir(model_id) else None
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    is_adapter = isinstance(unwrapped, PeftModel)
    settings = AlarmSettings.from_config(args)
    health = assess(trainer.state.log_history, settings.monitor(live=True))  # no alarm where the run had none
    name = model_name or os.path.basename(os.path.normpath(output_dir))
    report = None
    try:
        report = plot_training_report(
            trainer.state.log_history,
            os.path.join(output_dir, "report.png"),
            title=name,
            clip_range=(trainer.epsilon_low, trainer.epsilon_high),
            episodes=health.episodes,
            thresholds=settings.thresholds,
            verdict=health.headline(),
        )
    except ImportError:  # the card is written at every checkpoint: said once
        logger.warning_once("matplotlib is not installed: no report.png (pip install matplotlib).")
    lora = lora_settings
    if lora is None and is_adapter:  # a model that came wrapped: its own config
        lora = user_lora_settings(unwrapped.peft_config["default"])
    urls = run_urls()
    tags = [tags] if isinstance(tags, str) else tags
    prompt = first_training_prompt(trainer.train_dataset)
    model_path, weights_saved = weights_folder(trainer, is_adapter)
    card = build_model_card(
        model_name=name,
        base_model=base_model,
        is_adapter=is_adapter,
        config=card_config(args),
        metrics=final_metrics(trainer.state.log_history),
        extra_metrics=card_metrics,
        tags=trl_card_tags(trainer.model.config, tags, urls["trackio_url"]),
        dataset_name=dataset_name,
        hub_model_id=trainer.hub_model_id,
        report_image="report.png" if report else None,
        lora=lora if is_adapter else None,
        objective=objective_options(args),
        alarms=health.problem_lines(),
        alarms_off=not settings.enabled,
        model_path=model_path,
        weights_saved=weights_saved,
        prompt=prompt,
        base_model_path=model_id if is_adapter and model_id and os.path.isdir(model_id) else None,
        **urls,
    )
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(card)
