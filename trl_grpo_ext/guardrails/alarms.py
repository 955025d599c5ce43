"""The alarm records (`ALARMS`): one `Alarm` per alarm, with its rule, its threshold's `GRPOConfigExt` field, default,
range and help, which `GRPOConfigExt`, `AnomalyMonitor`, the report and the card read.

Each rule reads a run's log entries one at a time and says whether its failure mode holds now (`rule.Rule`; the rules
are in `step_rules.py`, `trend_rules.py` and `progress_rules.py`). An entry is what `Trainer.log` records: the dict a
callback's `on_log` gets, or one item of `trainer_state.json`'s `log_history`. `AnomalyMonitor` (`anomaly.py`) feeds
the rules live and gives each alarm once per episode; `trl_grpo_ext.report.health` feeds a finished run's history
through the same rules. Each rule:

- `name`, `field`: its record's;
- `judge(entry)`: the warning text when the condition holds, `False` when it does not, `None` when the entry does
  not tell (the metric was not logged in it: rewards are logged only at the steps that generate, for instance).

A rule keeps the history it needs (a running median, the first values, a streak), so a rule must see the entries
in order, each once. The names of the rules' module (`Rule`, `pearson`, the key constants) stay importable from here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .progress_rules import FlatGroupsRule, PlateauRule, RewardDropRule
from .rule import HELDOUT_KEY, SEVERITIES, SKIPPED_STEPS_KEY, ZERO_SPREAD_KEYS, Rule, pearson
from .step_rules import (
    ClipAsymmetryRule,
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
from .trend_rules import (
    EntropyCollapseRule,
    GradNormSpikeRule,
    KLGrowthRule,
    LengthDriftRule,
    LengthGrowthRule,
    LengthInGroupRule,
    RewardVsHeldoutRule,
    VanishingGradientRule,
)

__all__ = [
    "ALARMS",
    "ALARM_FIELDS",
    "DEFAULT_THRESHOLDS",
    "HELDOUT_KEY",
    "SEVERITIES",
    "SKIPPED_STEPS_KEY",
    "ZERO_SPREAD_KEYS",
    "Alarm",
    "Rule",
    "build_rules",
    "pearson",
]


@dataclass(frozen=True, kw_only=True)
class Alarm:
    """Everything about one alarm, in one place: its rule, its threshold's `GRPOConfigExt` field with its default,
    range and help, and how the monitor, the report and the card name it.

    Attributes:
        name (`str`): counted as `alarms/<name>`.
        rule (`type[Rule]`): the condition; built with the threshold and `rule_options`.
        field (`str`): the `GRPOConfigExt` field of the threshold (`None` there switches the alarm off);
            `AnomalyMonitor` takes it as a keyword without the `warn_` prefix.
        default (`float`): the field's default.
        low, high (`float`): the range of the threshold; `low_inclusive`, `high_inclusive` say whether the ends are in.
        help (`str`): the field's help (what the alarm means).
        whole (`bool`): the threshold counts log steps (a whole number).
        rule_options (`dict`): more arguments of the rule (the metric a ratio alarm reads).
    """

    name: str
    rule: type[Rule]
    field: str
    default: float
    low: float
    high: float
    low_inclusive: bool
    high_inclusive: bool
    help: str
    whole: bool = False
    rule_options: Mapping = dataclasses.field(default_factory=dict)

    @property
    def keyword(self) -> str:
        return self.field.removeprefix("warn_")

    def range_text(self) -> str:
        """The range in words: `in (0, 1]`, `> 1`, `>= 1`."""
        if math.isinf(self.high):
            return f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        return (
            f"in {'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}{']' if self.high_inclusive else ')'}"
        )

    def problem(self, value) -> str | None:
        """The sentence that refuses `value` for this alarm's field, `None` when it is fine (`None` always is)."""
        if value is None:
            return None
        inside = (self.low <= value if self.low_inclusive else self.low < value) and (
            value <= self.high if self.high_inclusive else value < self.high
        )
        if not inside:
            return f"`{self.field}` must be {self.range_text()} (or None to switch its alarm off), got {value}."
        if self.whole and value != int(value):
            return f"`{self.field}` must be a whole number of log steps, got {value}."
        return None

    def build(self, threshold: float, patience: int = 3) -> Rule:
        """The rule, judging against `threshold` (`patience`: `warn_patience`, for the rules that wait)."""
        options = dict(self.rule_options)
        if "patience" in inspect.signature(self.rule).parameters:
            options["patience"] = patience
        rule = self.rule(threshold, **options)
        rule.name, rule.field = self.name, self.field
        return rule

    def config_field(self) -> dataclasses.Field:
        """The `GRPOConfigExt` field of the threshold: its default and help."""
        return dataclasses.field(
            default=self.default,
            metadata={"help": f"{self.help} {self.range_text()[0].upper()}{self.range_text()[1:]}."},
        )


#: alarm name -> its record, in checking order.
ALARMS: dict[str, Alarm] = {
    alarm.name: alarm
    for alarm in (
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
            rule_options={"key": "ratio/p95"},
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
            rule_options={"key": "ratio/max"},
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
        ),
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
            f"median {KLGrowthRule.LAG // 2} log steps earlier, and at least {KLGrowthRule.FLOOR:g} (the KL keeps "
            f"growing; judged from the {KLGrowthRule.LAG + KLGrowthRule.SMOOTH}th logged kl).",
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
            "fraction of its best value, and by more than "
            f"{RewardVsHeldoutRule.NOISE_SE:g} standard errors of the difference where the evaluation's sample "
            "size is logged (heldout/<metric>/scored@<k>), while the training reward is above its level at that "
            "best.",
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
            help="Alarm flat_groups (a note): at least this share of groups has no reward spread at each of "
            f"{FlatGroupsRule.WINDOW} log steps in a row; the warning says whether they are too easy or too hard "
            "where every reward lies in [0, 1].",
        ),
        Alarm(
            name="plateau",
            rule=PlateauRule,
            field="warn_plateau_steps",
            # rl-doctor's plateau scenario (reward flat from about step 100 of 400, one entry per step) is flagged at
            # steps 265-381 over 10 seeds; its healthy scenario (still rising slowly at its end) never, nor rlprobe's,
            # which converges (93% of its final reward at step 450 of 500) and was flagged at step 456 of one seed of
            # 10 with 100. A run logged every 10 steps waits 1,500 steps: a slow riser is no plateau.
            default=150,
            low=1,
            high=math.inf,
            low_inclusive=True,
            high_inclusive=False,
            help="Alarm plateau (a note): the reward's running median (over "
            f"{PlateauRule.SMOOTH} log steps) has not risen above its best by more than its noise for this many log "
            "steps (the run converged or stopped learning).",
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
        ),
    )
}
#: alarm name -> its `GRPOConfigExt` field.
ALARM_FIELDS = {name: alarm.field for name, alarm in ALARMS.items()}
#: `GRPOConfigExt` field -> its default.
DEFAULT_THRESHOLDS = {alarm.field: alarm.default for alarm in ALARMS.values()}


def build_rules(thresholds: Mapping[str, float | None], patience: int = 3) -> list[Rule]:
    """The rules whose threshold is set, in `ALARMS` order.

    Args:
        thresholds: alarm name (a key of `ALARMS`) -> threshold, `None` (or absent) to leave that alarm out.
        patience: log steps in a row a high clip fraction must last (`warn_patience`).
    """
    unknown = set(thresholds) - set(ALARMS)
    if unknown:
        raise ValueError(f"unknown alarms {sorted(unknown)}; known: {list(ALARMS)}.")
    return [
        alarm.build(thresholds[name], patience) for name, alarm in ALARMS.items() if thresholds.get(name) is not None
    ]
