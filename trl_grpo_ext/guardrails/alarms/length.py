"""The completion length: a length the reward pays for (`Length`) and completions cut at `max_completion_length`
(`Truncation`)."""

from __future__ import annotations

from ...metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_MEAN_LENGTH,
    DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH,
    REWARD,
    REWARD_LENGTH_CORR,
)
from .rule import POSITIVE, SHARE, TRUNCATION_KEYS, Alarm, Rule, Series, first_number, mean, number, pearson

__all__ = ["LENGTH_KEYS", "Length", "Truncation"]

#: The mean completion length of the batch that trains (under dynamic sampling `completions/*` count every round
#: while `reward` is the trained batch's), else of every completion.
LENGTH_KEYS = (DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH, COMPLETIONS_MEAN_LENGTH)


class Length(Rule):
    """The mean completion length (`LENGTH_KEYS`):

    - `length_drift`: over the last `WINDOW` log steps carrying reward and length (judged from `MIN_WINDOW`), the
      reward rose (the second half's mean above the first's), the length changed by at least `MIN_CHANGE` between
      the halves, and the absolute Pearson correlation of the two is at least `threshold`;
    - `length_growth`: the median of the last `RECENT` lengths is at least `1 + threshold` times the median of the
      run's first `BASELINE` (judged once the two windows no longer overlap): a growth too slow for `length_drift`;
    - `length_in_group`: inside groups the longer completions score higher: the pooled correlation
      `reward_length_corr/within_group` is at least `threshold`.
    """

    alarms = {
        "length_drift": Alarm(0.9, SHARE, "warn_length_drift_corr"),
        "length_growth": Alarm(0.5, POSITIVE, "warn_length_growth"),
        "length_in_group": Alarm(0.8, SHARE, "warn_length_group_corr"),
    }
    advice = (
        "Check the reward on long and short completions and cap or penalise length in it; where the task needs "
        "longer answers, raise this alarm's threshold."
    )
    WINDOW = 10
    MIN_WINDOW = 6
    MIN_CHANGE = 0.2
    BASELINE = RECENT = 5

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.pairs: list[tuple[float, float]] = []  # length_drift: (reward, length)
        self.lengths = Series(self.BASELINE, self.RECENT)  # length_growth

    def length_drift(self, entry):
        reward, (_, length) = number(entry, REWARD), first_number(entry, LENGTH_KEYS)
        if reward is None or length is None:
            return None
        self.pairs = (self.pairs + [(reward, length)])[-self.WINDOW :]
        if len(self.pairs) < self.MIN_WINDOW:
            return None  # too few values to judge yet
        rewards, lengths = [pair[0] for pair in self.pairs], [pair[1] for pair in self.pairs]
        half = len(self.pairs) // 2
        length_before, length_after = mean(lengths[:half]), mean(lengths[-half:])
        change = (length_after - length_before) / max(abs(length_before), 1e-8)
        correlation = pearson(rewards, lengths)
        if (
            correlation is None
            or abs(correlation) < self.threshold
            or abs(change) < self.MIN_CHANGE
            or mean(rewards[-half:]) <= mean(rewards[:half])
        ):
            return False
        return (
            f"completion length went from {length_before:.3g} to {length_after:.3g} tokens ({change:+.0%}) over the "
            f"last {len(self.pairs)} log steps, in step with the rising reward (correlation {correlation:+.2f}): the "
            f"reward may pay for length rather than for the task. {self.advice}"
        )

    def length_growth(self, entry):
        _, length = first_number(entry, LENGTH_KEYS)
        if length is None:
            return None
        self.lengths.add(length)
        if self.lengths.seen < self.BASELINE + self.RECENT:
            return None  # too few values to judge yet
        start, now = self.lengths.start(), self.lengths.now()
        if start <= 0 or now < (1 + self.threshold) * start:
            return False
        return (
            f"completion length grew from {start:.3g} to {now:.3g} tokens ({now / start - 1:+.0%}) since the start "
            f"of the run (median of its first {self.BASELINE} log steps, of its last {self.RECENT}): the reward may "
            "pay for length rather than for the task, the completions run towards max_completion_length (watch "
            f"completions/clipped_ratio) and every step costs more. {self.advice}"
        )

    def length_in_group(self, entry):
        value = number(entry, REWARD_LENGTH_CORR)
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"inside groups, completion length and reward are correlated ({value:+.2f}): the longer completions of "
            f"a prompt score higher, so the advantages push every prompt towards longer completions. {self.advice}"
        )


class Truncation(Rule):
    """The share of completions cut at `max_completion_length` without an end-of-sequence token:

    - `truncation`: `completions/clipped_ratio` at least `threshold` at one log step;
    - `truncation_sustained`: the truncated share (`TRUNCATION_KEYS`) at least `threshold` at each of `WINDOW` log
      steps in a row, in tiers: a note, and a warning once every step of the streak is at `SEVERE` times the
      threshold (a new episode when it rises to it).
    """

    alarms = {
        "truncation": Alarm(0.5, SHARE, "warn_truncated_fraction"),
        "truncation_sustained": Alarm(0.05, SHARE, "warn_truncated_sustained", "note"),
    }
    advice = "Raise max_completion_length, or ask for shorter answers (a system prompt, a format reward)."
    WINDOW = 5
    SEVERE = 3.0

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.shares: list[float] = []

    def truncation(self, entry):
        value = number(entry, COMPLETIONS_CLIPPED_RATIO)
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"{value:.0%} of completions reached max_completion_length without an end-of-sequence token: the "
            "rewards judge cut-off text, and when every completion is cut they are often all equal (no learning "
            f"signal). {self.advice}"
        )

    def truncation_sustained(self, entry):
        _, value = first_number(entry, TRUNCATION_KEYS)
        if value is None:
            return None
        self.shares = (self.shares + [value])[-self.WINDOW :]
        if len(self.shares) < self.WINDOW:
            return None  # too few values to judge yet
        low = min(self.shares)
        if low < self.threshold:
            return False
        severe = min(self.SEVERE * self.threshold, 1.0)
        self.severity = "warning" if low >= severe else "note"
        tier = f"warning: {severe:.0%} or more" if self.severity == "warning" else f"note; a warning from {severe:.0%}"
        return (
            f"{low:.0%} or more of completions ({value:.0%} now) reached max_completion_length without an "
            f"end-of-sequence token at each of the last {self.WINDOW} log steps ({tier}): the rewards judge cut-off "
            f"text, and the longest answers are the ones cut. {self.advice}"
        )
