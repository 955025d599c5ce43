"""The reward's make-up: a change of its scale (`RewardScale`) and an auxiliary reward function that carries its
variation (`Composition`)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Collection, Mapping

from ...metrics import REWARD_STD, REWARD_STD_GROUP_MEAN, reward_function_of
from .rule import FACTOR, SHARE, Alarm, Cadence, Rule, first_number, number, robust_spread, step_of

__all__ = ["AUXILIARY_WORDS", "Composition", "RewardScale", "auxiliary_share", "is_auxiliary", "name_words"]


class RewardScale(Rule):
    """`reward_scale`: the reward's spread (`reward_std/group_mean`, else TRL's `reward_std`), its median over the
    last `RECENT` training steps (at least one log entry), is at least `threshold` times its largest over the
    `HISTORY` steps before (at least `MIN_HISTORY` entries), that history steady (above 0, its largest at most
    `STEADY` times its median). Learning a bounded reward moves its spread slowly and within bounds; a spread that
    multiplies within a few steps is a reward whose scale changed."""

    alarms = {"reward_scale": Alarm(4.0, FACTOR, "warn_reward_scale")}
    KEYS = (REWARD_STD_GROUP_MEAN, REWARD_STD)
    RECENT = 3
    HISTORY = 20
    MIN_HISTORY = 10
    STEADY = 3.0

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.cadence = Cadence()
        self.values: list[float] = []

    def reward_scale(self, entry):
        key, value = first_number(entry, self.KEYS)
        if value is None:
            return None
        self.cadence.add(step_of(entry))
        recent = self.cadence.entries(self.RECENT, 1)
        history = self.cadence.entries(self.HISTORY, self.MIN_HISTORY)
        self.values = (self.values + [value])[-(max(self.HISTORY, self.MIN_HISTORY) + self.RECENT) :]
        if len(self.values) < recent + history:
            return None  # too few values to judge yet
        before = self.values[-(recent + history) : -recent]
        now, usual, largest = statistics.median(self.values[-recent:]), statistics.median(before), max(before)
        if not usual > 0 or largest > self.STEADY * usual or now < self.threshold * largest:
            return False
        return (
            f"{key} jumped from {usual:.3g} (at most {largest:.3g} over the {history} log steps before) to "
            f"{now:.3g} ({now / largest:.1f}x) within {recent} log step{'s' if recent > 1 else ''}: learning moves a "
            "bounded reward's spread slowly (a 0/1 reward's inside a group cannot exceed 0.53), so the reward's scale "
            "changed: a reward function edited or rescaled, a reward model swapped, a function scoring outliers. "
            "Check the reward functions and reward_weights; with several functions the one whose scale grew now "
            "outweighs the others, and with scale_rewards='none' the advantages (the step size) grew as much."
        )


#: Words of a reward function's name that mark it as auxiliary (it scores the form of a completion, not whether it
#: solves the task); `xmlcount` is one word in the function names of the GRPO script most recipes copied.
AUXILIARY_WORDS = frozenset(
    {
        "format", "formats", "formatted", "formatting", "tag", "tags", "xml", "xmlcount", "json", "length", "len",
        "lang", "language", "style", "think", "thinking",
    }
)  # fmt: skip

#: A word of a name: a run of capitals (an acronym, `XML`), or an optional capital and lower-case letters.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def name_words(function: str) -> list[str]:
    """The words of a reward function's name, lower-cased: split at signs, digits and camelCase."""
    return [word.lower() for word in _WORD.findall(function)]


def is_auxiliary(function: str, named: Collection[str] | None = None) -> bool:
    """Whether the reward function `function` is auxiliary: one of `named` where the run names them
    (`warn_auxiliary_rewards`), else by a whole word of its name (`AUXILIARY_WORDS`)."""
    if named is not None:
        return function in named
    return not AUXILIARY_WORDS.isdisjoint(name_words(function))


def auxiliary_share(windows: Mapping[str, list[float]], auxiliary: Collection[str]) -> float | None:
    """The share of the functions `auxiliary` in the summed squared robust spread of every function's logged means
    (`windows`: function -> its means); `None` when no function varies at all."""
    spreads = {function: robust_spread(values) for function, values in windows.items()}
    variances = {function: spread * spread for function, spread in spreads.items()}
    total = sum(variances.values())
    if not total > 0:
        return None
    return sum(variance for function, variance in variances.items() if function in auxiliary) / total


class Composition(Rule):
    """`reward_composition`: the auxiliary reward functions (`is_auxiliary`) carry at least `threshold` of the
    reward's variation (`auxiliary_share` of the functions' logged means `rewards/<function>/mean`), over the log
    entries of the last `WINDOW` training steps (at least `MIN_WINDOW`) and over the last `1 / RECENT` of them (a
    format reward that saturated early carried the variation while it rose, not since). The policy gradient follows
    what varies between completions. A run with one reward function, or none auxiliary (or all), is never flagged;
    a NaN mean is skipped.

    Args:
        auxiliary (`list[str]`, *optional*): the auxiliary functions' names (`warn_auxiliary_rewards`); `None`: told
            by the words of their names.
    """

    alarms = {"reward_composition": Alarm(0.8, SHARE, "warn_reward_composition")}
    WINDOW = 150
    MIN_WINDOW = 20
    RECENT = 4

    def __init__(self, name: str, threshold: float, auxiliary: Collection[str] | None = None, **settings):
        super().__init__(name, threshold)
        self.auxiliary = None if auxiliary is None else frozenset(auxiliary)
        self.cadence = Cadence()
        self.means: dict[str, list[float]] = {}  # each function's last logged means, a window's at most

    def reward_composition(self, entry):
        means = {name: number(entry, key) for key in entry if (name := reward_function_of(key)) is not None}
        means = {name: value for name, value in means.items() if value is not None}
        if not means:
            return None
        self.cadence.add(step_of(entry))
        size = self.cadence.entries(self.WINDOW, self.MIN_WINDOW)
        recent = size // self.RECENT
        for name, value in means.items():
            self.means[name] = (self.means.get(name, []) + [value])[-max(self.WINDOW, self.MIN_WINDOW) :]
        windows = {name: values[-size:] for name, values in self.means.items() if len(values) >= size}
        if not windows:
            return None  # too few values to judge yet
        auxiliary = sorted(name for name in windows if is_auxiliary(name, self.auxiliary))
        if not auxiliary or len(auxiliary) == len(windows):
            return False
        share = auxiliary_share(windows, auxiliary)
        late = auxiliary_share({name: values[-recent:] for name, values in windows.items()}, auxiliary)
        if share is None or late is None or min(share, late) < self.threshold:
            return False
        task = ", ".join(
            f"{name} {statistics.median(values[-recent:]):.3g}"
            for name, values in sorted(windows.items())
            if name not in auxiliary
        )
        return (
            f"the auxiliary reward function{'s' if len(auxiliary) > 1 else ''} {', '.join(auxiliary)} carr"
            f"{'y' if len(auxiliary) > 1 else 'ies'} {share:.0%} of the reward functions' variation over the last "
            f"{size} log steps ({late:.0%} over the last {recent}), while the task's barely moves "
            f"(median of the last {recent}: {task}): the policy is learning the form, not the task (format "
            "gaming, or a task reward too hard to score). Read completions that score on the one and not on the "
            "other; make the auxiliary reward harder to earn without solving the task or lower its weight "
            "(reward_weights); if the task reward stays near 0, use easier prompts."
        )
