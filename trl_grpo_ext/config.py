"""`GRPOConfigExt`: TRL's `GRPOConfig` with the defaults of DeepSeekMath's GRPO objective; `option`, the value of
one of its fields for any configuration; `config_problems`, the one validation of a configuration.

A leaf of the package: it imports the records its fields take their values from (`ops`, `choices`, the alarms of
`guardrails.alarms`) and its checks (`config_checks`, which import the same and nothing of `config`), no feature
module, so that every feature module may import `option` from here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import transformers
from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig

from .choices import CONSOLE_MODES, NONFINITE_POLICIES
from .config_checks import fused_kernel_problems, generation_batch_problem, list_problem, option_problems
from .guardrails.alarms import DEFAULTS, RENAMED
from .ops import IMPLEMENTATIONS
from .ops.validation import raise_problems

#: transformers >= 5.23 names activation checkpointing `activation_checkpointing` (`gradient_checkpointing` is its
#: deprecated alias); older releases know only `gradient_checkpointing`.
_HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__

__all__ = [
    "TRL_BEHAVIOUR",
    "GRPOConfigExt",
    "config_problems",
    "fused_kernel_problems",
    "option",
    "removed_field_problem",
]


@dataclass
class GRPOConfigExt(GRPOConfig):
    """Configuration for [`GRPOTrainerExt`]: a [`trl.GRPOConfig`] whose defaults give DeepSeekMath's GRPO objective.

    Defaults that differ from TRL 1.16:

    - `beta=0.04` (TRL: 0.0): the KL penalty to the reference model is on, as in the DeepSeekMath paper.
    - `loss_type="grpo"` (TRL: "dapo"): per-sequence length normalisation, DeepSeekMath's objective (every other TRL
      loss type is honoured as TRL computes it).
    - `use_bias_correction_kl=False` (TRL: True): the KL estimator is `exp(d) - d - 1`, not multiplied by the
      importance ratio.
    - `bf16=None` resolves to `True` only where a bf16-capable GPU is in use (TRL: always `True`, which fails on a
      CPU-only machine).

    Every other field is TRL's; see [`trl.GRPOConfig`].
    """

    def __new__(cls, *args, **kwargs):
        # A removed field is refused naming what replaced it, where the dataclass would only call it unexpected.
        problems = [problem for name, value in kwargs.items() if (problem := removed_field_problem(name, value))]
        if problems:
            raise ValueError(" ".join(problems))
        return super().__new__(cls)

    beta: float = field(
        default=0.04,
        metadata={
            "help": "KL coefficient of the penalty `beta * (exp(d) - d - 1)`, d = ref_logp - logp. DeepSeekMath's "
            "GRPO uses 0.04. 0.0 switches the penalty off and no reference model is loaded."
        },
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "Clipping width: ratios are clipped to [1 - epsilon, 1 + epsilon_high]. Must be > 0."},
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "Loss aggregation. 'grpo' (average the tokens of each completion, then the completions) is "
            "DeepSeekMath's GRPO objective; 'dapo', 'dr_grpo', 'bnpo', 'cispo', 'sapo', 'luspo' and 'vespo' are "
            "computed as TRL computes them (trl_grpo_ext.ops.policy_objective); a loss type of one's own: "
            "trl_grpo_ext.ops.register_loss_type."
        },
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio (TRL's default). Not part of DeepSeekMath's "
            "objective, whose KL estimator is exp(d) - d - 1; honoured as TRL does when True."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Use bf16 mixed precision. When unset: True where a bf16-capable GPU is used (and fp16 is off), "
            "False on a CPU."
        },
    )
    # transformers renamed `gradient_checkpointing` to `activation_checkpointing`, and warns at every use of the old
    # name; TRL still gives the old name its default (True), so that every TRL config warned. Here the old name has no
    # default and `activation_checkpointing` (a field of this class where transformers lacks it) is the one to use.
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (transformers' name before 5.23)."},
    )
    if not _HAS_ACTIVATION_CHECKPOINTING:
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": "Recompute activations in the backward pass to save memory (a step takes about a fifth "
                "longer). Default: True, as in TRL (gradient_checkpointing, the name before transformers 5.23)."
            },
        )
    console: str = field(
        default="compact",
        metadata={
            "help": "What the console shows per log step: 'compact' (a progress bar, unless disable_tqdm, and one "
            "line of the key signals with the alarms that start: extras.console.ConsoleCallback) or 'raw' "
            "(transformers' dict of every logged value). Loggers of report_to get every value either way.",
            "choices": list(CONSOLE_MODES),
        },
    )

    loss_implementation: str = field(
        default="reference",
        metadata={
            "help": "How the objective is computed: 'reference' (the formula with autograd, what trains by default), "
            "or the opt-in kernel of the clipped-surrogate loss types: 'fused' (its terms with their analytic "
            "gradient, one saved buffer) or 'compiled' (the same through torch.compile; falls back to 'fused' if "
            "compiling fails). Both are refused for an objective outside the kernel's domain (token-level ratios, "
            "no per-token weights, delta or bias-corrected KL). 'auto' was removed.",
            "choices": list(IMPLEMENTATIONS),
        },
    )

    # The log-prob forward
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Compute every log-prob forward (policy, old policy, reference) on the real tokens only: each "
            "chunk's rows packed end to end, position_ids restarting per sequence, each sequence kept apart as its "
            "attention implementation allows (explicit sequence boundaries for flash-attention's varlen kernels, a "
            "block mask for flex attention, a packed-sequence mask for sdpa and eager); the log-probs, entropies and "
            "router loss are TRL's padded forward's to rounding. The first forward of a run is checked against the "
            "padded one on a few rows, at the precision the forward computes in; a model that does not pack exactly, "
            "vision-language inputs, use_liger_kernel or an integer pad_to_multiple_of fall back to TRL's padded "
            "forward with one line saying why (forward.logprobs). forward/* metrics say what padding and repeated "
            "prompts cost, with the option on or off."
        },
    )
    padding_free_row_tokens: int | None = field(
        default=None,
        metadata={
            "help": "With padding_free: the most tokens in one packed row (a longer sequence has a row of its own). "
            "Default: one row per chunk where attention runs within sequences (flash-attention, flex attention), "
            "rows no longer than the chunk's padded width under a dense mask (sdpa, eager: attention over a row "
            "costs the square of its length), so that no row attends over more than TRL's padded ones do."
        },
    )
    shared_prompt_forward: bool = field(
        default=True,
        metadata={
            "help": "Forward each prompt once for its completions in a chunk (the rows whose prompt tokens are "
            "equal), each completion attending to the prompt and to itself only: with flash-attention as a query "
            "segment whose keys are the prompt's and its own, with flex attention through a block mask, with sdpa "
            "and eager through a 4-D mask; log-probs, entropies and gradients are the padded forward's to rounding. "
            "A layout of the padding-free forward: padding_free=False forwards padded, as TRL does, whatever this "
            "says. The MoE router loss, and with a mask sliding-window layers or router logits, pack without "
            "sharing, with one line saying why (forward.logprobs)."
        },
    )

    # Compute spent on the rows that teach
    skip_zero_advantage_rows: bool = field(
        default=False,
        metadata={
            "help": "Leave the rows whose advantage is 0 (a group with equal rewards) or that have no completion "
            "token out of the training forward and backward, with the whole micro-batch's denominators, so that the "
            "loss and gradient are those of the run without skipping (to float rounding). Exact only with beta=0, no "
            "entropy bonus, no router loss and top_entropy_quantile=1; elsewhere it does nothing and warns once why. "
            "Logs skipped_rows/fraction; entropy and ratio/* then describe the rows that trained."
        },
    )

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: after TRL scored a generation batch, replace the groups whose rewards "
            "are all equal (advantage 0, no policy gradient) by informative groups generated for fresh prompts of "
            "the training set, in extra rounds sized to what the batch still lacks (dynamic_sampling_round_margin), "
            "at most dynamic_sampling_max_rounds rounds; advantages are then computed on the assembled batch as TRL "
            "computes them. Places still empty after the last round keep their zero-spread group (same batch shape "
            "on every process). Needs a map-style train_dataset. Logs dynamic_sampling/*."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={
            "help": "With dynamic_sampling, the most extra generation rounds per generation batch (>= 1); each costs "
            "the generation and scoring of its prompts."
        },
    )
    dynamic_sampling_round_margin: float = field(
        default=1.1,
        metadata={
            "help": "With dynamic_sampling, an extra round generates this many times the groups the batch still "
            "lacks divided by the share of informative groups seen so far (recent generation batches weigh most), "
            "rounded up to whole groups per process where the layout allows, at most a whole generation batch (> 0). "
            "Larger: fewer rounds, more groups generated; a value at least the groups of a generation batch makes "
            "every extra round a whole generation batch."
        },
    )

    selective_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Skip, before generation, the training prompts predicted to give no reward spread: those whose "
            "last selective_rollouts_history visits (at least) had none, each still explored with probability "
            "p ** (streak - history + 1), p adapted towards selective_rollouts_target_zero_spread. A skipped prompt "
            "is replaced in its place by the next prompt of the stream of fresh prompts (dynamic sampling's), judged "
            "alike; prompts are identified by their index in the training set (a map-style train_dataset is "
            "needed). Combines with dynamic_sampling and skip_zero_advantage_rows. Logs selective_rollouts/*."
        },
    )
    selective_rollouts_history: int = field(
        default=1,
        metadata={
            "help": "With selective_rollouts, the visits without reward spread in a row after which a prompt is "
            "predicted flat (>= 1)."
        },
    )
    selective_rollouts_target_zero_spread: float = field(
        default=0.25,
        metadata={
            "help": "With selective_rollouts, the share of generated groups without reward spread that the "
            "exploration probability steers towards: it goes down while more groups than this have no spread, up "
            "otherwise (in [0, 1])."
        },
    )
    selective_rollouts_exploration: float = field(
        default=0.5,
        metadata={
            "help": "With selective_rollouts, the initial exploration probability p: a prompt predicted flat is "
            "generated for anyway with probability p ** (streak - history + 1) (within the schedule's bounds)."
        },
    )
    selective_rollouts_exploration_schedule: list[float] = field(
        default_factory=lambda: [0.05, 1.0, 0.01],
        metadata={
            "help": "With selective_rollouts, the exploration probability's lowest and highest values and how far it "
            "moves after each generation batch: [min, max, step] with 0 <= min <= max <= 1 and step >= 0 (0 keeps "
            "it fixed)."
        },
    )

    # Diagnostics
    log_diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log the importance-ratio distribution (ratio/*), the reward spread inside each group "
            "(reward_std/group_*) and the loss split (loss/policy, loss/kl_penalty). TRL's own metrics (kl, "
            "entropy, clip_ratio/*) are logged either way."
        },
    )
    log_histograms: bool = field(
        default=True,
        metadata={
            "help": "With log_diagnostics, also write histograms of the importance ratio and of the per-group reward "
            "std at every logging step, to the loggers that draw histograms (TensorBoard). Others ignore them."
        },
    )
    ratio_quantiles: list[float] = field(
        default_factory=lambda: [0.05, 0.5, 0.95],
        metadata={
            "help": "Quantiles of the importance ratio to log, each in [0, 1]; 0.05 is logged as ratio/p05. "
            "Resolution: within one histogram bin of the order statistics at that rank: 2.5e-4 relative when both "
            "neighbouring order statistics lie in [0.61, 1.65], up to a tail bin's width (0.079 |log r|) otherwise."
        },
    )

    log_sampler_mismatch: bool = field(
        default=True,
        metadata={
            "help": "With use_vllm, log the sampler/trainer mismatch (sampling/importance_sampling_ratio_raw/*, "
            "sampling/sampler_k3_kl), whether vllm_importance_sampling_correction is on or off. With the correction "
            "off, TRL computes no trainer log-probs at generation; they then cost one forward pass without gradient "
            "per generation batch (the training itself is unchanged)."
        },
    )

    # vLLM's truncated sampling
    match_sampler_truncation: bool = field(
        default=True,
        metadata={
            "help": "With use_vllm and a sampling cut (top_k, top_p or min_p, also through generation_kwargs): the "
            "trainer's log-probs that enter vLLM's importance-sampling correction and the sampler-mismatch metrics "
            "are those of the same truncated distribution as vLLM's (the cuts after temperature, renormalised over "
            "the kept tokens), so that the ratio measures the engine's mismatch only; stock TRL compares the "
            "trainer's whole-vocabulary log-probs with vLLM's truncated ones, a ratio scaled by the kept mass. Costs "
            "one forward pass without gradient per generation batch. The surrogate's ratio (policy against old "
            "log-probs) is unchanged. A plain trl.GRPOConfig keeps stock TRL's behaviour (False)."
        },
    )

    # Held-out evaluation (GRPOTrainerExt's `heldout_metrics` and `heldout_dataset` arguments)
    heldout_every_steps: int = field(
        default=0,
        metadata={
            "help": "Run the held-out evaluation every this many optimizer steps, logged as heldout/<metric>/mean@<n> "
            "and heldout/<metric>/pass@<k>. 0: only when the trainer evaluates (eval_strategy, evaluate()) or "
            "evaluate_heldout() is called."
        },
    )
    heldout_num_generations: int = field(
        default=1,
        metadata={"help": "Completions sampled per held-out prompt (n), exactly as training samples."},
    )
    heldout_pass_at: list[int] | None = field(
        default=None,
        metadata={
            "help": "The k of each logged pass@k (unbiased estimator from the n samples), each in [1, n], "
            "n = heldout_num_generations. Default: [n]."
        },
    )
    heldout_pass_threshold: float = field(
        default=1.0,
        metadata={
            "help": "A held-out completion passes (for pass@k) when its metric score is >= this: 1.0 suits 0/1 "
            "metrics and full marks of graded ones. Unscored (None) completions do not pass."
        },
    )
    heldout_batch_size: int = field(
        default=256,
        metadata={"help": "Held-out completions per generate call on each process (whole prompts: at least one)."},
    )

    # Guardrails
    nonfinite_policy: str = field(
        default="skip",
        metadata={
            "help": "What happens to an optimizer step whose gradient norm is NaN or infinite (a non-finite loss or "
            "gradient on any process): 'skip' drops the update (the learning-rate scheduler does not advance), "
            "counted in nonfinite/skipped_steps; 'stop' raises NonFiniteTrainingError naming a checkpoint of the "
            "state before the step (written if none exists; an existing one is never rewritten); 'off' lets it "
            "reach the weights. With fp16, a loss-scale overflow from finite losses is the scaler's to skip and "
            "is not counted. Under DeepSpeed the engine's own overflow check skips the update and the guard "
            "counts or stops. 'skip' and 'stop' read the gradient norm once per optimizer step (one host sync).",
            "choices": list(NONFINITE_POLICIES),
        },
    )
    max_nonfinite_skips: int = field(
        default=10,
        metadata={
            "help": "With nonfinite_policy='skip', stop like 'stop' once more than this many optimizer steps in a "
            "row were skipped. 0: never stop."
        },
    )
    warn_on_anomalies: bool = field(
        default=True,
        metadata={
            "help": "Alarms: warn (once per episode, naming what to change) when a run stops learning or drifts, and "
            "count each alarm in the logged metric alarms/<name>."
        },
    )
    alarm_thresholds: dict[str, float | None] | str | None = field(
        default_factory=dict,
        metadata={
            "help": "The alarms' thresholds by alarm name, over their defaults; None switches an alarm off: "
            """--alarm_thresholds '{"kl_high": 0.5, "zero_std": null}', in a YAML config `alarm_thresholds: """
            "{kl_high: 0.5, zero_std: null}`. The alarms and their defaults: "
            + ", ".join(f"{name} {default:g}" for name, default in DEFAULTS.items())
            + "."
        },
    )
    warn_patience: int = field(
        default=3, metadata={"help": "Consecutive log steps a high clip fraction must last before its alarm. >= 1."}
    )
    warn_auxiliary_rewards: list[str] | None = field(
        default=None,
        metadata={
            "help": "Alarm reward_composition: the reward functions that score the form of a completion rather than "
            "the task, by the names they are logged under (rewards/<name>/mean), e.g. ['format_reward']. None: "
            "those with format, tag, xml, json, length, lang, style or think as a word of their name."
        },
    )

    def __post_init__(self):
        if self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default
        if not _HAS_ACTIVATION_CHECKPOINTING:  # the names mirror each other, as transformers >= 5.23 makes them
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = self.activation_checkpointing
            self.activation_checkpointing = self.gradient_checkpointing
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        # Numbers as numbers ([1, 4.0] from a YAML file); anything else is named by `config_problems`.
        if list_problem("ratio_quantiles", self.ratio_quantiles, "numbers") is None:
            self.ratio_quantiles = [float(q) for q in self.ratio_quantiles]
        pass_at = self.heldout_pass_at
        if pass_at is not None and list_problem("heldout_pass_at", pass_at, "whole numbers") is None:
            self.heldout_pass_at = [int(k) for k in pass_at]
        if isinstance(self.alarm_thresholds, str):  # a command line's JSON, as transformers reads its dict fields
            try:
                self.alarm_thresholds = json.loads(self.alarm_thresholds)
            except ValueError as error:
                raise ValueError(
                    f"`alarm_thresholds` must be a JSON object of alarm name: threshold (e.g. "
                    f'\'{{"kl_high": 0.5, "zero_std": null}}\'), got {self.alarm_thresholds!r}.'
                ) from error
        raise_problems(config_problems(self))  # before TRL's own checks, which load nothing either
        generation_batch_size_set = self.generation_batch_size is not None
        try:
            super().__post_init__()
        except ValueError as error:  # TRL names its derived generation batch: name the field the user set instead
            problem = generation_batch_problem(self, generation_batch_size_set)
            if problem is None:
                raise
            raise ValueError(problem) from error
        raise_problems(config_problems(self, only_after_trl=True))


#: `GRPOConfigExt`'s own fields and their defaults (what a plain `trl.GRPOConfig`, which lacks them, runs with).
_DEFAULTS = {
    name: spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    for name, spec in GRPOConfigExt.__dataclass_fields__.items()
}


#: The fields whose value for a configuration without them (a plain `trl.GRPOConfig`) is not `GRPOConfigExt`'s default
#: but the one that keeps stock TRL's behaviour: a plain config then trains as stock TRL does.
TRL_BEHAVIOUR = {"match_sampler_truncation": False, "padding_free": False, "shared_prompt_forward": False}


#: The selective rollouts' exploration fields folded into `selective_rollouts_exploration_schedule`: their place there.
FOLDED_FIELDS = {f"selective_rollouts_exploration_{part}": part for part in ("min", "max", "step")}


def removed_field_problem(name: str, value=None) -> str | None:
    """The sentence that refuses a field this release removed (an alarm threshold's `warn_*` field, a bound of the
    selective rollouts' exploration), naming the setting that replaced it; `None` for any other name."""
    if name in FOLDED_FIELDS:
        return (
            f"`{name}` was removed: it is the {FOLDED_FIELDS[name]} of selective_rollouts_exploration_schedule = "
            "[min, max, step]; set that instead."
        )
    alarm = RENAMED.get(name)
    if alarm is None:
        return None
    return (
        f"`{name}` was removed: the alarm thresholds are one field keyed by alarm name, set "
        f"alarm_thresholds={{'{alarm}': {value!r}}} instead (None switches that alarm off)."
    )


def option(args, name: str):
    """`args.<name>`; for a configuration without that field (a plain `trl.GRPOConfig`), its `TRL_BEHAVIOUR` value,
    or else `GRPOConfigExt`'s default.

    Raises:
        AttributeError: for a name that is neither a field of `args` nor one of `GRPOConfigExt`.
    """
    if hasattr(args, name):
        return getattr(args, name)
    if name in TRL_BEHAVIOUR:
        return TRL_BEHAVIOUR[name]
    if name not in _DEFAULTS:
        raise AttributeError(f"{type(args).__name__} has no field {name!r}, and GRPOConfigExt neither.")
    return _DEFAULTS[name]


class _WithDefaults:
    """A configuration read through `option`: every field of `GRPOConfigExt`, those it lacks (a plain
    `trl.GRPOConfig`) at their `option` value, for the checks of `config_checks`."""

    def __init__(self, args):
        self._args = args

    def __getattr__(self, name: str):
        return option(self._args, name)


def config_problems(args, *, only_after_trl: bool = False) -> list[str]:
    """Every reason why the configuration `args` (a `GRPOConfigExt` or a plain `trl.GRPOConfig`) cannot train, one
    sentence each (empty: none). The one validation of a configuration: `GRPOConfigExt.__post_init__` and
    `GRPOTrainerExt.__init__` (for a plain `trl.GRPOConfig`, or one changed after construction) both call it; the
    checks are `config_checks.option_problems`.

    Args:
        only_after_trl (`bool`): only the checks that need the fields `trl.GRPOConfig.__post_init__` resolves
            (the loss kernel's domain); without it, every other check.
    """
    return option_problems(_WithDefaults(args), only_after_trl=only_after_trl)
