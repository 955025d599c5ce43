"""The alarm rules that judge one log step's values: reward spread, unscored completions, zero gradient, clipping,
importance ratios, KL, truncation (a rule that waits for a streak keeps its count)."""

from __future__ import annotations

import math
import statistics

from ..metrics import (
    CLIP_RATIO_HIGH_MEAN,
    CLIP_RATIO_LOW_MEAN,
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_CLIPPED_RATIO,
    FRAC_REWARD_UNSCORED,
    GRAD_NORM,
    KL,
    reward_function_of,
)
from .rule import TRUNCATION_KEYS, ZERO_SPREAD_KEYS, Rule, _first_number, _not_a_number, _number, mean


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


class UnscoredRule(Rule):
    """At least `threshold` of the completions were scored by no function (`frac_reward_unscored`), or a reward
    function scored no completion (`rewards/<name>/mean` NaN: every reward `None` or NaN) in `WINDOW` scoring log
    steps in a row.

    A function that returns `None` for the prompts of other tasks (TRL's pattern for a multi-task reward) is silent
    at a step whose batch holds none of its prompts; those completions are scored by another function, so
    `frac_reward_unscored` stays low and one silent step says nothing. A parser that never matches stays silent.
    """

    keys = (FRAC_REWARD_UNSCORED, "rewards/<name>/mean")
    WINDOW = 10  # scoring log steps in a row without a score from one function

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.silent: dict[str, int] = {}  # function -> scoring log steps in a row it scored nothing

    def judge(self, entry):
        means = {name: value for key, value in entry.items() if (name := reward_function_of(key)) is not None}
        share = _number(entry, FRAC_REWARD_UNSCORED)
        if not means and share is None:
            return None  # not a step that scored completions
        for name, value in means.items():
            self.silent[name] = self.silent.get(name, 0) + 1 if _not_a_number(value) else 0
        now = sorted(name for name, v in means.items() if _not_a_number(v))
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

    keys = (GRAD_NORM,)

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.streak = 0

    def judge(self, entry):
        value = entry.get(GRAD_NORM)
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
    keys = (CLIP_RATIO_REGION_MEAN,)

    def __init__(self, threshold: float, patience: int = 3):
        super().__init__(threshold)
        self.patience = patience
        self.streak = 0

    def judge(self, entry):
        value = _number(entry, CLIP_RATIO_REGION_MEAN)
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
    keys = (KL,)
    FLOOR = 1e-2  # a median below this counts as this: KL grows from 0 at the start of every run
    HISTORY = 10  # the previous values the median is taken over
    MIN_HISTORY = 5  # values needed before a jump can be judged

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.history: list[float] = []

    def judge(self, entry):
        value = _number(entry, KL)
        if value is None:
            return None
        baseline = statistics.median(self.history) if len(self.history) >= self.MIN_HISTORY else None
        self.history = (self.history + [value])[-self.HISTORY :]
        if baseline is None:
            return None  # too few values to judge yet
        if value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"kl jumped to {value:.3g}, more than {self.threshold:g}x its recent median {baseline:.3g}: the policy is "
            "leaving the reference fast. Lower the learning_rate, raise beta, or check the rewards for hacking."
        )


class KLHighRule(RatioRule):
    """`kl` above its threshold, or not finite: a level, where `KLJumpRule` needs a history to compare with."""

    keys = (KL,)

    def __init__(self, threshold: float):
        super().__init__(threshold, key=KL)

    def message(self, value: float) -> str:
        return (
            f"kl = {value:.3g} exceeds {self.threshold:g}: the policy is far from the reference (a KL blow-up). Lower "
            "the learning_rate, raise beta, or check the rewards for hacking."
        )


class TruncationRule(Rule):
    keys = (COMPLETIONS_CLIPPED_RATIO,)

    def judge(self, entry):
        value = _number(entry, COMPLETIONS_CLIPPED_RATIO)
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

    keys = (COMPLETIONS_CLIPPED_RATIO,)
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
        if len(self.shares) < self.WINDOW:
            return None  # too few values to judge yet
        if low < self.threshold:
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
        share = mean(self.truncated)
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


class ClipAsymmetryRule(Rule):
    """One side of the clipped surrogate does the clipping: `clip_ratio/low_mean` (tokens of negative-advantage
    completions whose ratio fell below `1 - epsilon`) or `clip_ratio/high_mean` (positive-advantage tokens above
    `1 + epsilon_high`) is at least `threshold` times the other (the other counted as at least `FLOOR`), with the
    larger at least `MIN_CLIPPED`, at each of `WINDOW` log steps in a row. Clipping that happens mostly on the high
    side caps the probability mass of good completions' rare tokens and goes with entropy collapse; mostly on the low
    side, the policy is pushed off the sampled tokens of bad completions faster than it gains on good ones."""

    keys = (CLIP_RATIO_LOW_MEAN, CLIP_RATIO_HIGH_MEAN)
    FLOOR = 0.005  # a side below this counts as this: on-policy steps clip nothing on either side
    MIN_CLIPPED = 0.05  # the larger side's share of tokens from which the asymmetry matters
    WINDOW = 5

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.streak = 0

    def judge(self, entry):
        low, high = _number(entry, CLIP_RATIO_LOW_MEAN), _number(entry, CLIP_RATIO_HIGH_MEAN)
        if low is None or high is None:
            return None
        larger, smaller = max(low, high), min(low, high)
        lopsided = larger >= self.MIN_CLIPPED and larger >= self.threshold * max(smaller, self.FLOOR)
        self.streak = self.streak + 1 if lopsided else 0
        if self.streak < self.WINDOW:
            return False
        if low > high:
            side = (
                f"clip_ratio/low_mean {low:.2f} against high_mean {high:.2f}: tokens of negative-advantage "
                "completions are pushed below 1 - epsilon much more than good ones gain. Lower the learning_rate or "
                "num_iterations, or widen epsilon."
            )
        else:
            side = (
                f"clip_ratio/high_mean {high:.2f} against low_mean {low:.2f}: the gains of positive-advantage tokens "
                "are capped at 1 + epsilon_high, which starves rare good tokens and precedes entropy collapse. Widen "
                "epsilon_high (clip-higher, e.g. 0.28) or lower the learning_rate."
            )
        return f"for {self.streak} log steps one side of the clip range has done the clipping, {side}"
