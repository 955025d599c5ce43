"""The alarm rules: each reads a run's log entries one at a time and says whether its failure mode holds now.

An entry is what `Trainer.log` records: the dict a callback's `on_log` gets, or one item of
`trainer_state.json`'s `log_history`. `AnomalyMonitor` (`anomaly.py`) feeds the rules live and gives each alarm
once per episode; `trl_grpo_ext.report.health` feeds a finished run's history through the same rules. Each rule:

- `name`, `field`: its record's (`ALARMS`: one `Alarm` per alarm, with its threshold's field, default, range and
  help, which `GRPOConfigExt`, `AnomalyMonitor`, the report and the card read);
- `judge(entry)`: the warning text when the condition holds, `False` when it does not, `None` when the entry does
  not tell (the metric was not logged in it: rewards are logged only at the steps that generate, for instance).

A rule keeps the history it needs (a running median, the first values, a streak), so a rule must see the entries
in order, each once.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ALARMS",
    "ALARM_FIELDS",
    "DEFAULT_THRESHOLDS",
    "HELDOUT_KEY",
    "SEVERITIES",
    "SKIPPED_STEPS_KEY",
    "Alarm",
    "Rule",
    "build_rules",
    "pearson",
]

#: The severity tiers of the alarms and of the report's verdicts, lowest first.
SEVERITIES = ("ok", "note", "warning", "critical")

#: A held-out metric's mean over k completions per prompt (`heldout/<metric>/mean@<k>`), also with `eval_` in front.
HELDOUT_KEY = re.compile(r"^(?:eval_)?heldout/(?P<metric>.+)/mean@(?P<k>\d+)$")


def _number(entry: Mapping, key: str) -> float | None:
    """`entry[key]` when it is a logged number (`None` also for NaN: TRL logs `None` or NaN for "no value")."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


#: The share of groups without reward spread: this package's, judged on each group (`reward_std/frac_zero_groups`),
#: else TRL's (`frac_reward_zero_std`, which under `scale_rewards="batch"` tests the batch's std instead).
ZERO_SPREAD_KEYS = ("reward_std/frac_zero_groups", "frac_reward_zero_std")


def _first_number(entry: Mapping, keys: tuple[str, ...]) -> tuple[str, float] | tuple[None, None]:
    """The first of `keys` logged as a number in `entry`, and its value."""
    for key in keys:
        value = _number(entry, key)
        if value is not None:
            return key, value
    return None, None


def _not_a_number(value) -> bool:
    """A logged value that says "nothing": `None`, or NaN (how TRL logs the mean of a reward that scored nothing)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of two equally long series, `None` when either is constant (or shorter than 2).

    r = sum((x - mean x)(y - mean y)) / sqrt(sum((x - mean x)^2) * sum((y - mean y)^2))
    """
    if len(xs) < 2:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mean_x) ** 2 for x in xs)
    syy = sum((y - mean_y) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


class Rule:
    """The condition of one alarm: `judge` (see the module docstring); `name` and `field` are its record's
    (`ALARMS`)."""

    name: str = ""
    field: str = ""
    #: The logged metrics it reads (the report names them when none was logged).
    keys: tuple[str, ...] = ()
    #: The tier of the verdict just given (of `SEVERITIES`): a rule with tiers sets it in `judge`.
    severity: str = "warning"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def judge(self, entry: Mapping) -> str | bool | None:
        raise NotImplementedError

    def tag(self) -> str:
        """The suffix of every warning: the metric that counts it and the field that sets (or switches off) it."""
        return f" [alarms/{self.name}; {self.field}={self.threshold:g}, None switches it off]"


class ZeroStdRule(Rule):
    keys = ZERO_SPREAD_KEYS

    def judge(self, entry):
        _, value = _first_number(entry, ZERO_SPREAD_KEYS)
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"{value:.0%} of completions are in groups whose rewards are all equal: those groups give no learning "
            "signal (only the KL term). Make the prompts neither too easy nor too hard for the model, raise "
            "num_generations or temperature, or use a reward with partial credit."
        )


#: The truncated share of the batch that trains (see `LengthDriftRule.LENGTH_KEYS`), else of every completion.
TRUNCATION_KEYS = ("dynamic_sampling/trained_clipped_ratio", "completions/clipped_ratio")


class UnscoredRule(Rule):
    """At least `threshold` of the completions were scored by no function (`frac_reward_unscored`), or a reward
    function scored no completion (`rewards/<name>/mean` NaN: every reward `None` or NaN) in `WINDOW` scoring log
    steps in a row.

    A function that returns `None` for the prompts of other tasks (TRL's pattern for a multi-task reward) is silent
    at a step whose batch holds none of its prompts; those completions are scored by another function, so
    `frac_reward_unscored` stays low and one silent step says nothing. A parser that never matches stays silent.
    """

    keys = ("frac_reward_unscored", "rewards/<name>/mean")
    WINDOW = 10  # scoring log steps in a row without a score from one function

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.silent: dict[str, int] = {}  # function -> scoring log steps in a row it scored nothing

    def judge(self, entry):
        means = {key: value for key, value in entry.items() if key.startswith("rewards/") and key.endswith("/mean")}
        share = _number(entry, "frac_reward_unscored")
        if not means and share is None:
            return None  # not a step that scored completions
        for key, value in means.items():
            name = key.removeprefix("rewards/").removesuffix("/mean")
            self.silent[name] = self.silent.get(name, 0) + 1 if _not_a_number(value) else 0
        now = sorted(
            key.removeprefix("rewards/").removesuffix("/mean") for key, v in means.items() if _not_a_number(v)
        )
        lasting = sorted(name for name in now if self.silent[name] >= self.WINDOW)
        if share is not None and share >= self.threshold:
            text = f"{share:.0%} of the completions were scored by no reward function (None or NaN)"
            if now:
                text += f"; reward function {_quoted(now)} scored no completion of this step"
        elif lasting:
            steps = min(self.silent[name] for name in lasting)
            text = (
                f"reward function {_quoted(lasting)} scored no completion for {steps} log steps in a row (every "
                "reward None or NaN)"
            )
        else:
            return False
        return (
            f"{text}: unscored completions get advantage 0, so they teach nothing. Check the function on a few "
            "completions: a parser that never matches (answer format, tags) returns None for everything."
        )


def _quoted(names: list[str]) -> str:
    return ", ".join(f"'{name}'" for name in names)


class NoGradientRule(Rule):
    """`grad_norm` is 0 for `threshold` log steps in a row: no update moves the weights."""

    keys = ("grad_norm",)

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.streak = 0

    def judge(self, entry):
        value = entry.get("grad_norm")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        self.streak = self.streak + 1 if value == 0.0 else 0
        if self.streak < self.threshold:
            return False
        return (
            f"grad_norm has been 0 for {self.streak} log steps: nothing is learned. Every advantage is 0 (no reward "
            "spread, or no completion scored), every token is clipped, or the trainable parameters get no gradient "
            "(check requires_grad and the LoRA target modules)."
        )


class ClipFractionRule(Rule):
    keys = ("clip_ratio/region_mean",)

    def __init__(self, threshold: float, patience: int = 3):
        super().__init__(threshold)
        self.patience = patience
        self.streak = 0

    def judge(self, entry):
        value = _number(entry, "clip_ratio/region_mean")
        if value is None:
            return None
        self.streak = self.streak + 1 if value > self.threshold else 0
        if self.streak < self.patience:
            return False
        return (
            f"clip_ratio/region_mean has stayed above {self.threshold:g} for {self.streak} log steps "
            f"({value:.2f} now): many tokens sit in the flat, zero-gradient part of the surrogate. Lower the "
            "learning_rate or num_iterations, or widen epsilon."
        )


class RatioRule(Rule):
    """A logged value (`ratio/p95`, `ratio/max`) above its threshold, or not finite; `message` says what it means."""

    def __init__(self, threshold: float, key: str):
        super().__init__(threshold)
        self.key = key
        self.keys = (key,)

    def judge(self, entry):
        value = entry.get(self.key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if math.isfinite(value) and value <= self.threshold:
            return False
        return self.message(value)

    def message(self, value: float) -> str:
        return (
            f"{self.key} = {value:.3g} exceeds {self.threshold:g}: the policy moved far from the one that sampled the "
            "completions. Lower the learning_rate or num_iterations; with vLLM, check that it samples with the same "
            "weights and sampling settings as the trainer."
        )


class KLJumpRule(Rule):
    keys = ("kl",)
    FLOOR = 1e-2  # a median below this counts as this: KL grows from 0 at the start of every run
    HISTORY = 10  # the previous values the median is taken over
    MIN_HISTORY = 5  # values needed before a jump can be judged

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.history: list[float] = []

    def judge(self, entry):
        value = _number(entry, "kl")
        if value is None:
            return None
        baseline = statistics.median(self.history) if len(self.history) >= self.MIN_HISTORY else None
        self.history = (self.history + [value])[-self.HISTORY :]
        if baseline is None or value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"kl jumped to {value:.3g}, more than {self.threshold:g}x its recent median {baseline:.3g}: the policy is "
            "leaving the reference fast. Lower the learning_rate, raise beta, or check the rewards for hacking."
        )


class KLHighRule(RatioRule):
    """`kl` above its threshold, or not finite: a level, where `KLJumpRule` needs a history to compare with."""

    keys = ("kl",)

    def __init__(self, threshold: float):
        super().__init__(threshold, key="kl")

    def message(self, value: float) -> str:
        return (
            f"kl = {value:.3g} exceeds {self.threshold:g}: the policy is far from the reference (a KL blow-up). Lower "
            "the learning_rate, raise beta, or check the rewards for hacking."
        )


class TruncationRule(Rule):
    keys = ("completions/clipped_ratio",)

    def judge(self, entry):
        value = _number(entry, "completions/clipped_ratio")
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"{value:.0%} of completions reached max_completion_length without an end-of-sequence token: the "
            "rewards judge cut-off text, and when every completion is cut they are often all equal (no learning "
            "signal). Raise max_completion_length, or ask for shorter answers (a system prompt, a format reward)."
        )


class SustainedTruncationRule(Rule):
    """A truncated share at or above `threshold` at each of `WINDOW` log steps in a row, in tiers: a note, and a
    warning once every step of the streak is at `SEVERE` times the threshold. `TruncationRule` warns at once only
    where most completions are cut."""

    keys = ("completions/clipped_ratio",)
    WINDOW = 5  # log steps in a row: one batch with a few long completions is no trend
    SEVERE = 3.0  # the warning tier, a multiple of the threshold (0.15 by default)

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.shares: list[float] = []

    def judge(self, entry):
        _, value = _first_number(entry, TRUNCATION_KEYS)
        if value is None:
            return None
        self.shares = (self.shares + [value])[-self.WINDOW :]
        low = min(self.shares)
        if len(self.shares) < self.WINDOW or low < self.threshold:
            return False
        severe = min(self.SEVERE * self.threshold, 1.0)
        self.severity = "warning" if low >= severe else "note"
        tier = f"warning: {severe:.0%} or more" if self.severity == "warning" else f"note; a warning from {severe:.0%}"
        return (
            f"{low:.0%} or more of completions ({value:.0%} now) reached max_completion_length without an "
            f"end-of-sequence token at each of the last {self.WINDOW} log steps ({tier}): the rewards judge cut-off "
            "text, and the longest answers are the ones cut. Raise max_completion_length, or ask for shorter answers "
            "(a system prompt, a format reward)."
        )


class NoSpreadRule(Rule):
    """No reward spread in any group for `threshold` log steps in a row; says whether truncation is the cause."""

    keys = ZERO_SPREAD_KEYS
    ALL = 1 - 1e-6  # a share of groups without spread at or above this: every group had equal rewards
    CAUSE = 0.9  # truncated share (mean over the streak) from which truncation is named as the cause

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.streak = 0
        self.truncated: list[float] = []

    def judge(self, entry):
        _, value = _first_number(entry, ZERO_SPREAD_KEYS)
        if value is None:
            return None
        if value < self.ALL:
            self.streak, self.truncated = 0, []
            return False
        self.streak += 1
        _, truncated = _first_number(entry, TRUNCATION_KEYS)
        if truncated is not None:
            self.truncated.append(truncated)
        if self.streak < self.threshold:
            return False
        text = (
            f"no reward spread for {self.streak} log steps: in every group all completions scored the same, so "
            "every advantage is 0 and only the KL term trains. "
        )
        if not self.truncated:
            return text + (
                "Whether truncation is the cause is unknown (completions/clipped_ratio was not logged). Check the "
                "reward function on a few completions, and max_completion_length."
            )
        share = statistics.fmean(self.truncated)
        if share >= self.CAUSE:
            return text + (
                f"Truncation is the likely cause: {share:.0%} of the completions were cut at max_completion_length, "
                "so the reward sees no complete answer. Raise max_completion_length."
            )
        return text + (
            f"Truncation is not the cause ({share:.0%} of completions were cut): check that the reward function "
            "does not return a constant, make the prompts neither too easy nor too hard, or raise num_generations "
            "or temperature."
        )


class EntropyCollapseRule(Rule):
    keys = ("entropy",)
    BASELINE = 3  # the first logged values whose mean is the reference

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.first: list[float] = []

    def judge(self, entry):
        value = _number(entry, "entropy")
        if value is None:
            return None
        if len(self.first) < self.BASELINE:
            self.first.append(value)
            return False
        baseline = statistics.fmean(self.first)
        if baseline <= 0 or value >= self.threshold * baseline:
            return False
        return (
            f"entropy fell to {value:.3g}, {value / baseline:.0%} of its first logged values ({baseline:.3g}): the "
            "policy stopped exploring, its completions of a prompt become alike and their rewards equal. Raise "
            "temperature, lower the learning_rate, widen epsilon_high (clip-higher, e.g. 0.28), or add an entropy "
            "bonus (entropy_coef)."
        )


#: The non-finite guard's count of the optimizer steps it skipped so far (`GRPOTrainerExt` logs it with every
#: training entry unless `nonfinite_policy="off"`).
SKIPPED_STEPS_KEY = "nonfinite/skipped_steps"


class GradNormSpikeRule(Rule):
    """`grad_norm` far above its running median, or not finite. Norms at or below `FLOOR` (steps without reward
    spread have next to no gradient) say nothing about the usual scale: they stay out of the median, so the first
    real gradient after a stretch of them is no spike.

    A non-finite norm logged where the guard's count (`nonfinite/skipped_steps`) rose since the last entry is that of
    a step the guard skipped: its update never reached the weights, the guard warned and counts it, so it is no
    spike (the entry does not tell). With the guard off (no count logged) it is one: that update was applied."""

    keys = ("grad_norm",)
    FLOOR = 1e-3
    HISTORY = 20
    MIN_HISTORY = 5

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.history: list[float] = []
        self.skipped = 0.0  # the guard's count at the last entry that logged it

    def judge(self, entry):
        skipped = _number(entry, SKIPPED_STEPS_KEY)
        guard_skipped = skipped is not None and skipped > self.skipped
        if skipped is not None:
            self.skipped = skipped
        value = entry.get("grad_norm")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if not math.isfinite(value):
            if guard_skipped:
                return None
            return (
                f"grad_norm is {value}: a loss or gradient was not finite. nonfinite_policy='skip' (the default) "
                "keeps such updates off the weights; lower the learning_rate if it recurs."
            )
        baseline = statistics.median(self.history) if len(self.history) >= self.MIN_HISTORY else None
        if value > self.FLOOR:
            self.history = (self.history + [value])[-self.HISTORY :]
        if baseline is None or value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"grad_norm spiked to {value:.3g}, {value / max(baseline, self.FLOOR):.0f}x its running median "
            f"{baseline:.3g}: spikes like this often precede a collapse. Lower the learning_rate, set or lower "
            "max_grad_norm, or raise beta."
        )


class LengthDriftRule(Rule):
    """Across log steps: the mean completion length moves in step with the rising reward."""

    keys = ("completions/mean_length", "reward")
    #: The mean completion length of the batch that trains (under dynamic sampling, `completions/*` count every
    #: generated round while `reward` is the trained batch's).
    LENGTH_KEYS = ("dynamic_sampling/trained_mean_length", "completions/mean_length")
    WINDOW = 10  # the last log steps carrying both the reward and the length
    MIN_WINDOW = 6
    MIN_CHANGE = 0.2  # relative change of the length (mean of the window's second half over its first half)

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.pairs: list[tuple[float, float]] = []

    def judge(self, entry):
        reward, (_, length) = _number(entry, "reward"), _first_number(entry, self.LENGTH_KEYS)
        if reward is None or length is None:
            return None
        self.pairs = (self.pairs + [(reward, length)])[-self.WINDOW :]
        if len(self.pairs) < self.MIN_WINDOW:
            return False
        rewards, lengths = [pair[0] for pair in self.pairs], [pair[1] for pair in self.pairs]
        half = len(self.pairs) // 2
        length_before, length_after = statistics.fmean(lengths[:half]), statistics.fmean(lengths[-half:])
        reward_before, reward_after = statistics.fmean(rewards[:half]), statistics.fmean(rewards[-half:])
        change = (length_after - length_before) / max(abs(length_before), 1e-8)
        correlation = pearson(rewards, lengths)
        if (
            correlation is None
            or abs(correlation) < self.threshold
            or abs(change) < self.MIN_CHANGE
            or reward_after <= reward_before
        ):
            return False
        return (
            f"completion length went from {length_before:.3g} to {length_after:.3g} tokens ({change:+.0%}) over the "
            f"last {len(self.pairs)} log steps, in step with the rising reward (correlation {correlation:+.2f}): the "
            "reward may pay for length rather than for the task. Check the reward on long and short completions; "
            "cap or penalise length in the reward, or lower max_completion_length."
        )


class LengthGrowthRule(Rule):
    """Over the whole run: the mean completion length grew by at least `threshold` (a fraction) from the run's own
    start. The start is the median of the first `BASELINE` logged lengths, now the median of the last `RECENT`
    (judged once the two windows no longer overlap), so one long or short log step moves neither. A slow growth
    moves `LengthDriftRule`'s 10-step window too little to count."""

    keys = ("completions/mean_length",)
    BASELINE = 5
    RECENT = 5

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.first: list[float] = []
        self.recent: list[float] = []
        self.seen = 0  # lengths logged so far

    def judge(self, entry):
        _, length = _first_number(entry, LengthDriftRule.LENGTH_KEYS)
        if length is None:
            return None
        if len(self.first) < self.BASELINE:
            self.first.append(length)
        self.recent = (self.recent + [length])[-self.RECENT :]
        self.seen += 1
        if self.seen < self.BASELINE + self.RECENT:
            return False
        start, now = statistics.median(self.first), statistics.median(self.recent)
        if start <= 0 or now < (1 + self.threshold) * start:
            return False
        return (
            f"completion length grew from {start:.3g} to {now:.3g} tokens ({now / start - 1:+.0%}) since the start "
            f"of the run (median of its first {self.BASELINE} log steps, of its last {self.RECENT}): the reward may "
            "pay for length rather than for the task, the completions run towards max_completion_length (watch "
            "completions/clipped_ratio) and every step costs more. Check the reward on long and short completions; "
            "cap or penalise length in the reward. Where the task rewards longer reasoning, raise the threshold."
        )


class LengthInGroupRule(Rule):
    """Inside groups: the longer completions of a prompt score higher (GRPOTrainerExt's pooled correlation)."""

    keys = ("reward_length_corr/within_group",)

    def judge(self, entry):
        value = _number(entry, "reward_length_corr/within_group")
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"inside groups, completion length and reward are correlated ({value:+.2f}): the longer completions of "
            "a prompt score higher, so the advantages push every prompt towards longer completions. Unless the task "
            "needs longer answers the reward pays for length: cap or penalise length in the reward."
        )


def _heldout_size_key(match: re.Match) -> str:
    """The key of the sample size logged next to the held-out mean `match` (of `HELDOUT_KEY`):
    `heldout/<metric>/scored@<k>` for `heldout/<metric>/mean@<k>`, with the same `eval_` prefix."""
    key = match.string
    return key[: match.start("metric")] + f"{match['metric']}/scored@{match['k']}"


def _heldout_noise(value: float, size: float | None) -> float | None:
    """The variance of a held-out mean from its own sampling: `p (1 - p) / n` for a mean `p` over `n` scored
    completions. For scores in [0, 1] this is the variance of an accuracy (0/1 scores) and at least that of any
    graded metric with the same mean, so it never understates the noise. `None` when it is not known: no size logged
    (a stock or older run), or a mean outside [0, 1] (a metric on another scale)."""
    if size is None or size < 1 or not 0.0 <= value <= 1.0:
        return None
    return value * (1.0 - value) / size


class RewardVsHeldoutRule(Rule):
    """The training reward rises while a held-out metric (`heldout/<metric>/mean@<k>`) falls from its best by more
    than `threshold` of that best and, where the evaluation's sample size was logged (`heldout/<metric>/scored@<k>`),
    by more than `NOISE_SE` standard errors of the difference: sqrt(p_best (1 - p_best) / n_best + p (1 - p) / n).

    The best is the highest of every evaluation so far, so it carries the luck of the best draw: with 2 standard
    errors a run whose held-out accuracy does not move fired in 40% (10 evaluations) to 80% (20) of simulated
    runs, with 3 in 5% to 20%. 3 still flags 0.6 -> 0.3 over 50 completions (3.2 standard errors) and over 200
    (6.3)."""

    keys = ("heldout/<metric>/mean@<k>", "reward")
    RECENT = 3  # training rewards averaged around a held-out evaluation
    NOISE_SE = 3.0  # standard errors of the difference a drop must exceed, where the sample sizes are logged

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards: list[float] = []
        #: key -> (value, its noise variance or None, the reward then, step)
        self.best: dict[str, tuple[float, float | None, float | None, int | None]] = {}

    def _recent_reward(self) -> float | None:
        return statistics.fmean(self.rewards[-self.RECENT :]) if self.rewards else None

    def judge(self, entry):
        reward = _number(entry, "reward")
        if reward is not None:
            self.rewards.append(reward)
        found = None
        for key in sorted(entry):
            match = HELDOUT_KEY.match(key)
            if match is None or _number(entry, key) is None:
                continue
            found = found or False
            value, now = _number(entry, key), self._recent_reward()
            noise = _heldout_noise(value, _number(entry, _heldout_size_key(match)))
            best = self.best.get(key)
            if best is None or value >= best[0]:
                self.best[key] = (value, noise, now, entry.get("step"))
                continue
            best_value, best_noise, reward_then, best_step = best
            if reward_then is None and self.rewards:  # the best came before any training reward (step 0)
                reward_then = self.rewards[0]
            drop = best_value - value
            fell = drop >= self.threshold * max(abs(best_value), 1e-8)
            allowance = None
            if noise is not None and best_noise is not None:
                allowance = self.NOISE_SE * math.sqrt(noise + best_noise)
                fell = fell and drop > allowance
            if fell and reward_then is not None and now is not None and now > reward_then:
                at = f" (step {best_step})" if best_step is not None else ""
                beyond = (
                    f", more than the evaluation's noise ({self.NOISE_SE:g} standard errors: {allowance:.3g})"
                    if allowance is not None
                    else ""
                )
                found = (
                    f"{key} fell from its best {best_value:.3g}{at} to {value:.3g}{beyond} while the training reward "
                    f"rose from {reward_then:.3g} to {now:.3g}: the policy may be exploiting the reward rather than "
                    "learning the task (reward hacking). Read completions for loopholes the reward pays for, raise "
                    f"beta, and keep the best checkpoint (metric_for_best_model='{key}', load_best_model_at_end=True)."
                )
        return found


@dataclass(frozen=True)
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
            "zero_std",
            ZeroStdRule,
            "warn_zero_std_fraction",
            0.9,
            0.0,
            1.0,
            False,
            True,
            "Alarm zero_std: at least this share of completions is in groups with equal rewards (judged on the "
            "groups themselves, whatever scale_rewards): no learning signal from them.",
        ),
        Alarm(
            "no_spread",
            NoSpreadRule,
            "warn_no_spread_steps",
            3,
            1,
            math.inf,
            True,
            False,
            "Alarm no_spread: every group has equal rewards for this many log steps in a row (nothing is learned); "
            "the warning says whether truncation (completions/clipped_ratio) is the cause.",
            whole=True,
        ),
        Alarm(
            "unscored",
            UnscoredRule,
            "warn_unscored_fraction",
            0.5,
            0.0,
            1.0,
            False,
            True,
            "Alarm unscored: at least this share of completions was scored by no reward function "
            "(frac_reward_unscored), or a reward function scored no completion (all None or NaN) for "
            f"{UnscoredRule.WINDOW} log steps in a row.",
        ),
        Alarm(
            "no_gradient",
            NoGradientRule,
            "warn_zero_grad_steps",
            3,
            1,
            math.inf,
            True,
            False,
            "Alarm no_gradient: grad_norm is exactly 0 for this many log steps in a row (no update moves the "
            "weights).",
            whole=True,
        ),
        Alarm(
            "truncation",
            TruncationRule,
            "warn_truncated_fraction",
            0.5,
            0.0,
            1.0,
            False,
            True,
            "Alarm truncation: at least this share of completions reached max_completion_length without an "
            "end-of-sequence token (TRL's completions/clipped_ratio).",
        ),
        Alarm(
            "truncation_sustained",
            SustainedTruncationRule,
            "warn_truncated_sustained",
            # A note from 5% cut, a warning from 15%, as rl-doctor grades truncation, but over 5 log steps in a row:
            # the demo stays below 2% (logged every 10 steps over 400), the quickstart below 4% (its 4 log steps).
            0.05,
            0.0,
            1.0,
            False,
            True,
            "Alarm truncation_sustained: at least this share of completions was truncated (completions/clipped_ratio) "
            f"at each of {SustainedTruncationRule.WINDOW} log steps in a row: a note, a warning from "
            f"{SustainedTruncationRule.SEVERE:g} times this share.",
        ),
        Alarm(
            "clip_fraction",
            ClipFractionRule,
            "warn_clip_fraction",
            0.2,
            0.0,
            1.0,
            False,
            True,
            "Alarm clip_fraction: clip_ratio/region_mean stays above this for warn_patience log steps.",
        ),
        Alarm(
            "ratio_p95",
            RatioRule,
            "warn_ratio_p95",
            1.5,
            1.0,
            math.inf,
            False,
            False,
            "Alarm ratio_p95: the 95th percentile of the importance ratio exceeds this.",
            rule_options={"key": "ratio/p95"},
        ),
        Alarm(
            "ratio_max",
            RatioRule,
            "warn_ratio_max",
            100.0,
            1.0,
            math.inf,
            False,
            False,
            "Alarm ratio_max: the largest importance ratio exceeds this.",
            rule_options={"key": "ratio/max"},
        ),
        Alarm(
            "kl_jump",
            KLJumpRule,
            "warn_kl_jump",
            10.0,
            1.0,
            math.inf,
            False,
            False,
            "Alarm kl_jump: kl exceeds this factor times the median of its previous 10 logged values (judged once "
            "5 are there; a median below 0.01 counts as 0.01).",
        ),
        Alarm(
            "kl_high",
            KLHighRule,
            "warn_kl_max",
            # Healthy demo runs stay below 0.45 (docs/diagnostics.md's example); a learning rate 10x too high reaches
            # 3 within 10 steps, 100x too high 6.7 at step 2, before `kl_jump` has the 5 values it compares with.
            1.0,
            0.0,
            math.inf,
            False,
            False,
            "Alarm kl_high: kl (mean per token) exceeds this, or is not finite.",
        ),
        Alarm(
            "entropy_collapse",
            EntropyCollapseRule,
            "warn_entropy_collapse",
            0.1,
            0.0,
            1.0,
            False,
            False,
            "Alarm entropy_collapse: entropy falls below this fraction of the mean of its first 3 logged values.",
        ),
        Alarm(
            "grad_norm_spike",
            GradNormSpikeRule,
            "warn_grad_norm_spike",
            10.0,
            1.0,
            math.inf,
            False,
            False,
            "Alarm grad_norm_spike: grad_norm exceeds this factor times the median of its previous 20 logged values "
            "(judged once 5 are there; a median below 1e-3 counts as 1e-3), or is not finite (but at a step the "
            "non-finite guard skipped, counted in nonfinite/skipped_steps).",
        ),
        Alarm(
            "length_drift",
            LengthDriftRule,
            "warn_length_drift_corr",
            0.9,
            0.0,
            1.0,
            False,
            True,
            "Alarm length_drift: over the last 10 log steps (judged from 6) the reward rose, "
            "completions/mean_length changed by at least a fifth, and the two correlate at least this much "
            "(absolute Pearson correlation).",
        ),
        Alarm(
            "length_growth",
            LengthGrowthRule,
            "warn_length_growth",
            # The demo's length stays within 6% of its start over 400 steps (5.75 to 6.17 tokens); a run whose length
            # grows 203 -> 707 tokens over its course is flagged once it is half as long again as at its start. A
            # task that rewards longer reasoning can raise it.
            0.5,
            0.0,
            math.inf,
            False,
            False,
            f"Alarm length_growth: the median completions/mean_length of the last {LengthGrowthRule.RECENT} log "
            f"steps exceeds that of the run's first {LengthGrowthRule.BASELINE} by at least this fraction (1.0: it "
            f"doubled; judged from the {LengthGrowthRule.BASELINE + LengthGrowthRule.RECENT}th log step).",
        ),
        Alarm(
            "length_in_group",
            LengthInGroupRule,
            "warn_length_group_corr",
            0.8,
            0.0,
            1.0,
            False,
            True,
            "Alarm length_in_group: inside groups, completion length and reward correlate at least this much "
            "(reward_length_corr/within_group, logged with log_diagnostics).",
        ),
        Alarm(
            "reward_vs_heldout",
            RewardVsHeldoutRule,
            "warn_heldout_drop",
            0.1,
            0.0,
            math.inf,
            False,
            False,
            "Alarm reward_vs_heldout: a logged held-out metric (heldout/<metric>/mean@<k>) falls by this fraction "
            "of its best value, and by more than "
            f"{RewardVsHeldoutRule.NOISE_SE:g} standard errors of the difference where the evaluation's sample "
            "size is logged (heldout/<metric>/scored@<k>), while the training reward is above its level at that "
            "best.",
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
