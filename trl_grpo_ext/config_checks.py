"""The checks of a configuration: every reason why its options cannot train, one sentence each.

`config.config_problems` runs them on a `GRPOConfigExt` (from its `__post_init__`) or on a plain `trl.GRPOConfig`
(from `GRPOTrainerExt.__init__`); it hands them the configuration with every field of `GRPOConfigExt` (a plain one
read through `config.option`), so that nothing here needs the fields' defaults and `config` may import this module.
A leaf like `config`: it reads the values it checks against from the records (`choices`, the alarms, the loss
types of `ops`) and the ops layer.
"""

from __future__ import annotations

import math
import numbers

from .choices import CONSOLE_MODES, NONFINITE_POLICIES
from .guardrails.alarms import threshold_problems
from .ops import hyperparameter_problems
from .ops.fused import domain_problems
from .ops.loss_types import loss_type_record
from .ops.validation import implementation_problem, kernel_refusal

__all__ = [
    "fused_kernel_problems",
    "generation_batch_problem",
    "list_problem",
    "option_problems",
    "reward_weights_problem",
]

#: An example value of each list field, for the sentence that refuses another kind of value.
_LIST_EXAMPLES = {"ratio_quantiles": "[0.05, 0.5, 0.95]", "heldout_pass_at": "[1, 4]", "reward_weights": "[1.0, 0.5]"}


def list_problem(name: str, value, kind: str) -> str | None:
    """The sentence that refuses the value of a list field (`_LIST_EXAMPLES`) that is not a list of `kind`
    ("numbers", "whole numbers"), `None` when it is one."""
    numbers = isinstance(value, (list, tuple)) and all(
        isinstance(item, (int, float)) and not isinstance(item, bool) for item in value
    )
    if numbers and (kind == "numbers" or all(float(item).is_integer() for item in value)):
        return None
    return f"`{name}` must be a list of {kind} (e.g. {_LIST_EXAMPLES[name]}), got {value!r}."


def _at_least(options, name: str, minimum: int) -> str | None:
    """The sentence that refuses the value of an integer field (`None` allowed) that is not an integer, or is below
    `minimum`; `None` when it is fine. A bool is refused although Python counts it as an int: `True` would be taken
    for 1 silently."""
    value = getattr(options, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"`{name}` must be an integer >= {minimum}, got {value!r} (a {type(value).__name__})."
    return f"`{name}` must be >= {minimum}, got {value}." if value < minimum else None


def _token_weights_in_use(args) -> bool:
    """Whether TRL multiplies the policy term by per-token weights under these options."""
    vllm_correction = args.use_vllm and args.vllm_importance_sampling_correction and args.loss_type != "vespo"
    return args.top_entropy_quantile < 1.0 or args.off_policy_mask_threshold is not None or vllm_correction


def fused_kernel_problems(args) -> list[str]:
    """Why the fused kernel cannot compute the objective `args` configures, one reason each (empty: it can). Reads
    TRL's fields only: `args` may be a plain `trl.GRPOConfig`."""
    return domain_problems(args, _token_weights_in_use(args))


def option_problems(options, *, only_after_trl: bool = False) -> list[str]:
    """Every reason why the configuration `options` cannot train, one sentence each (empty: none).

    Args:
        options: a configuration with every field of `GRPOConfigExt` (what `config.config_problems` hands on).
        only_after_trl (`bool`): only the checks that need the fields `trl.GRPOConfig.__post_init__` resolves
            (the loss kernel's domain); without it, every other check.
    """
    if only_after_trl:
        implementation = options.loss_implementation
        outside = fused_kernel_problems(options) if implementation in ("fused", "compiled") else []
        return [kernel_refusal(implementation, outside, "loss_implementation")] if outside else []
    problems = []
    try:
        loss_type_record(options.loss_type)  # before any model loads: the trainer looks its record up
    except ValueError as error:
        problems.append(str(error))
    quantiles = options.ratio_quantiles
    wrong_kind = list_problem("ratio_quantiles", quantiles, "numbers")
    if wrong_kind is not None:
        problems.append(wrong_kind)
    elif any(not 0.0 <= q <= 1.0 for q in quantiles):
        problems.append(f"`ratio_quantiles` must lie in [0, 1], got {[q for q in quantiles if not 0.0 <= q <= 1.0]}.")
    implementation = implementation_problem(options.loss_implementation, "loss_implementation")
    if implementation is not None:
        problems.append(implementation)
    for name, choices in (
        ("nonfinite_policy", NONFINITE_POLICIES),
        ("console", CONSOLE_MODES),
    ):
        if getattr(options, name) not in choices:
            problems.append(f"`{name}` must be one of {choices}, got {getattr(options, name)!r}.")
    margin = options.dynamic_sampling_round_margin
    if not margin > 0:
        problems.append(f"`dynamic_sampling_round_margin` must be > 0, got {margin}.")
    problems += _selective_rollouts_problems(options)
    problems += [
        problem
        for problem in (
            _at_least(options, "padding_free_row_tokens", 1),
            _at_least(options, "dynamic_sampling_max_rounds", 1),
            _at_least(options, "selective_rollouts_history", 1),
            _at_least(options, "max_nonfinite_skips", 0),
            _at_least(options, "warn_patience", 1),
            _at_least(options, "heldout_every_steps", 0),
            _at_least(options, "heldout_num_generations", 1),
            _at_least(options, "heldout_batch_size", 1),
        )
        if problem is not None
    ]
    problems += threshold_problems(options.alarm_thresholds)
    pass_at = options.heldout_pass_at
    wrong_kind = None if pass_at is None else list_problem("heldout_pass_at", pass_at, "whole numbers")
    if wrong_kind is not None:
        problems.append(wrong_kind)
    elif pass_at is not None and (not pass_at or min(pass_at) < 1):  # k <= heldout_num_generations: the trainer's
        problems.append(f"`heldout_pass_at` must list values >= 1, got {pass_at}.")
    weights = options.reward_weights
    wrong_kind = None if weights is None else list_problem("reward_weights", weights, "numbers")
    if wrong_kind is not None:
        problems.append(wrong_kind)
    problems += hyperparameter_problems(options.epsilon, options.epsilon_high, options.beta, options.delta)
    return problems


def reward_weights_problem(weights, reward_func_names: list[str]) -> str | None:
    """The sentence that refuses `reward_weights` whose count is not that of the reward functions, `None` when it is
    (or when no weights are given: each function then weighs 1).

    TRL checks the count only once the model is loaded; a recipe knows its reward functions before.

    Args:
        weights (`list[float]` or `None`): the configuration's `reward_weights` (a list: `option_problems` refuses
            any other kind).
        reward_func_names (`list[str]`): the reward functions, by the names the configuration gives them.
    """
    if weights is None or len(weights) == len(reward_func_names):
        return None
    functions = f"{len(reward_func_names)} reward function{'s' if len(reward_func_names) != 1 else ''}"
    return (
        f"`reward_weights` has {len(weights)} weight{'s' if len(weights) != 1 else ''} ({list(weights)}) for "
        f"{functions} ({list(reward_func_names)}): give one weight per reward function, in the order of "
        "`reward_funcs`, or leave reward_weights out (each function weighs 1)."
    )


def _selective_rollouts_problems(options) -> list[str]:
    problems = []
    spread = options.selective_rollouts_target_zero_spread
    if not 0.0 <= spread <= 1.0:
        problems.append(f"`selective_rollouts_target_zero_spread` must lie in [0, 1], got {spread}.")
    schedule = options.selective_rollouts_exploration_schedule
    if (
        not isinstance(schedule, (list, tuple))
        or len(schedule) != 3
        or not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in schedule)
    ):
        return problems + [
            f"`selective_rollouts_exploration_schedule` must be three numbers [min, max, step], got {schedule!r}."
        ]
    low, high, step = schedule
    initial = options.selective_rollouts_exploration
    if not 0.0 <= low <= high <= 1.0:
        problems.append(
            f"`selective_rollouts_exploration_schedule`'s bounds must satisfy 0 <= min <= max <= 1, got [{low}, "
            f"{high}]."
        )
    elif not low <= initial <= high:
        problems.append(
            f"`selective_rollouts_exploration` must lie in selective_rollouts_exploration_schedule's [min, max] = "
            f"[{low}, {high}], got {initial}."
        )
    if not step >= 0:
        problems.append(f"`selective_rollouts_exploration_schedule`'s step must be >= 0, got {step}.")
    return problems


def generation_batch_problem(options, generation_batch_size_set: bool) -> str | None:
    """The sentence that refuses a generation batch that does not hold whole groups of `num_generations` completions,
    naming the field the user set and a value that works; `None` when it holds whole groups.

    TRL refuses such a batch in `GRPOConfig.__post_init__` by its derived value alone (`generation_batch_size (3) must
    be divisible by num_generations (8)`), a field most configurations never set. Read after TRL resolved the batch:
    `generation_batch_size`, `steps_per_generation` and `world_size` hold their final values.

    Args:
        options: the configuration, after `trl.GRPOConfig.__post_init__` computed its generation batch.
        generation_batch_size_set (`bool`): whether the user gave `generation_batch_size` (else TRL derived it from
            `per_device_train_batch_size`).
    """
    batch, group = options.generation_batch_size, options.num_generations
    if batch is None or not group or batch % group == 0:
        return None
    if generation_batch_size_set:
        below, above = batch // group * group, (batch // group + 1) * group
        values = " or ".join(str(value) for value in (below, above) if value > 0)
        return (
            f"`generation_batch_size` ({batch}) must be a multiple of `num_generations` ({group}): each prompt's "
            f"{group} completions are generated in one batch. Set it to {values}."
        )
    per_device, processes, steps = (
        options.per_device_train_batch_size,
        options.world_size,
        options.steps_per_generation,
    )
    # per_device * processes * steps must be a multiple of `group`: per_device a multiple of this
    multiple = group // math.gcd(group, processes * steps)
    suggestion = -(-per_device // multiple) * multiple
    divisors = [value for value in range(2, batch + 1) if batch % value == 0]
    nearest = max((value for value in divisors if value <= group), default=min(divisors, default=None))
    alternative = f", or `num_generations` to a divisor of {batch} (e.g. {nearest})" if nearest else ""
    processes_text = f"{processes} process{'es' if processes > 1 else ''}"
    return (
        f"`per_device_train_batch_size` ({per_device}) must give whole groups of `num_generations` ({group}) "
        f"completions: the generation batch (per_device_train_batch_size {per_device} x {processes_text} x "
        f"steps_per_generation {steps} = {batch}) is not a multiple of {group}. Set per_device_train_batch_size to a "
        f"multiple of {multiple} (e.g. {suggestion}){alternative}."
    )
