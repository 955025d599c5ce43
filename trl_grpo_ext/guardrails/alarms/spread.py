"""Whether the batch carries a learning signal: the reward spread inside groups (`Spread`) and completions that no
reward function scored (`Unscored`)."""

from __future__ import annotations

import math

from ...metrics import FRAC_REWARD_UNSCORED, REWARD, reward_function_of
from .rule import (
    SHARE,
    STEPS,
    TRUNCATION_KEYS,
    ZERO_SPREAD_KEYS,
    Alarm,
    Cadence,
    Rule,
    first_number,
    mean,
    number,
    step_of,
)

__all__ = ["Spread", "Unscored"]


class Spread(Rule):
    """Groups whose rewards are all equal (`ZERO_SPREAD_KEYS`: advantage 0, no policy gradient):

    - `zero_std`: at least `threshold` of them at one log step;
    - `no_spread`: every group, `threshold` log steps in a row; says whether truncation is the cause (the mean
      truncated share of the streak at least `CAUSE`);
    - `flat_groups` (a note): at least `threshold` of them at each log step of the last `WINDOW` training steps (at
      least `MIN_WINDOW` log entries). Where every logged reward lies in [0, 1], at least `r - (1 - z)` of the groups
      scored the maximum everywhere and at least `z - r` the minimum (`r` the mean reward, `z` the flat share): the
      larger bound says whether they are too easy or too hard.
    """

    alarms = {
        "zero_std": Alarm(0.9, SHARE, "warn_zero_std_fraction"),
        "no_spread": Alarm(3, STEPS, "warn_no_spread_steps"),
        "flat_groups": Alarm(0.6, SHARE, "warn_flat_groups", "note"),
    }
    advice = (
        "Make the prompts neither too easy nor too hard for the model, raise num_generations or temperature, or use a "
        "reward with partial credit."
    )
    ALL = 1 - 1e-6  # a share at or above this: every group had equal rewards
    CAUSE = 0.9
    WINDOW = 10  # training steps
    MIN_WINDOW = 3  # log entries

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.streak, self.truncated = 0, []  # no_spread
        self.cadence, self.shares = Cadence(), []  # flat_groups
        self.unit_rewards = True  # every logged reward so far lies in [0, 1]

    def zero_std(self, entry):
        _, value = first_number(entry, ZERO_SPREAD_KEYS)
        if value is None:
            return None
        if value < self.threshold:
            return False
        return (
            f"{value:.0%} of completions are in groups whose rewards are all equal: those groups give no learning "
            f"signal (only the KL term). {self.advice}"
        )

    def no_spread(self, entry):
        _, value = first_number(entry, ZERO_SPREAD_KEYS)
        if value is None:
            return None
        if value < self.ALL:
            self.streak, self.truncated = 0, []
            return False
        self.streak += 1
        _, truncated = first_number(entry, TRUNCATION_KEYS)
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
            f"does not return a constant. {self.advice}"
        )

    def flat_groups(self, entry):
        reward = number(entry, REWARD)
        if reward is not None and not 0.0 <= reward <= 1.0:
            self.unit_rewards = False
        _, share = first_number(entry, ZERO_SPREAD_KEYS)
        if share is None:
            return None
        self.cadence.add(step_of(entry))
        size = self.cadence.entries(self.WINDOW, self.MIN_WINDOW)
        self.shares = (self.shares + [share])[-max(self.WINDOW, self.MIN_WINDOW) :]
        if len(self.shares) < size:
            return None  # too few values to judge yet
        lowest = min(self.shares[-size:])
        if lowest < self.threshold:
            return False
        text = (
            f"{lowest:.0%} or more of the groups ({share:.0%} now) had no reward spread at each of the last {size} "
            "log steps: those groups teach nothing and cost a full generation each. "
        )
        if reward is not None and self.unit_rewards:
            easy, hard = reward - (1 - share), share - reward
            if easy > 0 and easy >= hard:
                return text + (
                    f"They are mostly too easy: at the mean reward {reward:.2f}, at least {easy:.0%} of the groups "
                    "scored the maximum on every completion. Use harder prompts (or drop the solved ones), or "
                    "dynamic_sampling=True."
                )
            if hard > 0 and hard > easy:
                return text + (
                    f"They are mostly too hard: at the mean reward {reward:.2f}, at least {hard:.0%} of the groups "
                    "scored the minimum on every completion. Use easier prompts, more num_generations, a higher "
                    "temperature, or a reward with partial credit."
                )
        return text + (
            f"Too easy if the mean reward is near its maximum, too hard if near its minimum. {self.advice} "
            "dynamic_sampling=True replaces such groups."
        )


class Unscored(Rule):
    """`unscored`: at least `threshold` of the completions were scored by no function (`frac_reward_unscored`), or a
    reward function scored no completion (`rewards/<name>/mean` NaN) in `WINDOW` scoring log steps in a row. One
    silent step says nothing: a function that returns `None` for the prompts of other tasks (TRL's pattern for a
    multi-task reward) is silent at a step without its task, while another function scores those completions."""

    alarms = {"unscored": Alarm(0.5, SHARE, "warn_unscored_fraction")}
    WINDOW = 10

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.silent: dict[str, int] = {}  # function -> scoring log steps in a row it scored nothing

    def unscored(self, entry):
        means = {name: value for key, value in entry.items() if (name := reward_function_of(key)) is not None}
        share = number(entry, FRAC_REWARD_UNSCORED)
        if not means and share is None:
            return None  # not a step that scored completions
        for name, value in means.items():
            self.silent[name] = self.silent.get(name, 0) + 1 if _no_value(value) else 0
        now = sorted(name for name, value in means.items() if _no_value(value))
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


def _no_value(value) -> bool:
    """`None`, or NaN (how TRL logs the mean of a reward that scored nothing)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _quoted(names: list[str]) -> str:
    return ", ".join(f"'{name}'" for name in names)
