"""The alarm records on the run's course, the second part of `ALARMS`: what grows, drifts, collapses or stops
improving over the logged history (the KL, entropy, the gradient norm, the length, the held-out metric, the reward
and its functions' shares).
Each record is the one place of its alarm: rule, threshold field, default, range, help, and its row of
docs/diagnostics.md's table.
"""

from __future__ import annotations

import math

from .alarm import Alarm
from .progress_rules import FlatGroupsRule, PlateauRule, RewardCompositionRule, RewardDropRule
from .step_rules import ClipAsymmetryRule
from .trend_rules import (
    EntropyCollapseRule,
    GradNormSpikeRule,
    KLGrowthRule,
    LengthDriftRule,
    LengthGrowthRule,
    LengthInGroupRule,
    RewardScaleRule,
    RewardVsHeldoutRule,
    VanishingGradientRule,
)

__all__ = ["COURSE_ALARMS"]

#: The records, in `ALARMS` order.
COURSE_ALARMS: tuple[Alarm, ...] = (
    Alarm(
        name="kl_growth",
        rule=KLGrowthRule,
        field="warn_kl_growth",
        # The peers' KL blow-ups (rl-doctor's and rlprobe's, one log step per training step) are flagged at steps
        # 85-86 and 303-307 over 10 seeds, no later than rlprobe (114-121, 308-313) and long before kl_high (213,
        # 424); rlprobe's grows 2.2x per 50 steps: with 2.5 it is flagged at steps 309-344, after rlprobe. No
        # healthy peer run over 10 seeds (rl-doctor's linear KL grows at most 1.7x over 50 steps above the floor),
        # nor the demo logged at every step (1.7x at most; logged every 10 steps its 40 entries are fewer than the
        # 70 judged from).
        default=2.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help=f"Alarm kl_growth: the median kl of the last {KLGrowthRule.SMOOTH} log steps is at least this many "
        f"times its median {KLGrowthRule.LAG} log steps earlier, at least the square root of this times its "
        f"median {KLGrowthRule.LAG // 2} log steps earlier, and at least {KLGrowthRule.FLOOR:g}, from a step where "
        f"the KL accelerates (the KL keeps growing; judged from the {KLGrowthRule.LAG + KLGrowthRule.SMOOTH}th "
        "logged kl).",
        given_when="the KL keeps growing, faster and faster: the median `kl` of the last 20 log steps is at least "
        "this many times its median 50 log steps earlier, at least the square root of this (1.41) times its median 25 "
        "log steps earlier, and at least 0.1 (judged from the 70th logged `kl`); an episode starts where the KL "
        "accelerates: the curvature of a quadratic fitted to its last 70 values is positive by at least 3 standard "
        "errors (it goes on while the growth holds). Every run's KL rises from 0 and stops, a straight line at best: "
        "medians lag it, and without the curvature rises from 0 ending between steps 60 and 100 were flagged in 19-20 "
        "of 20 simulated runs (10-15 ending at 50); with it none (levels 0.2-0.5, noise 10% and 30% per step: "
        "`tests/test_guardrails_progress.py`). A blow-up seen before `kl_high`'s level and without the single jump "
        "`kl_jump` needs: the peers' blow-ups (one log step per training step) are flagged at steps 85-86 and 303-307 "
        "over 10 seeds, where rlprobe flags them at 114-121 and 308-313 and `kl_high` at about 213 and 424; rlprobe's "
        "grows 2.2x per 50 steps: with 2.5 it is flagged at steps 309-344, after rlprobe. The floor: a KL growing "
        "linearly from near 0 doubles over any 50 steps while small (rl-doctor's healthy run while below 0.086; above "
        "0.1 at most 1.7x over 10 seeds). No healthy peer run over 10 seeds; the demo logged at every step grows at "
        "most 1.7x (the median over 20, not 10, log steps takes in its rise from 0 and its noise), and logged every "
        "10 steps its 40 entries are fewer than the 70 judged from. A quadratic blow-up (rl-doctor's) slows below "
        "1.41x per 25 steps near a KL of 0.8, where its episode may end and start again until `kl_high` fires",
        suggests="the same",
    ),
    Alarm(
        name="entropy_collapse",
        rule=EntropyCollapseRule,
        field="warn_entropy_collapse",
        default=0.1,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm entropy_collapse: entropy falls below this fraction of the mean of its first 3 logged values.",
        given_when="`entropy` falls below this fraction of the mean of its first 3 logged values: the policy stopped "
        "exploring",
        suggests="a higher `temperature`, a lower `learning_rate`, a wider `epsilon_high` (clip-higher, e.g. 0.28), "
        "an entropy bonus (`entropy_coef`)",
    ),
    Alarm(
        name="grad_norm_spike",
        rule=GradNormSpikeRule,
        field="warn_grad_norm_spike",
        default=10.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm grad_norm_spike: grad_norm exceeds this factor times the median of its previous 20 logged "
        "values (judged once 5 are there; a median below 1e-3 counts as 1e-3), or is not finite (but at a step "
        "the non-finite guard skipped, counted in nonfinite/skipped_steps).",
        given_when="`grad_norm` exceeds this factor times the median of its previous logged values (the last 20 above "
        "1e-3, judged once 5 are there: steps without gradient say nothing of its usual size), or is not finite. A "
        "NaN norm at a step the non-finite guard skipped (`nonfinite/skipped_steps` rose since the last entry) is no "
        "spike: that update never reached the weights, and the guard's own warning and count report it (`report`: a "
        "`note` on the skipped non-finite steps, a `FAIL` when every logged `grad_norm` is NaN); with "
        '`nonfinite_policy="off"` it is one',
        suggests="a lower `learning_rate`, a (lower) `max_grad_norm`, a higher `beta`",
    ),
    Alarm(
        name="length_drift",
        rule=LengthDriftRule,
        field="warn_length_drift_corr",
        default=0.9,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm length_drift: over the last 10 log steps (judged from 6) the reward rose, "
        "completions/mean_length changed by at least a fifth, and the two correlate at least this much "
        "(absolute Pearson correlation).",
        given_when="over the last 10 log steps that carry both (judged from 6): the reward rose (mean of the second "
        "half above the first half's), the mean completion length (`completions/mean_length`; under dynamic sampling "
        "the trained batch's) changed by 20% or more between the halves, and the absolute correlation of reward and "
        "length is at least this",
        suggests="check the reward on long and short completions; cap or penalise length in the reward, or a lower "
        "`max_completion_length`",
    ),
    Alarm(
        name="length_growth",
        rule=LengthGrowthRule,
        field="warn_length_growth",
        # The demo's length stays within 6% of its start over 400 steps (5.75 to 6.17 tokens); a run whose length
        # grows 203 -> 707 tokens over its course is flagged once it is half as long again as at its start. A
        # task that rewards longer reasoning can raise it.
        default=0.5,
        low=0.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help=f"Alarm length_growth: the median completions/mean_length of the last {LengthGrowthRule.RECENT} log "
        f"steps exceeds that of the run's first {LengthGrowthRule.BASELINE} by at least this fraction (1.0: it "
        f"doubled; judged from the {LengthGrowthRule.BASELINE + LengthGrowthRule.RECENT}th log step).",
        given_when="the median mean completion length (`completions/mean_length`; under dynamic sampling the trained "
        "batch's) of the last 5 log steps exceeds the median of the run's first 5 by at least this fraction (judged "
        "from the 10th log step, when the two windows no longer overlap; one long or short step moves neither "
        "median): a growth over the whole run, too slow for `length_drift`'s 10-step window (203 -> 707 tokens over a "
        "run is flagged once the length is half as long again as at its start). The demo's length stays within 6% of "
        "its start over 400 steps; a task that rewards longer reasoning can raise it",
        suggests="check the reward on long and short completions; cap or penalise length in the reward; watch "
        "`completions/clipped_ratio`",
    ),
    Alarm(
        name="length_in_group",
        rule=LengthInGroupRule,
        field="warn_length_group_corr",
        default=0.8,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm length_in_group: inside groups, completion length and reward correlate at least this much "
        "(reward_length_corr/within_group, logged with log_diagnostics).",
        given_when="`reward_length_corr/within_group` is at least this: inside groups the longer completions score "
        "higher",
        suggests="the same",
    ),
    Alarm(
        name="reward_vs_heldout",
        rule=RewardVsHeldoutRule,
        field="warn_heldout_drop",
        default=0.1,
        low=0.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm reward_vs_heldout: a logged held-out metric (heldout/<metric>/mean@<k>) falls by this "
        "fraction of its best value, and by more than the evaluation's noise ("
        f"{RewardVsHeldoutRule.NOISE_SE:g} standard errors of the difference where the evaluation's sample "
        "size is logged, heldout/<metric>/scored@<k>; else as many standard deviations of the differences between "
        "its successive evaluations), while the training reward is above its level at that best.",
        given_when="a held-out metric `heldout/<metric>/mean@<k>` (logged by held-out evaluation during training, in "
        "any entry) is below its best so far by at least this fraction of that best and, where the evaluation logged "
        "its sample size (`heldout/<metric>/scored@<k>`, `n` completions), by more than 3 standard errors of the "
        "difference, `3 * sqrt(p_best (1 - p_best) / n_best + p (1 - p) / n)` (the binomial variance, the largest a "
        "[0, 1] score with that mean can have). 3, not 2: the best is the highest of every evaluation, lucky by its "
        "noise, and with 2 a run whose accuracy did not move fired in 40% to 80% of simulated runs of 10 to 20 "
        "evaluations (3: 5% to 20%); 0.6 -> 0.3 over 50 completions (3.2 standard errors) is still flagged. Without a "
        "logged sample size (a stock or older run) or for a mean outside [0, 1], the series' own spread is the noise: "
        "3 standard deviations of the differences between its successive evaluations before this one, judged from "
        "the 6th evaluation (a trend moves every difference alike). The relative drop alone flagged rl-doctor's "
        "healthy run evaluated every 25 steps in 7 of 10 seeds (0.214 -> 0.183 at step 101); with its spread none, "
        "and its reward-hacking run in all 10 (`tests/test_health_scenarios.py`). All while the training reward (mean "
        "of its last 3 logged values) is above its level at that best: reward hacking",
        suggests="read completions for loopholes the reward pays for, a higher `beta`, keep the best checkpoint "
        "(`metric_for_best_model`, `load_best_model_at_end`)",
    ),
    Alarm(
        name="reward_scale",
        rule=RewardScaleRule,
        field="warn_reward_scale",
        # rlwatch's reward-variance explosion (0.5 to 5.4, 10x) is flagged within 3 steps of the jump; a 0/1 reward
        # learned from a pass rate of 0.5-5% to 60% over 20-100 steps (a 15-fold growth of its spread) never, logged
        # every step or every 10 (tests/test_guardrails_progress.py).
        default=4.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm reward_scale: the reward's spread (reward_std/group_mean, else reward_std) over the last "
        f"{RewardScaleRule.RECENT} steps is at least this many times its largest over the "
        f"{RewardScaleRule.HISTORY} steps before (at least {RewardScaleRule.MIN_HISTORY} log entries, a steady "
        "history): the reward's scale changed.",
        given_when="the reward's spread (`reward_std/group_mean`, else TRL's `reward_std`), its median over the last "
        "3 steps (at least one log entry), is at least this many times its largest over the 20 steps before (at least "
        "10 log entries), that history steady (above 0, its largest at most 3 times its median): an abrupt jump "
        "against its own recent history. Learning a bounded reward moves its spread slowly and within bounds (a 0/1 "
        "reward's inside a group of 8 cannot exceed 0.53); a spread that multiplies within a few steps and stays is "
        "a reward whose scale changed. rlwatch's scenario (0.5 to 5.4 at step 110) is flagged within 3 steps of the "
        "jump (at the first entry holding it, logged every 10 steps); a 0/1 reward learned from a pass rate of 0.5-5% "
        "to 60% over 20 to 100 steps (its spread growing about 15-fold) never, logged every step or every 10 "
        "(`tests/test_guardrails_progress.py`); learned within 10 steps from 0.5%, it is flagged logged every 10",
        suggests="check the reward functions for a change of scale (an edit, a reward model swapped, outlier "
        "scores) and `reward_weights`; with several functions the one whose scale grew outweighs the others, with "
        '`scale_rewards="none"` the advantages grew as much',
    ),
    Alarm(
        name="vanishing_gradient",
        rule=VanishingGradientRule,
        field="warn_grad_norm_vanish",
        # The healthy peer scenarios' grad_norm stays above half its start (rl-doctor's decays to 55%, rlprobe's
        # is flat); rl-doctor's too-hard run (advantages collapsing) falls below a fifth about step 277 of 400
        # and to 11% at its end, so 0.1 would miss it.
        default=0.2,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm vanishing_gradient: the median grad_norm of the last "
        f"{VanishingGradientRule.RECENT} log steps is above 0 and below this fraction of the median of its first "
        f"{VanishingGradientRule.BASELINE} values above 0 (no_gradient catches an exact 0).",
        given_when="the median `grad_norm` of the last 5 log steps is above 0 and below this fraction of the median "
        "of its first 5 values above 0: the updates shrink to nothing without stopping (`no_gradient` catches an "
        "exact 0). The healthy peer scenarios stay above half their start; rl-doctor's too-hard run falls below a "
        "fifth about step 277 of 400 (to 11% at its end: 0.1 would miss it)",
        suggests="check the reward spread (advantages near 0 everywhere), the loss's scale (`loss_type`, a gradient "
        "accumulation or scaling bug), whether most tokens are clipped",
    ),
    Alarm(
        name="clip_asymmetry",
        rule=ClipAsymmetryRule,
        field="warn_clip_asymmetry",
        # rl-doctor's healthy run clips about as much on each side (1.1-1.2x), its entropy-collapse and
        # clip-saturation runs 3-11x more below than above (flagged from steps 5-28).
        default=3.0,
        low=1.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm clip_asymmetry: clip_ratio/low_mean or clip_ratio/high_mean is at least this many times "
        f"the other (counted as at least {ClipAsymmetryRule.FLOOR:g}), the larger at least "
        f"{ClipAsymmetryRule.MIN_CLIPPED:g}, at each of {ClipAsymmetryRule.WINDOW} log steps in a row.",
        given_when="`clip_ratio/low_mean` or `clip_ratio/high_mean` is at least this many times the other (counted as "
        "at least 0.005), the larger at least 0.05, at each of 5 log steps in a row: one side of the clip range does "
        "the clipping. rl-doctor's healthy run clips about evenly (1.1-1.2x), its entropy-collapse and "
        "clip-saturation runs 3-11x more below (flagged from steps 5-28)",
        suggests="mostly high: widen `epsilon_high` (clip-higher, e.g. 0.28), a lower `learning_rate`; mostly low: a "
        "lower `learning_rate` or `num_iterations`, a wider `epsilon`",
    ),
    Alarm(
        name="flat_groups",
        rule=FlatGroupsRule,
        field="warn_flat_groups",
        # rlprobe's degenerate-groups scenario (a share rising to 75%) is flagged about step 460 of 500,
        # rl-doctor's too-easy and too-hard runs at about steps 230 and 10, no healthy peer scenario (at most
        # 20%); the demo ends at 44% of groups without spread. 50% also flags rl-doctor's reward-hacking run.
        default=0.6,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm flat_groups (a note): at least this share of groups has no reward spread at each log step of "
        f"the last {FlatGroupsRule.WINDOW} steps (at least {FlatGroupsRule.MIN_WINDOW} log entries); the warning "
        "says whether they are too easy or too hard where every reward lies in [0, 1].",
        given_when="a `note`: the share of groups without reward spread (as `zero_std` reads it) is at least this at "
        "each log step of the last 10 training steps (at least 3 log entries: 10 at one entry per step, 3 at one per "
        "10 or 50, each a mean over its steps). Where every logged `reward` lies in [0, 1], the warning says which "
        "way they are flat, from the mean reward `r` and the flat share `z`: at least `r - (1 - z)` of the groups "
        "scored the maximum on every completion (too easy), at least `z - r` the minimum (too hard), the larger "
        "naming the side. rlprobe's degenerate-groups scenario (rising to 75%) is flagged about step 460 of 500, "
        "rl-doctor's too-easy and too-hard runs at about steps 230 and 10, no healthy peer scenario (at most 20%); "
        "the demo ends at 44%",
        suggests="too easy: harder prompts, or `dynamic_sampling=True`; too hard: easier prompts, more "
        "`num_generations` or `temperature`, partial credit",
    ),
    Alarm(
        name="plateau",
        rule=PlateauRule,
        field="warn_plateau_steps",
        # rl-doctor's plateau scenario (reward flat from about step 100 of 400, one entry per step) is flagged at
        # steps 262-377 over 10 seeds; its healthy scenario (still rising slowly at its end) never, nor rlprobe's,
        # which converges (93% of its final reward at step 450 of 500) and was flagged at step 456 of one seed of
        # 10 with 100. Training steps, not log steps: a run logged every 10 steps is judged as one logged at every
        # step (tests/test_health_scenarios.py).
        default=150,
        low=1,
        high=math.inf,
        low_inclusive=True,
        high_inclusive=False,
        help="Alarm plateau (a note): the reward's running median (over "
        f"{PlateauRule.SMOOTH} steps, at least {PlateauRule.MIN_SMOOTH} log entries) has not risen above its best "
        "by more than its noise for this many training steps (and at least "
        f"{PlateauRule.MIN_PATIENCE} log entries): the run converged or stopped learning.",
        given_when="a `note`: the reward's running median (over 10 steps, at least 5 log entries: 10 at one entry "
        "per step, 5 at one per 10 or 50) has not risen above its best by more than 1.75 standard errors of such a "
        "median for this many training steps (at least 4 log entries): a run whose reward never improves is a plateau "
        "from its start. Steps, not log entries: a run logged every 10 steps is judged as one logged at every step "
        "(the standard error is that of a 10-step median logged step by step, from the scatter of the reward's "
        "successive differences, which a trend does not inflate). Until the reward gained 3 standard errors over its "
        "first running median, or plateaued, the run is too short to judge (`report`'s `short`). rl-doctor's "
        "plateau scenario (flat from about step 100 of 400) is flagged at steps 262-377 over 10 seeds logged at every "
        "step, 260-400 logged every 10; no healthy peer run, logged every 1, 10 or 50 steps "
        "(`tests/test_health_scenarios.py`); with 100, rlprobe's healthy run (93% of its final reward at step 450 of "
        "500) was flagged once in 10 seeds",
        suggests="if the held-out metric is flat too, stop the run (it converged) or change what limits it: harder "
        "prompts, a higher `learning_rate`, more `num_generations` or `temperature`",
        whole=True,
    ),
    Alarm(
        name="reward_drop",
        rule=RewardDropRule,
        field="warn_reward_drop",
        # Half of the gain given back, beyond the noise of the running medians: no healthy peer scenario (each
        # rises to its end) and none of the other sick ones but rlprobe's format gaming, whose reward halves at
        # the pathology's onset (step 256 of 500). rlwatch's reward drift warns on any monotone run of 50 steps,
        # learning included; a fall from the best is the drift that is no learning.
        default=0.5,
        low=0.0,
        high=math.inf,
        low_inclusive=False,
        high_inclusive=False,
        help="Alarm reward_drop: the reward's running median (over "
        f"{RewardDropRule.SMOOTH} log steps) fell from its best by at least this fraction of its gain since the "
        f"run's start, by more than {RewardDropRule.NOISE_SE:g} standard errors (1.0: back to where it started).",
        given_when="the reward's running median (over 10 log steps) fell from its best by at least this fraction of "
        "its gain since the run's start (its first running median), and by more than 4 standard errors of a "
        "difference of two such medians (the scatter pooled over the run), after a gain larger than that too: the run "
        "gives back what it learned (1.0: back to its start). A reward that rises or drifts up and holds is no drop: "
        "rlwatch's reward drift warns on any monotone stretch of 50 steps, learning included. No healthy peer "
        "scenario, and 0 of 30 flat noisy runs of 500 log steps (1 with 3 standard errors); a reward learned to 0.6 "
        "and collapsing back is flagged 50-65 log steps into its fall",
        suggests="a lower `learning_rate`, a higher `beta`, keep the best checkpoint (`metric_for_best_model`, "
        "`load_best_model_at_end`)",
    ),
    Alarm(
        name="reward_composition",
        rule=RewardCompositionRule,
        field="warn_reward_composition",
        # Over 10 seeds the peers' sick runs reach a share (the least of the window's and its last quarter's) of
        # 0.94-0.98 (rl-doctor's format domination) and 0.99-1.0 (rlprobe's format gaming), their healthy runs 0.33
        # and 0.16 at most: 0.8 flags the first at steps 149-161 and the second at 310-328 (the format rises from
        # step 250), and is rl-doctor's 0.7 with room for a task reward near 0.5 whose noise is small.
        default=0.8,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=True,
        help="Alarm reward_composition: the auxiliary reward functions (warn_auxiliary_rewards, else those with "
        "format, tag, xml, json, length, lang, style or think as a word of their name) carry at least this share of "
        "the summed robust variance of every function's logged mean over the last "
        f"{RewardCompositionRule.WINDOW} steps (at least {RewardCompositionRule.MIN_WINDOW} log entries) and over "
        "their last quarter (the form is learned, not the task). A run with one reward function, or none auxiliary, "
        "is never flagged.",
        given_when="an auxiliary reward function (named in `warn_auxiliary_rewards`; where that is `None`, one with "
        "`format`, `tag`, `xml`, `json`, `length`, `lang`, `style` or `think` as a whole word of its name, split at "
        "`_`, `-`, digits and camelCase, with their plural and `-ing` forms and `len`, `language`, `xmlcount`: "
        "`information_gain` is none) carries at least this share of the reward's variation: the summed squared "
        "robust spread (1.4826 times the median absolute deviation) of the auxiliary functions' logged means "
        "(`rewards/<function>/mean`) over that of every function, over the log entries of the last 150 steps (at "
        "least 20: 150 at one entry per step, 20 at one per 10 or 50) and over their last quarter (a format reward "
        "that saturated early carried the variation while it rose, not since). A task reward stuck near 0 varies "
        "little (a mean of 0/1 scores is least noisy near 0 and 1), as does one that stalls while the format reward "
        "rises. Judged from a window's logged means on; a run with one reward function, or none auxiliary, is never "
        "flagged; both peers' runs logged every 10 steps are flagged, and neither healthy one. Over 10 seeds: "
        "rl-doctor's format domination (correctness near 0.02, format saturated at 0.97) reaches 0.94-0.98 and is "
        "flagged at steps 149-161, rlprobe's format gaming (correctness stalled at 0.44 while the format rises to "
        "1.0 from step 250) 0.99-1.0, flagged at 310-328; their healthy runs 0.33 and 0.16 at most. A format reward "
        "still rising 150 log steps into the run while the task's barely moves is flagged: one that saturates by "
        "about step 120 is not",
        suggests="read completions that score on the auxiliary reward and not on the task's; make the auxiliary "
        "reward harder to earn without solving the task or lower its weight (`reward_weights`); easier prompts if "
        "the task reward stays near 0",
    ),
)
