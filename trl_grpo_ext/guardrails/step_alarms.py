"""The alarm records on a step's values, the first part of `ALARMS`: the learning signal (reward spread, scoring,
the gradient), truncation, clipping, the importance ratio and the KL's level. Each record is the one place of its
alarm: rule, threshold field, default, range, help, and its row of docs/diagnostics.md's table.
"""

from __future__ import annotations

import math

from ..metrics import RATIO_MAX, RATIO_P95
from .alarm import Alarm
from .step_rules import (
    ClipFractionRule,
    KLHighRule,
    KLJumpRule,
    NoGradientRule,
    NoSpreadRule,
    RatioRule,
    SustainedTruncationRule,
    TruncationRule,
    UnscoredRule,
    ZeroStdRule,
)

__all__ = ["STEP_ALARMS"]

#: The records, in `ALARMS` order.
STEP_ALARMS: tuple[Alarm, ...] = (
    Alarm(
        name="zero_std",
        rule=ZeroStdRule,
        field="warn_zero_std_fraction",
        default=0.9,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm zero_std: at least this share of completions is in groups with equal rewards (judged on the "
        "groups themselves, whatever scale_rewards): no learning signal from them.",
        given_when="the share of groups without reward spread (`reward_std/frac_zero_groups`; TRL's "
        "`frac_reward_zero_std` where that is not logged) is at least this: most completions are in groups with equal "
        "rewards, no learning signal",
        suggests="prompts neither too easy nor too hard, more `num_generations` or `temperature`, a reward with "
        "partial credit",
    ),
    Alarm(
        name="no_spread",
        rule=NoSpreadRule,
        field="warn_no_spread_steps",
        default=3,
        low=1,
        high=math.inf,
        low_inclusive=True,
        high_inclusive=False,
        help="Alarm no_spread: every group has equal rewards for this many log steps in a row (nothing is "
        "learned); the warning says whether truncation (completions/clipped_ratio) is the cause.",
        given_when="every group had equal rewards (the share above is 1) for this many log steps in a row: nothing is "
        "learned. The warning names truncation as the likely cause when 90% or more of those steps' completions were "
        "cut (`completions/clipped_ratio`; under dynamic sampling the trained batch's "
        "`dynamic_sampling/trained_clipped_ratio`), says it is not the cause otherwise, and unknown when that metric "
        "was not logged",
        suggests="`max_completion_length` (truncation); otherwise check that the reward function does not return a "
        "constant, then the prompts, `num_generations`, `temperature`",
        whole=True,
    ),
    Alarm(
        name="unscored",
        rule=UnscoredRule,
        field="warn_unscored_fraction",
        default=0.5,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm unscored: at least this share of completions was scored by no reward function "
        "(frac_reward_unscored), or a reward function scored no completion (all None or NaN) for "
        f"{UnscoredRule.WINDOW} log steps in a row.",
        given_when="at least this share of completions was scored by no function (`frac_reward_unscored`), or a "
        "reward function scored no completion for 10 log steps in a row (`rewards/<name>/mean` is NaN: every reward "
        "`None` or NaN; the warning names it). One silent step is no alarm: a function that returns `None` for the "
        "prompts of other tasks (TRL's pattern for multi-task rewards) is silent at a step without its task, while "
        "the other functions score those completions",
        suggests="check the function on a few completions: a parser that never matches returns `None` for everything",
    ),
    Alarm(
        name="no_gradient",
        rule=NoGradientRule,
        field="warn_zero_grad_steps",
        default=3,
        low=1,
        high=math.inf,
        low_inclusive=True,
        high_inclusive=False,
        help="Alarm no_gradient: grad_norm is exactly 0 for this many log steps in a row (no update moves the "
        "weights).",
        given_when="`grad_norm` is exactly 0 for this many log steps in a row: no update moves the weights",
        suggests="every advantage is 0 (no spread, nothing scored), every token clipped, or no trainable parameter "
        "gets a gradient",
        whole=True,
    ),
    Alarm(
        name="truncation",
        rule=TruncationRule,
        field="warn_truncated_fraction",
        default=0.5,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm truncation: at least this share of completions reached max_completion_length without an "
        "end-of-sequence token (TRL's completions/clipped_ratio).",
        given_when="`completions/clipped_ratio` is at least this: most completions were cut at "
        "`max_completion_length`",
        suggests="a larger `max_completion_length`, or shorter answers (a system prompt, a format reward)",
    ),
    Alarm(
        name="truncation_sustained",
        rule=SustainedTruncationRule,
        field="warn_truncated_sustained",
        # A note from 5% cut, a warning from 15%, as rl-doctor grades truncation, but over 5 log steps in a row:
        # the demo stays below 2% (logged every 10 steps over 400), the quickstart below 4% (its 4 log steps).
        default=0.05,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm truncation_sustained: at least this share of completions was truncated "
        f"(completions/clipped_ratio) at each of {SustainedTruncationRule.WINDOW} log steps in a row: a note, "
        f"a warning from {SustainedTruncationRule.SEVERE:g} times this share.",
        given_when="the truncated share (`completions/clipped_ratio`; under dynamic sampling the trained batch's "
        "`dynamic_sampling/trained_clipped_ratio`) is at least this at each of 5 log steps in a row, in two tiers: a "
        "`note`, and a `warning` once every step of the streak is at 3 times the threshold (15% by default), a new "
        "episode when it rises to it. rl-doctor grades truncation the same way (5%, 15% severe), from one step; a "
        "streak keeps one batch with a few long answers from counting. The demo stays below 2%, the quickstart below "
        "4%",
        suggests="the same",
    ),
    Alarm(
        name="clip_fraction",
        rule=ClipFractionRule,
        field="warn_clip_fraction",
        default=0.2,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm clip_fraction: clip_ratio/region_mean stays above this for warn_patience log steps.",
        given_when="`clip_ratio/region_mean` stays above the threshold for `warn_patience` log steps in a row",
        suggests="a lower `learning_rate` or `num_iterations`, or a wider `epsilon`",
    ),
    Alarm(
        name="ratio_p95",
        rule=RatioRule,
        field="warn_ratio_p95",
        default=1.5,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm ratio_p95: the 95th percentile of the importance ratio exceeds this.",
        given_when="`ratio/p95` exceeds it (or is not finite)",
        suggests="a lower `learning_rate` or `num_iterations`; with vLLM, check it samples with the trainer's weights "
        "and settings",
        rule_options={"key": RATIO_P95},
    ),
    Alarm(
        name="ratio_max",
        rule=RatioRule,
        field="warn_ratio_max",
        default=100.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm ratio_max: the largest importance ratio exceeds this.",
        given_when="`ratio/max` exceeds it (or is not finite)",
        suggests="the same",
        rule_options={"key": RATIO_MAX},
    ),
    Alarm(
        name="kl_jump",
        rule=KLJumpRule,
        field="warn_kl_jump",
        default=10.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm kl_jump: kl exceeds this factor times the median of its previous 10 logged values (judged "
        "once 5 are there; a median below 0.01 counts as 0.01).",
        given_when="`kl` exceeds this factor times the median of its previous logged values (the last 10; judged once "
        "5 are there; a median below 0.01 counts as 0.01)",
        suggests="a lower `learning_rate`, a higher `beta`, or check the rewards for hacking",
    ),
    Alarm(
        name="kl_high",
        rule=KLHighRule,
        field="warn_kl_max",
        # Healthy demo runs stay below 0.45 (docs/diagnostics.md's example); a learning rate 10x too high reaches
        # 3 within 10 steps, 100x too high 6.7 at step 2, before `kl_jump` has the 5 values it compares with.
        default=1.0,
        low=0.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm kl_high: kl (mean per token) exceeds this, or is not finite.",
        given_when="`kl` exceeds it (or is not finite): a blow-up seen from its first log step, where `kl_jump` needs "
        "5 values first. Healthy demo runs stay below 0.45; a learning rate 10x too high reaches 3 within 10 steps",
        suggests="the same",
    ),
)
