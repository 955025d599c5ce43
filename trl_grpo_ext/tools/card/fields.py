"""The training configuration of the model card: the fields that acted in the run, with the values the user set.

A field whose value changed nothing is left out (`num_train_epochs` when `max_steps > 0` decides the length of the
run, `epsilon` for a loss type that does not clip with it, ...), and LoRA's target modules are shown as the user
wrote them (`all-linear`), not as PEFT expands them into module paths when it wraps the model: PEFT writes the
expansion back into the `LoraConfig` it was given, so `user_lora_settings` reads it before the trainer builds the
model.
"""

from __future__ import annotations

import copy

from ...ops.loss_types import loss_type_record

__all__ = ["CARD_CONFIG_FIELDS", "card_config", "inactive_fields", "user_lora_settings"]

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
    """The fields of `CARD_CONFIG_FIELDS` whose value did not act in a run with `args` (a `trl.GRPOConfig`):

    - `num_train_epochs` when `max_steps > 0` (Trainer then stops at `max_steps`), else `max_steps`;
    - `epsilon` and `epsilon_high` where the loss type does not use them (the loss type's `clip_fields`);
    - `scale_rewards` with `multi_objective_aggregation="normalize_then_sum"`, which normalises each reward over
      its group and the sum over the batch whatever `scale_rewards` says.
    """
    inactive = {"num_train_epochs"} if getattr(args, "max_steps", -1) > 0 else {"max_steps"}
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None:
        used = loss_type_record(loss_type).clip_fields
        inactive |= {name for name in ("epsilon", "epsilon_high") if name not in used}
    if getattr(args, "multi_objective_aggregation", None) == "normalize_then_sum":
        inactive.add("scale_rewards")
    return inactive


def card_config(args, fields: tuple[str, ...] = CARD_CONFIG_FIELDS) -> dict:
    """The `fields` of `args` that acted in the run (`inactive_fields`), in order; `None` values are left to the
    card (not set: not shown).

    An unset `epsilon_high` is shown as the value TRL trains with (`epsilon`) where the loss type uses
    `epsilon_high` but not `epsilon` (CISPO's cap), so that the bound that acted is on the card.
    """
    skipped = inactive_fields(args)
    config = {key: getattr(args, key, None) for key in fields if key not in skipped}
    if "epsilon_high" in config and config["epsilon_high"] is None and "epsilon" in skipped:
        config["epsilon_high"] = getattr(args, "epsilon", None)  # TRL: epsilon_high = epsilon_high or epsilon
    return config


def user_lora_settings(peft_config) -> dict | None:
    """The LoRA settings the card lists (`r`, `alpha`, `target_modules`), as the user set them in `peft_config`.

    Call it before the model is wrapped: `get_peft_model` replaces `target_modules="all-linear"` in the config
    object it is given by the set of module paths it matched. A list of names is shown sorted (`LoraConfig` keeps it
    as a set). `None` for no `peft_config`.
    """
    if peft_config is None:
        return None
    targets = copy.copy(getattr(peft_config, "target_modules", None))
    return {
        "r": getattr(peft_config, "r", None),
        "alpha": getattr(peft_config, "lora_alpha", None),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
    }
