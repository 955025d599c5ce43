"""What to watch: one record per row of the documents' metric tables, the one place a metric's reading is written.

A `Watched` record (its type in `report.metric_record`) holds a metric (or a few read together), what it is, its
healthy and worrying values, and who shows it: the README's short table (`readme`), the verdicts of `trl-grpo-ext
report` and `report.png` (`signal`, a `Signal`), the console's line (`console`). `report.health.SIGNALS` and
`extras.console.CONSOLE_SIGNALS` are read from these records, and `python -m benchmarks tables` writes every metric
table of the README, docs/diagnostics.md and docs/sampling.md from them (a test fails on a stale or hand-edited
table). A new metric is one constant in `trl_grpo_ext.metrics` and one record here; `tests/test_report_watch.py`
fails on a constant the package logs that no record documents.
"""

from __future__ import annotations

from ..metrics import (
    ALARMS_PREFIX,
    CLIP_RATIO_HIGH_MEAN,
    CLIP_RATIO_LOW_MEAN,
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_MEAN_LENGTH,
    DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
    DYNAMIC_SAMPLING_GENERATED_GROUPS,
    DYNAMIC_SAMPLING_KEPT_FRACTION,
    DYNAMIC_SAMPLING_ROUNDS,
    DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO,
    DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH,
    ENTROPY,
    FORWARD_PADDING_FRACTION,
    FORWARD_REPEATED_PROMPT_FRACTION,
    FORWARD_TOKENS_PER_DISTINCT,
    FRAC_REWARD_UNSCORED,
    FRAC_REWARD_ZERO_STD,
    GRAD_NORM,
    IMPORTANCE_SAMPLING_RATIO_ESS,
    IMPORTANCE_SAMPLING_RATIO_RAW,
    KL,
    LEARNING_RATE,
    LOSS,
    LOSS_KL_PENALTY,
    LOSS_POLICY,
    NONFINITE_SKIPPED_STEPS,
    RATIO_MAX,
    RATIO_MIN,
    RATIO_NAN_COUNT,
    RATIO_P05,
    RATIO_P50,
    RATIO_P95,
    RATIO_PREFIX,
    REWARD,
    REWARD_LENGTH_CORR,
    REWARD_STD_FRAC_ZERO_GROUPS,
    REWARD_STD_GROUP_MAX,
    REWARD_STD_GROUP_MEAN,
    REWARD_STD_GROUP_MIN,
    SAMPLER_K3_KL,
    SELECTIVE_ROLLOUTS_EXPLORATION_PROBABILITY,
    SELECTIVE_ROLLOUTS_PRECISION,
    SELECTIVE_ROLLOUTS_PREDICTED_FLAT,
    SELECTIVE_ROLLOUTS_SKIPPED_PROMPTS,
    SELECTIVE_ROLLOUTS_ZERO_SPREAD,
    SKIPPED_ROWS_FRACTION,
    STEP_TIME,
    TRUNCATION_KEPT_MASS,
    TRUNCATION_OUTSIDE_CUT_FRACTION,
    heldout_metric,
    reward_function_metric,
)
from .metric_record import Signal, Watched

__all__ = ["WATCHED"]

_HELDOUT_MEAN = heldout_metric("<metric>", "mean", "<k>")

WATCHED = (
    Watched(
        metrics=(REWARD, reward_function_metric("<func>")),
        what="mean total reward and each function's mean (TRL)",
        healthy="trends up",
        worrying="flat from the start: no learning signal (see below) or a reward bug",
        readme="mean total reward and each function's mean; should trend up",
        signal=Signal("reward", (REWARD,), ("plateau", "reward_drop", "reward_composition"), required=("plateau",)),
        console=(REWARD, "reward"),
    ),
    Watched(
        metrics=(REWARD_STD_GROUP_MEAN, REWARD_STD_GROUP_MIN, REWARD_STD_GROUP_MAX),
        what="std of the total reward inside each group of `num_generations` completions of one prompt (TRL's "
        "`reward_std` is over the whole batch)",
        healthy="clearly above 0",
        worrying="near 0: every completion of a prompt scores the same",
        readme="reward spread inside each group of completions of one prompt; near 0 means no learning signal",
        signal=Signal("reward spread in groups", (REWARD_STD_GROUP_MEAN,), ("no_spread", "reward_scale")),
        console=(REWARD_STD_GROUP_MEAN, "spread"),
    ),
    Watched(
        metrics=(FRAC_REWARD_ZERO_STD,),
        what='share of completions whose group has no reward spread (TRL; under `scale_rewards="batch"` or '
        "`normalize_then_sum` TRL tests the batch's std, not the groups')",
        healthy="well below 1",
        worrying="near 1: the prompts are too easy or too hard; change the data, or raise `num_generations` or "
        "`temperature`",
    ),
    Watched(
        metrics=(REWARD_STD_FRAC_ZERO_GROUPS,),
        what="share of groups with no reward spread, judged on each group whatever the scaling (rewards all equal, "
        "or fewer than two scored): what the alarms read",
        healthy="well below 1",
        worrying="near 1: as above",
        readme="share of groups with equal rewards (TRL's `frac_reward_zero_std` tests the batch under batch "
        "scaling); near 1: prompts too easy or too hard",
        signal=Signal(
            "groups without spread", (REWARD_STD_FRAC_ZERO_GROUPS, FRAC_REWARD_ZERO_STD), ("zero_std", "flat_groups")
        ),
    ),
    Watched(
        metrics=(FRAC_REWARD_UNSCORED,),
        what="share of completions that no reward function scored (each returned `None` or NaN for it; left out of "
        "their group's statistics, advantage 0)",
        healthy="0, or what the reward intends",
        worrying="a large share: a reward function that fails on many completions",
        readme="share of completions that no reward function scored (`None` or NaN)",
        signal=Signal("unscored completions", (FRAC_REWARD_UNSCORED,), ("unscored",), kind="count"),
    ),
    Watched(
        metrics=(KL,),
        what="mean over completion tokens of `exp(d) - d - 1`, distance to the reference (TRL's definition)",
        healthy="small, growing slowly",
        worrying="a jump by an order of magnitude: lower the learning rate or raise `beta`",
        readme="distance to the reference (mean `K`); small and growing slowly, a sudden jump is a warning",
        signal=Signal("KL to the reference", (KL,), ("kl_jump", "kl_high", "kl_growth")),
        console=(KL, "kl"),
    ),
    Watched(
        metrics=(LOSS_POLICY, LOSS_KL_PENALTY),
        also="(and `loss/entropy_bonus`, `loss/router` when on)",
        what="the loss split into `-mean(S)` and `beta * mean(K)` (per-sequence means with the default "
        "`loss_type`; each loss type's own aggregation otherwise); they add up to `loss`",
        healthy="see below",
        worrying="`loss/kl_penalty` dominating: `beta` too high for the task",
        readme="the loss split into `-mean(S)` and `beta * mean(K)`; they add up to `loss` (which may be negative or "
        "0 and still be fine)",
        signal=Signal("loss split", (LOSS_POLICY, LOSS), kind="shown"),
    ),
    Watched(
        metrics=(CLIP_RATIO_LOW_MEAN, CLIP_RATIO_HIGH_MEAN, CLIP_RATIO_REGION_MEAN),
        also="(and TRL's `low_min`, `high_max`)",
        what="share of completion tokens in the flat, zero-gradient part of the clipped surrogate (TRL's definitions)",
        healthy="0 on-policy; a few percent when batches are reused",
        worrying="persistently above ~0.2: updates are too big for `epsilon`; lower the learning rate or "
        "`num_iterations`",
        readme="share of tokens in the flat, zero-gradient part of the surrogate; 0 on-policy, persistently above "
        "~0.2 is too much",
        signal=Signal("clip fraction", (CLIP_RATIO_REGION_MEAN,), ("clip_fraction", "clip_asymmetry")),
        console=(CLIP_RATIO_REGION_MEAN, "clip"),
    ),
    Watched(
        metrics=(f"{RATIO_PREFIX}mean", f"{RATIO_PREFIX}std", RATIO_MIN, RATIO_MAX, RATIO_P05, RATIO_P50, RATIO_P95),
        what="distribution of the importance ratio `r = pi / pi_old` over completion tokens",
        healthy="exactly 1 on-policy; p05/p95 inside `[1 - epsilon, 1 + epsilon]`",
        worrying="p95 or max far outside the clip range (say 10x): the policy drifts between generation and "
        "update, or the sampler's log-probs disagree with the trainer's",
        readme="importance-ratio distribution over completion tokens (plus a TensorBoard histogram); 1 on-policy, "
        "p05/p95 inside the clip range",
        signal=Signal("importance ratio", (RATIO_P95,), ("ratio_p95", "ratio_max")),
        console=(RATIO_P95, "ratio p95"),
    ),
    Watched(
        metrics=(RATIO_NAN_COUNT,),
        what="completion tokens whose log ratio is NaN (logged only when there are any)",
        healthy="absent",
        worrying="present: non-finite log-probs at unmasked positions",
        signal=Signal("NaN log ratios", (RATIO_NAN_COUNT,), kind="count"),
    ),
    Watched(
        metrics=(ENTROPY,),
        what="mean per-token entropy of the policy (TRL)",
        healthy="decreases slowly",
        worrying="collapses early: the policy stops exploring; lower the learning rate or raise `temperature`",
        readme="policy entropy (TRL); an early collapse is a warning",
        signal=Signal("entropy", (ENTROPY,), ("entropy_collapse",)),
        console=(ENTROPY, "entropy"),
    ),
    Watched(
        metrics=(COMPLETIONS_MEAN_LENGTH,),
        what="mean completion length (TRL)",
        healthy="stable or explained by the task",
        worrying="drifting with the reward: the reward may be paying for length",
        readme="mean completion length (TRL); growing with the reward is a warning",
        signal=Signal(
            "completion length",
            (COMPLETIONS_MEAN_LENGTH,),
            ("truncation", "truncation_sustained", "length_drift", "length_growth", "length_in_group"),
        ),
        console=(COMPLETIONS_MEAN_LENGTH, "len"),
    ),
    Watched(
        metrics=(COMPLETIONS_CLIPPED_RATIO,),
        what="share of completions that reached `max_completion_length` without an end-of-sequence token (TRL)",
        healthy="small",
        worrying="most of them: the rewards judge cut-off text; raise `max_completion_length`",
    ),
    Watched(
        metrics=(REWARD_LENGTH_CORR,),
        what="correlation of completion length (tokens) and total reward inside groups: each group centred on its "
        "own means, then one Pearson correlation over every completion of the log window (groups without reward "
        "spread are left out: their advantage is 0 and they push no length either way; a group split over "
        "processes is centred on the part each process holds)",
        healthy="near 0, or what the task explains",
        worrying="close to 1: the longer completions of a prompt score higher, so the advantages push towards length",
    ),
    Watched(
        metrics=(
            DYNAMIC_SAMPLING_KEPT_FRACTION,
            DYNAMIC_SAMPLING_ROUNDS,
            DYNAMIC_SAMPLING_GENERATED_GROUPS,
            DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
            DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH,
            DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO,
        ),
        what="with `dynamic_sampling=True`: informative groups / generated groups, extra generation rounds, groups "
        "generated, TRL's zero-spread fraction of everything generated, the mean length and truncated share of the "
        "batch that trains ([sampling.md](sampling.md#metrics)); TRL's reward metrics then describe the batch that "
        "trains, `completions/*` every round",
        healthy="`rounds` below the limit",
        worrying="`rounds` at `dynamic_sampling_max_rounds` with `frac_reward_zero_std` above 0: batches stay short "
        "of informative groups",
    ),
    Watched(
        metrics=(FORWARD_PADDING_FRACTION,),
        what="share of the tokens TRL's padded layout forwards for the training micro-batch that are padding "
        "(logged with `padding_free` on or off: what packing saves)",
        healthy="high with long-tailed completion lengths",
        worrying="-",
    ),
    Watched(
        metrics=(FORWARD_REPEATED_PROMPT_FRACTION,),
        what="share of those tokens that repeat a prompt already in the micro-batch (`num_generations` rows per "
        "prompt): what `shared_prompt_forward` saves",
        healthy="about `(G - 1) / G` of the prompt share",
        worrying="-",
    ),
    Watched(
        metrics=(FORWARD_TOKENS_PER_DISTINCT,),
        what="tokens of the padded layout per distinct token (each prompt once, real tokens only): the work a "
        "padded, prompt-repeating forward does per useful token",
        healthy="1 is no waste",
        worrying="-",
    ),
    Watched(
        metrics=(SKIPPED_ROWS_FRACTION,),
        what="with `skip_zero_advantage_rows=True`: share of rows left out of the training forward (zero advantage "
        "or no completion token); `entropy` and `ratio/*` then cover the trained rows only "
        "([sampling.md](sampling.md#skipping-zero-advantage-rows))",
        healthy="about `frac_reward_zero_std`",
        worrying="-",
    ),
    Watched(
        metrics=(NONFINITE_SKIPPED_STEPS,),
        what="optimizer steps the non-finite guard dropped so far ([reliability.md](reliability.md))",
        healthy="0",
        worrying="growing: the loss or gradients turn NaN/inf",
        readme="optimizer steps whose NaN/inf gradient the guard kept off the weights",
        signal=Signal("skipped non-finite steps", (NONFINITE_SKIPPED_STEPS,), kind="count"),
    ),
    Watched(
        metrics=(GRAD_NORM, LEARNING_RATE),
        what="from transformers",
        healthy="steady",
        worrying="spikes in `grad_norm` precede collapses",
        readme="from transformers; spikes in `grad_norm` precede collapses",
        signal=Signal("gradient norm", (GRAD_NORM,), ("grad_norm_spike", "no_gradient", "vanishing_gradient")),
    ),
    Watched(
        metrics=(STEP_TIME,),
        what="seconds of one optimizer step, generation and every gradient-accumulation micro-step included, averaged "
        "over the log step (TRL; not judged: a slower step is a cost, not a run that stops learning)",
        healthy="steady after the first steps, or growing with `completions/mean_length`",
        worrying="growing while the completions do not: the host slows down (memory pressure, a throttled device)",
    ),
    Watched(
        metrics=(f"{ALARMS_PREFIX}<name>",),
        what="how many times that alarm was given so far, logged from its first time on "
        "([alarms](#alarms-anomaly-warnings))",
        healthy="absent",
        worrying="present",
    ),
    Watched(
        metrics=(heldout_metric("<metric>", "mean", "<n>"), heldout_metric("<metric>", "pass", "<k>")),
        what="held-out metrics, independent of the reward ([below](#held-out-evaluation-during-training))",
        healthy="follow the reward up",
        worrying="falling while `reward` rises: the reward is being hacked",
        readme="held-out metrics, independent of the reward; falling while `reward` rises: the reward is hacked",
        signal=Signal("held-out metric", (_HELDOUT_MEAN,), ("reward_vs_heldout",)),
    ),
    Watched(
        metrics=tuple(f"{IMPORTANCE_SAMPLING_RATIO_RAW}/{q}" for q in ("min", "p05", "p50", "p95", "max", "mean")),
        table="metrics-sampler",
        what="the distribution of `w` before any truncation or masking, per token (per sequence, the product over "
        "its tokens, with a `sequence_*` mode)",
        healthy="within a few percent of 1",
        worrying="a tail far from 1: the sampler's distribution is not the trainer's",
    ),
    Watched(
        metrics=(f"{IMPORTANCE_SAMPLING_RATIO_RAW}/outside_fraction",),
        table="metrics-sampler",
        what="share of tokens (sequences) outside `[vllm_importance_sampling_clip_min, "
        "vllm_importance_sampling_clip_max]`: what the correction truncates or masks (or would, when off)",
        healthy="small",
        worrying="large: the correction discards or flattens much of the batch",
    ),
    Watched(
        metrics=(f"{IMPORTANCE_SAMPLING_RATIO_RAW}/ess",),
        table="metrics-sampler",
        what="effective sample size of the raw weights over their number, `(sum w)^2 / (N sum w^2)`, in `(0, 1]`",
        healthy="near 1",
        worrying="well below 1: a few tokens (sequences) carry most of the weight",
    ),
    Watched(
        metrics=(IMPORTANCE_SAMPLING_RATIO_ESS,),
        table="metrics-sampler",
        what="the same for the weights the correction applies (after truncation or masking, masked ones counting "
        "as 0); only with the correction on",
        healthy="near 1",
        worrying="low: much of the batch masked out",
    ),
    Watched(
        metrics=(SAMPLER_K3_KL,),
        table="metrics-sampler",
        what="mean over the tokens the sampler scored of `exp(d) - d - 1`, `d = trainer_logp - sampler_logp`: the "
        "k3 estimate of KL(sampler ‖ trainer)",
        healthy="about 1e-3 or less",
        worrying="growing: the sampler drifts from the trainer (weights not synced, precision)",
    ),
    Watched(
        metrics=(TRUNCATION_KEPT_MASS,),
        table="metrics-sampler-cuts",
        what="the trainer's mean kept mass `S` over completion tokens: the factor stock TRL's ratio would carry",
        healthy="any value: it describes the cut",
        worrying="-",
    ),
    Watched(
        metrics=(TRUNCATION_OUTSIDE_CUT_FRACTION,),
        table="metrics-sampler-cuts",
        what="share of sampled tokens that the trainer's own cut drops (the engine and the trainer disagree about a "
        "token at the boundary; counted as kept)",
        healthy="about 1% or less",
        worrying="large: the engine's logits are far from the trainer's (weights not synced, precision)",
    ),
    Watched(
        metrics=(DYNAMIC_SAMPLING_KEPT_FRACTION,),
        table="metrics-dynamic-sampling",
        what="informative groups / generated groups, over every round",
    ),
    Watched(
        metrics=(DYNAMIC_SAMPLING_ROUNDS,),
        table="metrics-dynamic-sampling",
        what="extra rounds generated (0 to `dynamic_sampling_max_rounds`)",
    ),
    Watched(
        metrics=(DYNAMIC_SAMPLING_GENERATED_GROUPS,),
        table="metrics-dynamic-sampling",
        what="groups generated, every round included (divided by the groups of a generation batch: groups "
        "generated per group trained)",
    ),
    Watched(
        metrics=(DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,),
        table="metrics-dynamic-sampling",
        what="TRL's `frac_reward_zero_std` over everything generated (rounds weighted by their size)",
    ),
    Watched(
        metrics=(DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH, DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO),
        table="metrics-dynamic-sampling",
        what="TRL's `completions/mean_length` and `completions/clipped_ratio` of the batch that trains (the alarms "
        "pair these with its reward)",
    ),
    Watched(
        metrics=(SELECTIVE_ROLLOUTS_SKIPPED_PROMPTS,),
        table="metrics-selective-rollouts",
        what="prompts skipped (all processes, every round of the batch)",
    ),
    Watched(
        metrics=(SELECTIVE_ROLLOUTS_PREDICTED_FLAT,),
        table="metrics-selective-rollouts",
        what="the share of the prompts considered that were predicted flat",
    ),
    Watched(
        metrics=(SELECTIVE_ROLLOUTS_PRECISION,),
        table="metrics-selective-rollouts",
        what="of the prompts predicted flat and explored anyway, the share whose group had no spread: how often a "
        "skip would have been right (logged when some were explored)",
    ),
    Watched(
        metrics=(SELECTIVE_ROLLOUTS_ZERO_SPREAD,),
        table="metrics-selective-rollouts",
        what="the realised share of generated groups without spread (every round), which `p` steers towards the "
        "target",
    ),
    Watched(
        metrics=(SELECTIVE_ROLLOUTS_EXPLORATION_PROBABILITY,),
        table="metrics-selective-rollouts",
        what="the `p` the batch was decided with",
    ),
)
