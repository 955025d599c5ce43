"""The model card's configuration table: the fields that acted in the run, and LoRA's as the user set them."""

from __future__ import annotations

import copy

from ...ops.loss_types import loss_type_record

#: The configuration fields the card lists (those that acted in the run, see `inactive_fields`).
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


def inactive_fields(args) -> set[str]:
    """The fields of `CARD_CONFIG_FIELDS` that did not act in a run with `args`: `num_train_epochs` when
    `max_steps > 0` (else `max_steps`), `epsilon`/`epsilon_high` where the loss type does not clip with them,
    `scale_rewards` under `multi_objective_aggregation="normalize_then_sum"`."""
    inactive = {"num_train_epochs"} if getattr(args, "max_steps", -1) > 0 else {"max_steps"}
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None:
        used = loss_type_record(loss_type).clip_fields
        inactive |= {name for name in ("epsilon", "epsilon_high") if name not in used}
    if getattr(args, "multi_objective_aggregation", None) == "normalize_then_sum":
        inactive.add("scale_rewards")
    return inactive


def card_config(args, fields: tuple[str, ...] = CARD_CONFIG_FIELDS) -> dict:
    """The `fields` of `args` that acted in the run, in order; an unset `epsilon_high` as the `epsilon` TRL trains
    with where the loss type uses `epsilon_high` only (CISPO's cap)."""
    skipped = inactive_fields(args)
    config = {key: getattr(args, key, None) for key in fields if key not in skipped}
    if "epsilon_high" in config and config["epsilon_high"] is None and "epsilon" in skipped:
        config["epsilon_high"] = getattr(args, "epsilon", None)  # TRL: epsilon_high = epsilon_high or epsilon
    return config


def user_lora_settings(peft_config) -> dict | None:
    """The LoRA settings the card lists (`r`, `alpha`, `target_modules`, a set of names sorted) of `peft_config` as
    given, before PEFT wrapped the model (it writes the modules `"all-linear"` matched into it); `None` without."""
    if peft_config is None:
        return None
    targets = copy.copy(getattr(peft_config, "target_modules", None))
    return {
        "r": getattr(peft_config, "r", None),
        "alpha": getattr(peft_config, "lora_alpha", None),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
    }
