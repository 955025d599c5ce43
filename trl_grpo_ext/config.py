"""`GRPOConfigExt`: TRL's `GRPOConfig` with the source documents' defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import transformers
import trl
from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig

from ._compat import check_transformers_version, check_trl_version
from .guardrails.alarms import DEFAULT_THRESHOLDS
from .guardrails.nonfinite import NONFINITE_POLICIES
from .objective_inputs import fused_kernel_problems
from .ops import IMPLEMENTATIONS, hyperparameter_problems

check_trl_version(trl.__version__)
check_transformers_version(transformers.__version__)

__all__ = ["GRPOConfigExt"]


@dataclass
class GRPOConfigExt(GRPOConfig):
    """Configuration for [`GRPOTrainerExt`]: a [`trl.GRPOConfig`] whose defaults give the documents' GRPO objective.

    Defaults that differ from TRL 1.16:

    - `beta=0.04` (TRL: 0.0): the KL penalty to the reference model is on, as in the DeepSeekMath paper.
    - `loss_type="grpo"` (TRL: "dapo"): per-sequence length normalisation, the documents' objective (every other TRL
      loss type is honoured as TRL computes it).
    - `use_bias_correction_kl=False` (TRL: True): the KL estimator is `exp(d) - d - 1`, not multiplied by the
      importance ratio.
    - `bf16=None` resolves to `True` only where a bf16-capable GPU is in use (TRL: always `True`, which fails on a
      CPU-only machine).

    Every other field is TRL's; see [`trl.GRPOConfig`].
    """

    beta: float = field(
        default=0.04,
        metadata={
            "help": "KL coefficient of the penalty `beta * (exp(d) - d - 1)`, d = ref_logp - logp. The documents and "
            "the DeepSeekMath paper use 0.04. 0.0 switches the penalty off and no reference model is loaded."
        },
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "Clipping width: ratios are clipped to [1 - epsilon, 1 + epsilon_high]. Must be > 0."},
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "Loss aggregation. 'grpo' (average the tokens of each completion, then the completions) is the "
            "documents' objective; 'dapo', 'dr_grpo', 'bnpo', 'cispo', 'sapo', 'luspo' and 'vespo' are computed as "
            "TRL computes them (trl_grpo_ext.ops.policy_objective)."
        },
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio (TRL's default). Not part of the documents' "
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

    loss_implementation: str = field(
        default="auto",
        metadata={
            "help": "How the objective is computed: 'fused' (its terms and analytic gradient, one saved buffer), "
            "'reference' (the formula with autograd), 'compiled' (the fused kernel through torch.compile; falls "
            "back to 'fused' if compiling fails), or 'auto' (the fused kernel wherever it applies: the clipped "
            "surrogate with token-level ratios and no per-token weights, delta or bias-corrected KL; the reference "
            "elsewhere). 'fused' or 'compiled' for an objective outside the kernel's domain is refused.",
            "choices": list(IMPLEMENTATIONS),
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
            "the training set, one whole generation batch per extra round, at most dynamic_sampling_max_rounds "
            "rounds; advantages are then computed on the assembled batch as TRL computes them. Places still empty "
            "after the last round keep their zero-spread group (same batch shape on every process). Needs a "
            "map-style train_dataset. Logs dynamic_sampling/*."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={
            "help": "With dynamic_sampling, the most extra generation rounds per generation batch (>= 1); each costs "
            "one generation batch's generation and scoring."
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
            "help": "Alarms: warn (once per episode, naming what to change) about the conditions of the warn_* "
            "fields below, and count each alarm in the logged metric alarms/<name>. A warn_* field set to None "
            "switches that alarm off."
        },
    )
    warn_zero_std_fraction: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_zero_std_fraction"],
        metadata={
            "help": "Alarm zero_std: at least this share of completions is in groups with equal rewards "
            "(frac_reward_zero_std): no learning signal from them. In (0, 1]."
        },
    )
    warn_no_spread_steps: int | None = field(
        default=DEFAULT_THRESHOLDS["warn_no_spread_steps"],
        metadata={
            "help": "Alarm no_spread: every group has equal rewards for this many log steps in a row (nothing is "
            "learned); the warning says whether truncation (completions/clipped_ratio) is the cause. >= 1."
        },
    )
    warn_truncated_fraction: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_truncated_fraction"],
        metadata={
            "help": "Alarm truncation: at least this share of completions reached max_completion_length without "
            "an end-of-sequence token (TRL's completions/clipped_ratio). In (0, 1]."
        },
    )
    warn_clip_fraction: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_clip_fraction"],
        metadata={
            "help": "Alarm clip_fraction: clip_ratio/region_mean stays above this for warn_patience log steps. "
            "In (0, 1]."
        },
    )
    warn_ratio_p95: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_ratio_p95"],
        metadata={"help": "Alarm ratio_p95: the 95th percentile of the importance ratio exceeds this. > 1."},
    )
    warn_ratio_max: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_ratio_max"],
        metadata={"help": "Alarm ratio_max: the largest importance ratio exceeds this. > 1."},
    )
    warn_kl_jump: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_kl_jump"],
        metadata={
            "help": "Alarm kl_jump: kl exceeds this factor times the median of its previous 10 logged values "
            "(judged once 5 are there; a median below 0.01 counts as 0.01). > 1."
        },
    )
    warn_entropy_collapse: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_entropy_collapse"],
        metadata={
            "help": "Alarm entropy_collapse: entropy falls below this fraction of the mean of its first 3 logged "
            "values. In (0, 1)."
        },
    )
    warn_grad_norm_spike: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_grad_norm_spike"],
        metadata={
            "help": "Alarm grad_norm_spike: grad_norm exceeds this factor times the median of its previous 20 "
            "logged values (judged once 5 are there; a median below 1e-3 counts as 1e-3), or is not finite. > 1."
        },
    )
    warn_length_drift_corr: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_length_drift_corr"],
        metadata={
            "help": "Alarm length_drift: over the last 10 log steps (judged from 6) the reward rose, "
            "completions/mean_length changed by at least a fifth, and the two correlate at least this much (absolute "
            "Pearson correlation). In (0, 1]."
        },
    )
    warn_length_group_corr: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_length_group_corr"],
        metadata={
            "help": "Alarm length_in_group: inside groups, completion length and reward correlate at least this "
            "much (reward_length_corr/within_group, logged with log_diagnostics). In (0, 1]."
        },
    )
    warn_heldout_drop: float | None = field(
        default=DEFAULT_THRESHOLDS["warn_heldout_drop"],
        metadata={
            "help": "Alarm reward_vs_heldout: a logged held-out metric (heldout/<metric>/mean@<k>) falls by this "
            "fraction of its best value while the training reward is above its level at that best. > 0."
        },
    )
    warn_patience: int = field(
        default=3, metadata={"help": "Consecutive log steps a high clip fraction must last before its alarm. >= 1."}
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        self.ratio_quantiles = [float(q) for q in self.ratio_quantiles]
        bad = [q for q in self.ratio_quantiles if not 0.0 <= q <= 1.0]
        if bad:
            raise ValueError(f"`ratio_quantiles` must lie in [0, 1], got {bad}.")
        if self.loss_implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"`loss_implementation` must be one of {IMPLEMENTATIONS}, got {self.loss_implementation!r}."
            )
        if self.nonfinite_policy not in NONFINITE_POLICIES:
            raise ValueError(f"`nonfinite_policy` must be one of {NONFINITE_POLICIES}, got {self.nonfinite_policy!r}.")
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(
                f"`dynamic_sampling_max_rounds` must be >= 1 (extra generation rounds), got "
                f"{self.dynamic_sampling_max_rounds}; set dynamic_sampling=False to generate once."
            )
        if self.max_nonfinite_skips < 0:
            raise ValueError(f"`max_nonfinite_skips` must be >= 0, got {self.max_nonfinite_skips}.")
        problems = _threshold_problems(self)
        if problems:
            raise ValueError(" ".join(problems))
        for name in ("heldout_every_steps", "heldout_num_generations", "heldout_batch_size"):
            minimum = 0 if name == "heldout_every_steps" else 1
            if getattr(self, name) < minimum:
                raise ValueError(f"`{name}` must be >= {minimum}, got {getattr(self, name)}.")
        if self.heldout_pass_at is not None:  # k <= heldout_num_generations is checked by the trainer
            self.heldout_pass_at = [int(k) for k in self.heldout_pass_at]
            if not self.heldout_pass_at or min(self.heldout_pass_at) < 1:
                raise ValueError(f"`heldout_pass_at` must list values >= 1, got {self.heldout_pass_at}.")
        problems = hyperparameter_problems(self.epsilon, self.epsilon_high, self.beta, self.delta)
        if problems:
            raise ValueError(" ".join(problems))
        super().__post_init__()
        outside = fused_kernel_problems(self) if self.loss_implementation in ("fused", "compiled") else []
        if outside:
            raise ValueError(
                f"loss_implementation={self.loss_implementation!r} cannot compute this objective: the fused kernel "
                + "; ".join(outside)
                + ". Use 'auto' (the kernel wherever it applies) or 'reference'."
            )


# field -> (lowest, highest, whether the lowest is allowed, whether the highest is allowed, the range in words)
_THRESHOLD_RANGES = {
    "warn_zero_std_fraction": (0.0, 1.0, False, True, "in (0, 1]"),
    "warn_no_spread_steps": (1, math.inf, True, False, ">= 1"),
    "warn_truncated_fraction": (0.0, 1.0, False, True, "in (0, 1]"),
    "warn_clip_fraction": (0.0, 1.0, False, True, "in (0, 1]"),
    "warn_ratio_p95": (1.0, math.inf, False, False, "> 1"),
    "warn_ratio_max": (1.0, math.inf, False, False, "> 1"),
    "warn_kl_jump": (1.0, math.inf, False, False, "> 1"),
    "warn_entropy_collapse": (0.0, 1.0, False, False, "in (0, 1)"),
    "warn_grad_norm_spike": (1.0, math.inf, False, False, "> 1"),
    "warn_length_drift_corr": (0.0, 1.0, False, True, "in (0, 1]"),
    "warn_length_group_corr": (0.0, 1.0, False, True, "in (0, 1]"),
    "warn_heldout_drop": (0.0, math.inf, False, False, "> 0"),
}


def _threshold_problems(args) -> list[str]:
    """One sentence per alarm threshold out of its range (`None` switches an alarm off and is always fine)."""
    problems = []
    for name, (low, high, low_ok, high_ok, words) in _THRESHOLD_RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        inside = (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high)
        if not inside:
            problems.append(f"`{name}` must be {words} (or None to switch its alarm off), got {value}.")
    if args.warn_no_spread_steps is not None and args.warn_no_spread_steps != int(args.warn_no_spread_steps):
        problems.append(
            f"`warn_no_spread_steps` must be a whole number of log steps, got {args.warn_no_spread_steps}."
        )
    if args.warn_patience < 1:
        problems.append(f"`warn_patience` must be >= 1, got {args.warn_patience}.")
    return problems
