"""What differs between the TRL and transformers releases this package supports, in one place.

`GRPOTrainerExt` overrides private hooks of TRL's `GRPOTrainer` and of transformers' `Trainer`; the rest of the
package is written against TRL 1.16. Compared in TRL 1.14.0, 1.14.2, 1.15.0 and 1.16.0 (`trl/trainer/grpo_trainer.py`,
`grpo_config.py`, `base_trainer.py`) and unchanged across them: `_compute_loss`, `_calculate_rewards`, `log` (but
for its completions table), `_prepare_inputs` with `_step` and `_buffered_inputs`, `training_step`, `_save_checkpoint`,
the batch keys (`advantages`, `completion_mask`, `old_per_token_logps`, `ref_per_token_logps`, `tool_mask`),
`epsilon_low`, `epsilon_high`, `aux_loss_enabled`, `num_generations_eval`, `reward_weights`, the helpers
`get_callable_name`, `get_config_model_id` and `is_async_callable` of `trl.trainer.utils`, and every `GRPOConfig`
field this package reads. What changed:

- TRL 1.15.0: `GRPOTrainer` sets `loss_is_scaled_for_ga = True` so that `Trainer` does not divide the loss by the
  accumulation steps a second time (TRL's base trainer turns it into 1.14's placeholder `compute_loss_func` for
  transformers < 5.19, which does not read it). `_compute_loss` divides by `current_gradient_accumulation_steps` in
  every version, and so does this package's.
- TRL 1.15.0: `_get_per_token_logps_and_entropies` takes explicit arguments and computes the log-probs through a
  fused LM head; 1.14 forwards `*args, **kwargs` to a full-logits path (a chunked one with `use_liger_kernel`).
  This package calls it with the three inputs positionally and the options by keyword, which every version accepts.
  The 1.15 fused head runs a Triton kernel only, on a CUDA or XPU device; 1.16.0 adds a PyTorch path for the
  others: see `OPTIONS_ADDED`.
- TRL 1.15.0: `GRPOTrainer.__init__` seeds the RNGs before building the model, so LoRA adapters start from the same
  weights in every process; 1.14 draws them from the unseeded RNG: see `seed_before_model_init`.
- TRL 1.15.0: `use_liger_kernel=True` only swaps in Liger's layer kernels; 1.14 also routes `compute_loss` through
  its chunked log-prob path. Both end in `_compute_loss`, which this package overrides.
- TRL 1.16.0: `pad_to_multiple_of` accepts (and defaults to) `"auto"`: see `OPTIONS_ADDED`.

transformers, with any TRL: `Trainer._get_grad_norm`, the hook of the non-finite guard, exists from 5.3.0;
`transformers.trainer_utils.rotate_checkpoints`, used by the crash-safe checkpoints, from 5.2.0; before 5.5.4 `Trainer`
built its `Accelerator` with the accumulation steps, whose `backward` divided the loss by them once more: with
`gradient_accumulation_steps=2` the gradient was half that of the same batch in one step, in stock TRL too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import textwrap
import warnings
from typing import Any

from packaging.version import Version

__all__ = [
    "CALLED_METHODS",
    "FORWARD_KEYS",
    "OVERRIDDEN_HOOKS",
    "TRL_ATTRIBUTES",
    "TRL_VLLM_ATTRIBUTES",
    "VLLM_GENERATION_METHODS",
    "SUPPORTED_TRL",
    "TRL_COPIES",
    "OPTIONS_ADDED",
    "IncompatibleTRLError",
    "check_trl_surface",
    "check_trl_version",
    "check_transformers_version",
    "is_tested_trl",
    "ignore_renamed_checkpointing_warnings",
    "options_missing_from_trl",
    "seed_before_model_init",
    "trl_has_fused_lm_head",
    "trl_surface_differences",
    "trl_surface_summary",
]

#: Extra model inputs that TRL's batches may carry (vision-language models), forwarded untouched to
#: `_get_per_token_logps_and_entropies`: TRL 1.16 writes this list inline in `GRPOTrainer._compute_loss`.
FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

#: Every hook of TRL's `GRPOTrainer` (and transformers' `Trainer`) that `GRPOTrainerExt` overrides, each in
#: `trainer.py` only, with every parameter TRL's hook takes (by name): the override accepts them all, and calls TRL's
#: with them. `tests/test_compat_drift.py` binds them to the installed TRL's signatures, so a release that renames
#: or reshapes one fails a fast test rather than a slow one; `check_trl_surface` does the same where the trainer is
#: built, for any TRL release.
OVERRIDDEN_HOOKS = {
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        *FORWARD_KEYS,
    ),
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "log": ("logs", "start_time"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "_push_from_checkpoint": ("checkpoint_folder",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "evaluate": ("eval_dataset", "ignore_keys", "metric_key_prefix"),
    "create_model_card": ("model_name", "dataset_name", "tags"),
}

#: TRL methods the package calls, with the arguments it passes (by name; pinned like `OVERRIDDEN_HOOKS`, but a new
#: optional parameter of one of these is no change: the package does not pass it).
CALLED_METHODS = {
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "compute_entropy",
        "compute_aux_loss",
        *FORWARD_KEYS,
    ),
    "_remove_unused_columns": ("dataset", "description"),
    "_set_signature_columns_if_needed": (),
    "get_off_policy_mask": (
        "advantages",
        "per_token_logps",
        "sampling_per_token_logps",
        "mask",
        "off_policy_threshold",
    ),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_gamma_weights": (
        "advantages",
        "log_ratio_per_token",
        "mask",
        "importance_sampling_ratio",
        "k_pos",
        "lambda_pos",
        "k_neg",
        "lambda_neg",
    ),
}

#: Attributes of a built `GRPOTrainer` that the package reads (or, for TRL's state, writes): TRL's private state
#: first, then the options TRL resolves in `__init__`. `tests/test_compat_drift.py` checks each on a stock trainer.
TRL_ATTRIBUTES = (
    "_metrics",
    "_logs",
    "_step",
    "_buffered_inputs",
    "_signature_columns",  # transformers' Trainer's: the columns `remove_unused_columns=True` keeps
    "_entropy_bonus_enabled",
    "_entropy_window_stats",
    "_last_world_entropy",
    "epsilon_low",
    "epsilon_high",
    "loss_type",
    "beta",
    "importance_sampling_level",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "num_generations",
    "num_generations_eval",
    "reward_weights",
    "reward_func_names",
    "scale_rewards",
    "multi_objective_aggregation",
    "aux_loss_enabled",
    "entropy_coef",
    "use_adaptive_entropy",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "max_completion_length",
    "shuffle_dataset",
    "pad_to_multiple_of",
    "temperature",
)

#: Attributes a `GRPOTrainer` has only with `use_vllm` (read or, `_last_loaded_step`, written by the held-out
#: evaluation's weight sync): checked on a stock trainer with vLLM by `tests/test_extras_heldout_vllm.py`.
TRL_VLLM_ATTRIBUTES = ("vllm_generation", "_last_loaded_step")

#: Methods of TRL's vLLM backend (`trl.generation.vllm_generation.VLLMGeneration`) the package calls, with the
#: arguments it passes (by name; pinned like `CALLED_METHODS`).
VLLM_GENERATION_METHODS = {
    "generate": ("prompts", "images", "num_generations"),
    "sync_weights": (),
}

#: Every piece of TRL code this package reproduces because TRL offers no hook for it: where it lives here, TRL's
#: file and function, and the test that compares its behaviour with TRL's own (a TRL release that changes the
#: original fails that test).
TRL_COPIES = (
    (
        "trl_grpo_ext._compat.FORWARD_KEYS",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._compute_loss (the keyword arguments of its "
        "_get_per_token_logps_and_entropies call)",
        "tests/test_compat_drift.py::test_the_forwarded_model_inputs_are_trl_s",
    ),
    (
        "trl_grpo_ext.batch.entropy_bonus",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._compute_loss (entropy bonus and adaptive entropy controller)",
        "tests/test_compat_drift.py::test_the_entropy_bonus_is_trl_s",
    ),
    (
        "trl_grpo_ext.batch._denominator",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._compute_loss (the normalizer of dr_grpo, dapo, cispo, vespo)",
        "tests/test_trainer_loss_types.py (every loss type against stock GRPOTrainer)",
    ),
    (
        "trl_grpo_ext.extras.vllm.correction.sampler_log_ratios",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (vLLM importance-sampling bounds)",
        "tests/test_compat_drift.py::test_the_sampler_mismatch_bounds_are_trl_s",
    ),
    (
        "trl_grpo_ext.extras.vllm.correction.correction_ratio",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (the importance-sampling weights of "
        "each vllm_importance_sampling_mode: truncated or masked at the bounds)",
        "tests/test_extras_vllm_truncation_match.py::test_the_correction_weights_and_their_metrics_are_trl_s",
    ),
    (
        "trl_grpo_ext.extras.vllm.correction.correction_metrics",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (the logged "
        "sampling/sampling_logp_difference/* and sampling/importance_sampling_ratio/*)",
        "tests/test_extras_vllm_truncation_match.py::test_the_correction_weights_and_their_metrics_are_trl_s",
    ),
    (
        "trl_grpo_ext.extras.vllm.truncation_match.trl_logit_transform",
        "trl/trainer/utils.py: add_fused_lm_head (the backbone it runs, the logit scale and soft cap it reads)",
        "tests/test_extras_vllm_truncation_match.py::test_the_trainer_pass_gives_trl_s_log_probs_with_scaled_and_capped_logits",
    ),
    (
        "trl_grpo_ext.extras.heldout.sync_vllm_weights",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_single_turn (the weight sync when global_step differs "
        "from _last_loaded_step)",
        "tests/test_extras_heldout_vllm.py::test_the_weight_sync_check_is_trl_s",
    ),
    (
        "trl_grpo_ext.extras.plan.trl_advantages",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (advantages from the gathered "
        "rewards: group, batch or no scaling, sum_then_normalize or normalize_then_sum)",
        "tests/test_extras_plan.py::test_advantages_and_reward_metrics_of_a_batch_are_trl_s",
    ),
    (
        "trl_grpo_ext.extras.plan.trl_reward_metrics",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (reward, reward_std, "
        "frac_reward_zero_std, rewards/<name>/mean and std)",
        "tests/test_extras_plan.py::test_advantages_and_reward_metrics_of_a_batch_are_trl_s",
    ),
    (
        "trl_grpo_ext.extras.generation.sample_batch",
        "trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions (tokenise prompts, generate with "
        "the training sampling settings, decode)",
        "tests/test_extras_generation.py::test_extras_settings_build_the_generation_config_trl_trains_with",
    ),
    (
        "trl_grpo_ext.tools.recipes.slurm.vllm_server_command",
        "trl/scripts/vllm_serve.py: build_command (the `vllm serve` command line that TRL's deprecated "
        "`trl vllm-serve` runs, with the arguments TRL's trainers rely on)",
        "tests/test_tools_recipes_slurm_server.py::test_the_command_is_the_one_trl_s_wrapper_composes",
    ),
)

#: 1.14.x, 1.15.x and 1.16.x, each tested with its oldest dependencies by `make test-compat` (with 1.15, whose
#: log-prob kernel needs a CUDA or XPU device, the CPU test machines run the version checks only).
SUPPORTED_TRL = (Version("1.14.0"), Version("1.17.0"))  # [lower, upper)
#: Before 1.0, `GRPOTrainer` computed its loss in a hook with another signature; nothing here would work.
BREAKING_BELOW = Version("1.0.0")

#: The oldest transformers this package works with, whatever the TRL version.
TRANSFORMERS_FLOOR = Version("5.5.4")
_TRANSFORMERS_FLOOR_REASON = (
    "before transformers 5.5.4 `Trainer` lets accelerate divide the loss by the gradient accumulation steps after "
    "TRL has already done it, and GRPOTrainerExt's non-finite guard needs `Trainer._get_grad_norm` (5.3)"
)


def _pad_to_multiple_of_auto(args: Any) -> str | None:
    return "pad_to_multiple_of='auto'" if getattr(args, "pad_to_multiple_of", None) == "auto" else None


def _fused_lm_head_unavailable(args: Any) -> str | None:
    device_type = getattr(getattr(args, "device", None), "type", "cpu")
    if device_type not in ("cuda", "xpu"):
        return f"Training on a {device_type} device"
    if importlib.util.find_spec("triton") is None:
        return "Training without the triton package"
    return None


#: What a TRL release may lack: (what `args` asks for, or None; the releases that lack it, [from, to); why).
OPTIONS_ADDED = (
    (_pad_to_multiple_of_auto, Version("0"), Version("1.16.0"), "earlier releases take an int or None"),
    (
        _fused_lm_head_unavailable,
        Version("1.15.0"),
        Version("1.16.0"),
        "trl 1.15 computes log-probs with a Triton kernel on CUDA and XPU devices only (trl 1.14 and 1.16 also have a "
        "PyTorch path)",
    ),
)

#: The first TRL release whose log-prob forward runs through a fused LM head (`add_fused_lm_head`), which the
#: padding-free forward (`forward.logprobs`) calls with packed rows.
_FUSED_LM_HEAD_SINCE = Version("1.15.0")


def trl_has_fused_lm_head(trl_version: str | None = None) -> bool:
    """Whether the installed TRL (or `trl_version`) computes log-probs through its fused LM head."""
    return Version(trl_version or _installed_trl()) >= _FUSED_LM_HEAD_SINCE


#: The first TRL release whose `GRPOTrainer.__init__` seeds the RNGs before building the model.
_SEEDS_BEFORE_MODEL_INIT = Version("1.15.0")


def _installed_trl() -> str:
    import trl

    return trl.__version__


def _tested_range() -> str:
    return f">={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}"


def is_tested_trl(version: str) -> bool:
    """Whether TRL `version` lies in the range the test suite runs against (`SUPPORTED_TRL`)."""
    return SUPPORTED_TRL[0] <= Version(version) < SUPPORTED_TRL[1]


def check_trl_version(version: str) -> None:
    """Refuse, at import, a TRL release whose `GRPOTrainer` has another loss hook altogether (before 1.0).

    Any other release imports; whether the private surface the package relies on matches it is checked when the
    trainer is built (`check_trl_surface`), which warns for a release outside the tested range.

    Args:
        version (`str`): the installed TRL version, e.g. `trl.__version__`.

    Raises:
        ImportError: for TRL below 1.0.
    """
    if Version(version) < BREAKING_BELOW:
        raise ImportError(
            f"trl_grpo_ext needs trl{_tested_range()}; trl {version} is installed, whose GRPOTrainer has a different "
            f"loss hook. Install a supported version: pip install 'trl{_tested_range()}'."
        )


def ignore_renamed_checkpointing_warnings() -> None:
    """Silence the deprecation warnings of the model's gradient-checkpointing methods, which transformers 5.23 renamed.

    TRL and PEFT call the old names themselves (`is_gradient_checkpointing` at every generation,
    `gradient_checkpointing_enable` / `_disable` around it): warnings about nothing that a user of the trainer wrote
    or can change. (The config field's rename still warns: that name is the user's.)
    """
    warnings.filterwarnings(
        "ignore",
        message="`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` "
        "is deprecated",
        category=FutureWarning,
    )


def check_transformers_version(version: str) -> None:
    """Refuse a transformers release older than `TRANSFORMERS_FLOOR`.

    Args:
        version (`str`): the installed transformers version, e.g. `transformers.__version__`.

    Raises:
        ImportError: naming the transformers version needed and why.
    """
    if Version(version) < TRANSFORMERS_FLOOR:
        raise ImportError(
            f"trl_grpo_ext needs transformers>={TRANSFORMERS_FLOOR}; transformers {version} is installed. Why: "
            f"{_TRANSFORMERS_FLOOR_REASON}. Install it with: pip install 'transformers>={TRANSFORMERS_FLOOR}'."
        )


def options_missing_from_trl(args: Any, trl_version: str | None = None) -> list[str]:
    """What `args` asks for that the installed TRL does not implement, each naming the TRL release that does.

    Args:
        args (`trl.GRPOConfig`): the training configuration (`pad_to_multiple_of` and `device` are read).
        trl_version (`str`, *optional*): the TRL version to check against; the installed one by default.

    Returns:
        `list[str]`: one message per missing option; empty when the installed TRL implements them all.
    """
    found = Version(trl_version or _installed_trl())
    problems = []
    for asks_for, lacking_from, added_in, why in OPTIONS_ADDED:
        if lacking_from <= found < added_in:
            option = asks_for(args)
            if option is not None:
                problems.append(f"{option} needs trl>={added_in} (trl {found} is installed): {why}.")
    return problems


def seed_before_model_init(args: Any, trl_version: str | None = None) -> None:
    """Seed the RNGs with `args.seed` where the installed TRL does not do it before building the model.

    From TRL 1.15 `GRPOTrainer.__init__` seeds before it creates the model and its PEFT adapters; before, LoRA weights
    started from whatever the global RNG held, so two runs with the same seed (a run and its resumption, two
    processes) trained different adapters. Called first in `GRPOTrainerExt.__init__`, it gives TRL 1.14 the same
    start as TRL 1.15.

    Args:
        args (`trl.GRPOConfig`): the training configuration; its `seed` is used.
        trl_version (`str`, *optional*): the TRL version to act for; the installed one by default.
    """
    if Version(trl_version or _installed_trl()) < _SEEDS_BEFORE_MODEL_INIT:
        from accelerate.utils import set_seed

        set_seed(args.seed)


class IncompatibleTRLError(RuntimeError):
    """The installed TRL's private surface differs from what `GRPOTrainerExt` overrides, calls or reads."""


def _signature_difference(owner: type, name: str, arguments: tuple[str, ...], overridden: bool) -> str | None:
    """What differs between `owner.name` and the `arguments` the package passes to it (and, for an `overridden`
    hook, accepts from TRL's callers), or `None` when nothing does."""
    function = inspect.getattr_static(owner, name, None)
    if function is None:
        return f"{owner.__name__}.{name} is gone"
    bound = () if isinstance(function, staticmethod) else (None,)  # `self`
    try:
        signature = inspect.signature(getattr(function, "__func__", function))
    except (TypeError, ValueError):  # a builtin or a wrapper without a signature: nothing to compare
        return None
    parameters = list(signature.parameters.values())[len(bound) :]
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    where = f"{owner.__name__}.{name}{signature}"
    removed = [argument for argument in arguments if argument not in named]
    if removed and not any(p.kind == p.VAR_KEYWORD for p in parameters):
        return f"{where} no longer takes {', '.join(map(repr, removed))}, which GRPOTrainerExt passes"
    added = [parameter for parameter in named if parameter not in arguments]
    required = [p.name for p in parameters if p.name in added and p.default is p.empty]
    if required:
        return f"{where} now requires {', '.join(map(repr, required))}, which GRPOTrainerExt does not pass"
    try:
        signature.bind(*bound, **dict.fromkeys(arguments))
    except TypeError as error:  # e.g. a parameter that became positional-only
        return f"{where} does not take the arguments GRPOTrainerExt passes ({', '.join(arguments)}): {error}"
    if overridden and added:
        return f"{where} takes {', '.join(map(repr, added))}, which GRPOTrainerExt's override does not know"
    return None


@functools.lru_cache(maxsize=8)
def _assigned_attributes(cls: type) -> frozenset[str] | None:
    """Every `self.<name>` that the source of `cls` or of a class it derives from assigns (`=`, `+=`, annotated, in a
    tuple), or `None` when a source cannot be read (an installation without `.py` files). Read once per class: about
    a second for TRL's trainer and transformers' `Trainer` together on a CPU core."""
    names = set()
    for base in cls.__mro__[:-1]:  # without `object`
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            return None
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else targets
            for target in targets:
                for part in ast.walk(target):
                    if (
                        isinstance(part, ast.Attribute)
                        and isinstance(part.value, ast.Name)
                        and part.value.id == "self"
                    ):
                        names.add(part.attr)
    return frozenset(names)


def trl_surface_differences(trainer_class: type | None = None, *, use_vllm: bool = False) -> tuple[list[str], int]:
    """Every difference between the private surface of TRL that the package relies on and the installed TRL.

    Compared, without building anything: the parameters of every hook `GRPOTrainerExt` overrides
    (`OVERRIDDEN_HOOKS`: TRL's must take each of them, and no other), the parameters of every TRL method it calls
    (`CALLED_METHODS`; with `use_vllm`, `VLLM_GENERATION_METHODS`), and the private attributes it reads
    (`TRL_ATTRIBUTES`, `TRL_VLLM_ATTRIBUTES`), which the source of TRL's trainer (or of a class it derives from) must
    assign.

    Args:
        trainer_class (`type`, *optional*): the class to compare, `trl.GRPOTrainer` by default (a test passes one
            with a changed hook, as a newer TRL would have it).
        use_vllm (`bool`): also compare TRL's vLLM backend (imported only then: it imports vLLM).

    Returns:
        `(differences, compared)`: one sentence per difference, naming the hook, method or attribute and what
        changed; and how many names were compared.
    """
    if trainer_class is None:
        from trl import GRPOTrainer as trainer_class
    differences, compared = [], 0
    for names, overridden in ((OVERRIDDEN_HOOKS, True), (CALLED_METHODS, False)):
        for name, arguments in names.items():
            compared += 1
            difference = _signature_difference(trainer_class, name, arguments, overridden)
            differences += [difference] if difference else []
    if use_vllm:
        try:
            from trl.generation.vllm_generation import VLLMGeneration
        except ImportError as error:  # moved or gone: the methods below cannot be called either
            compared += len(VLLM_GENERATION_METHODS)
            differences.append(f"trl.generation.vllm_generation.VLLMGeneration does not import ({error})")
        else:
            for name, arguments in VLLM_GENERATION_METHODS.items():
                compared += 1
                difference = _signature_difference(VLLMGeneration, name, arguments, overridden=False)
                differences += [difference] if difference else []
    assigned = _assigned_attributes(trainer_class)
    if assigned is not None:
        for name in (*TRL_ATTRIBUTES, *TRL_VLLM_ATTRIBUTES):
            compared += 1
            if name not in assigned:
                differences.append(
                    f"{trainer_class.__name__} no longer sets the attribute {name!r}, which GRPOTrainerExt reads"
                )
    return differences, compared


def trl_surface_summary(trl_version: str | None = None, trainer_class: type | None = None) -> str:
    """One line on the installed TRL: whether it is a tested release, and whether the private surface the package
    relies on matches it (`trl_surface_differences`); what `trl-grpo-ext env` prints."""
    version = trl_version or _installed_trl()
    differences, compared = trl_surface_differences(trainer_class)
    tested = "tested" if is_tested_trl(version) else f"untested (tested: trl{_tested_range()})"
    if differences:
        return f"trl {version}, {tested}: {len(differences)} of {compared} differ: " + "; ".join(differences)
    return f"trl {version}, {tested}: the {compared} hooks, methods and attributes GRPOTrainerExt relies on match"


def check_trl_surface(args: Any = None, trl_version: str | None = None, trainer_class: type | None = None) -> None:
    """Compare the private surface of the installed TRL with the pins, before any model loads: raise when one
    differs; warn, naming the release, when all match a TRL release outside the tested range.

    Args:
        args (`trl.GRPOConfig`, *optional*): the configuration (`use_vllm` is read).
        trl_version (`str`, *optional*): the TRL version to name; the installed one by default.
        trainer_class (`type`, *optional*): the class to compare, `trl.GRPOTrainer` by default.

    Raises:
        IncompatibleTRLError: naming each hook, method or attribute that differs and what changed.
    """
    version = trl_version or _installed_trl()
    differences, compared = trl_surface_differences(trainer_class, use_vllm=bool(getattr(args, "use_vllm", False)))
    if differences:
        raise IncompatibleTRLError(
            f"trl {version} differs from what GRPOTrainerExt overrides, calls or reads: "
            + "; ".join(differences)
            + f". Install a tested release: pip install 'trl{_tested_range()}'."
        )
    if not is_tested_trl(version):
        warnings.warn(
            f"trl {version} is untested (tested: trl{_tested_range()}); the {compared} TRL hooks, methods and "
            "attributes GRPOTrainerExt overrides, calls or reads match it. What they compute is not checked: run "
            "this package's tests against it, or install a tested release.",
            UserWarning,
            stacklevel=3,
        )
