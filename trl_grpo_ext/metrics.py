"""The names of the metrics that the package logs, or reads from a run's log history: one constant per name.

Every layer may read this module (the diagnostics, the alarm rules, the samplers, the report and the card), so it
imports nothing of the package. A name marked (TRL) is TRL's or transformers' own: the package reads it, and logs it
itself only where it computes the same quantity in TRL's place. A family of names built from a part (a reward
function, an alarm, a held-out metric) has its prefix here and the function that builds a member.
"""

from __future__ import annotations

# Logged by transformers' `Trainer` and TRL's `GRPOTrainer`.
LOSS = "loss"  # (TRL) the training loss of the log step
GRAD_NORM = "grad_norm"  # (TRL) the gradient norm before clipping
LEARNING_RATE = "learning_rate"  # (TRL) the scheduler's learning rate
NUM_TOKENS = "num_tokens"  # (TRL) the running total of prompt and completion tokens seen
STEP_TIME = "step_time"  # (TRL) seconds of one optimizer step, generation included, averaged over the log step
REWARD = "reward"  # (TRL) the mean total reward of the completions
REWARD_STD = "reward_std"  # (TRL) the standard deviation of the total reward over the batch
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # (TRL) share of completions in a group whose rewards all tie
KL = "kl"  # (TRL) mean per-token KL to the reference (beta > 0); the diagnostics log it in TRL's place
ENTROPY = "entropy"  # (TRL) mean per-token entropy of the policy; the diagnostics log it in TRL's place
REWARDS_PREFIX = "rewards/"  # (TRL) `rewards/<function>/mean` and `/std`: each reward function's statistics
CLIP_RATIO_PREFIX = "clip_ratio/"  # (TRL) the clip fractions below
CLIP_RATIO_LOW_MEAN = "clip_ratio/low_mean"  # (TRL) token share with r < 1 - epsilon_low and A < 0
CLIP_RATIO_HIGH_MEAN = "clip_ratio/high_mean"  # (TRL) token share with r > 1 + epsilon_high and A > 0
CLIP_RATIO_REGION_MEAN = "clip_ratio/region_mean"  # (TRL) token share in either clipped, zero-gradient region
CISPO_CLIP_RATIO = "cispo_clip_ratio"  # (TRL) CISPO: token share whose weight the cap binds (A > 0)
COMPLETIONS_PREFIX = "completions/"  # (TRL) the completions' lengths below
COMPLETIONS_MEAN_LENGTH = "completions/mean_length"  # (TRL) mean completion length in tokens
COMPLETIONS_MIN_LENGTH = "completions/min_length"  # (TRL) shortest completion
COMPLETIONS_MAX_LENGTH = "completions/max_length"  # (TRL) longest completion
COMPLETIONS_CLIPPED_RATIO = "completions/clipped_ratio"  # (TRL) share of completions cut at max_completion_length
TOOLS_CALL_FREQUENCY = "tools/call_frequency"  # (TRL) tool calls per completion
TOOLS_FAILURE_FREQUENCY = "tools/failure_frequency"  # (TRL) share of tool calls that failed
SAMPLING_PREFIX = "sampling/"  # (TRL) the vLLM sampler's mismatch metrics, TRL's and the package's
SAMPLING_LOGP_DIFFERENCE_MEAN = "sampling/sampling_logp_difference/mean"  # (TRL) mean |trainer - vLLM log-prob|
SAMPLING_LOGP_DIFFERENCE_MAX = "sampling/sampling_logp_difference/max"  # (TRL) its largest value
IMPORTANCE_SAMPLING_RATIO_MIN = "sampling/importance_sampling_ratio/min"  # (TRL) smallest vLLM correction weight
IMPORTANCE_SAMPLING_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"  # (TRL) mean vLLM correction weight
IMPORTANCE_SAMPLING_RATIO_MAX = "sampling/importance_sampling_ratio/max"  # (TRL) largest vLLM correction weight

# Logged by the package.
FRAC_REWARD_UNSCORED = "frac_reward_unscored"  # share of completions no reward function scored
IMPORTANCE_SAMPLING_RATIO_ESS = "sampling/importance_sampling_ratio/ess"  # effective sample size of the weights
IMPORTANCE_SAMPLING_RATIO_RAW = "sampling/importance_sampling_ratio_raw"  # prefix: trainer/sampler ratios, uncut
SAMPLER_K3_KL = "sampling/sampler_k3_kl"  # k3 estimate of the KL between trainer and sampler
TRUNCATION_KEPT_MASS = "sampling/truncation/kept_mass"  # probability mass inside vLLM's top-k/top-p cut
TRUNCATION_OUTSIDE_CUT_FRACTION = "sampling/truncation/outside_cut_fraction"  # sampled tokens outside the cut
RATIO_PREFIX = "ratio/"  # the importance ratio's distribution over masked tokens (`ratio/mean`, `ratio/p<q>`)
RATIO_MIN = "ratio/min"  # smallest importance ratio
RATIO_MAX = "ratio/max"  # largest importance ratio
RATIO_P05 = "ratio/p05"  # its 5th percentile
RATIO_P50 = "ratio/p50"  # its median
RATIO_P95 = "ratio/p95"  # its 95th percentile
RATIO_NAN_COUNT = "ratio/nan_count"  # tokens whose log ratio was not a number
REWARD_STD_PREFIX = "reward_std/"  # the reward spread inside each group
REWARD_STD_GROUP = "reward_std/group"  # histogram of the groups' reward standard deviations
REWARD_STD_GROUP_MEAN = "reward_std/group_mean"  # mean over groups of the reward standard deviation
REWARD_STD_GROUP_MIN = "reward_std/group_min"  # smallest group reward standard deviation
REWARD_STD_GROUP_MAX = "reward_std/group_max"  # largest group reward standard deviation
REWARD_STD_FRAC_ZERO_GROUPS = "reward_std/frac_zero_groups"  # share of groups without reward spread
REWARD_LENGTH_CORR_PREFIX = "reward_length_corr/"  # the reward/length correlation below
REWARD_LENGTH_CORR = "reward_length_corr/within_group"  # correlation of reward and length inside groups
LOSS_PREFIX = "loss/"  # `loss/<term>`: the loss's terms, which add up to `loss`
LOSS_POLICY = "loss/policy"  # the policy term of the loss
LOSS_KL_PENALTY = "loss/kl_penalty"  # beta times the KL term of the loss
NONFINITE_PREFIX = "nonfinite/"  # the non-finite guard's metrics
NONFINITE_SKIPPED_STEPS = "nonfinite/skipped_steps"  # optimizer steps the guard dropped so far
SKIPPED_ROWS_PREFIX = "skipped_rows/"  # exact skipping of zero-advantage rows
SKIPPED_ROWS_FRACTION = "skipped_rows/fraction"  # share of rows left out of the loss's forward
VESPO_PHI_SEQ_MEAN = "vespo/phi_seq_mean"  # VESPO's mean sequence weight
FORWARD_PREFIX = "forward/"  # the log-prob forward's waste
FORWARD_PADDING_FRACTION = "forward/padding_fraction"  # share of forwarded tokens that are padding
FORWARD_REPEATED_PROMPT_FRACTION = "forward/repeated_prompt_fraction"  # share that repeat a group's prompt
FORWARD_TOKENS_PER_DISTINCT = "forward/tokens_per_distinct"  # tokens forwarded per distinct token
DYNAMIC_SAMPLING_PREFIX = "dynamic_sampling/"  # dynamic sampling's rounds
DYNAMIC_SAMPLING_KEPT_FRACTION = "dynamic_sampling/kept_fraction"  # share of generated groups that train
DYNAMIC_SAMPLING_ROUNDS = "dynamic_sampling/rounds"  # extra generation rounds
DYNAMIC_SAMPLING_GENERATED_GROUPS = "dynamic_sampling/generated_groups"  # groups generated over all rounds
DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED = (
    "dynamic_sampling/frac_reward_zero_std_generated"  # `frac_reward_zero_std` of everything generated
)
DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH = "dynamic_sampling/trained_mean_length"  # mean length of what trains
DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO = "dynamic_sampling/trained_clipped_ratio"  # truncated share of what trains
SELECTIVE_ROLLOUTS_PREFIX = "selective_rollouts/"  # selective rollouts' predictions
SELECTIVE_ROLLOUTS_SKIPPED_PROMPTS = "selective_rollouts/skipped_prompts"  # prompts replaced before generation
SELECTIVE_ROLLOUTS_EXPLORATION_PROBABILITY = "selective_rollouts/exploration_probability"  # chance to try one anyway
SELECTIVE_ROLLOUTS_PREDICTED_FLAT = "selective_rollouts/predicted_flat"  # share of prompts predicted without spread
SELECTIVE_ROLLOUTS_PRECISION = "selective_rollouts/precision"  # share of explored predictions that held
SELECTIVE_ROLLOUTS_ZERO_SPREAD = "selective_rollouts/zero_spread"  # share of generated groups without spread
ALARMS_PREFIX = "alarms/"  # `alarms/<name>`: how often each alarm has fired
HELDOUT_PREFIX = "heldout/"  # `heldout/<metric>/mean@<k>`, `pass@<k>`, `scored@<k>`: the held-out evaluation


def reward_function_metric(function: str, statistic: str = "mean") -> str:
    """`rewards/<function>/<statistic>` (TRL's): one reward function's mean or std."""
    return f"{REWARDS_PREFIX}{function}/{statistic}"


def reward_function_of(key: str) -> str | None:
    """The reward function whose mean `key` is (`rewards/<function>/mean`), else `None`."""
    if key.startswith(REWARDS_PREFIX) and key.endswith("/mean"):
        return key.removeprefix(REWARDS_PREFIX).removesuffix("/mean")
    return None


def alarm_metric(name: str) -> str:
    """`alarms/<name>`: how often the alarm `name` has fired."""
    return f"{ALARMS_PREFIX}{name}"


def heldout_metric(metric: str, statistic: str, k: int | str) -> str:
    """`heldout/<metric>/<statistic>@<k>`, the statistic `mean`, `pass` or `scored`."""
    return f"{HELDOUT_PREFIX}{metric}/{statistic}@{k}"
