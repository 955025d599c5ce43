"""Whether the run still learns: the reward's progress (`Progress`) and a held-out metric that falls while the reward
rises (`HeldOut`)."""

from __future__ import annotations

import math
import re

from ...metrics import REWARD
from .rule import HELDOUT_KEY, POSITIVE, STEPS, Alarm, Rule, RunningMedian, mean, number, step_of

__all__ = ["HeldOut", "Progress"]


class Progress(Rule):
    """The reward's running median (`RunningMedian` over `SMOOTH` training steps, at least the given log entries):

    - `plateau` (a note): it has not risen above its best by more than `NOISE_SE` standard errors
      (`RunningMedian.step_error`: as a run logged at every step would see it) for `threshold` training steps and at
      least `MIN_PATIENCE` log entries. A run that never improves is a plateau from its start; until the reward
      gained (its best `GAIN_SE` standard errors of a difference of two medians above its first) or plateaued, the
      rule cannot tell (`None`): a run too short to have learned anything is not called fine;
    - `reward_drop`: it fell from its best by at least `threshold` times the gain from its first running median to
      that best, and by more than `DROP_SE` standard errors of a difference of two medians, after a gain larger than
      that too.
    """

    alarms = {
        "plateau": Alarm(150, STEPS, "warn_plateau_steps", "note"),
        "reward_drop": Alarm(0.5, POSITIVE, "warn_reward_drop"),
    }
    SMOOTH = 10
    MIN_SMOOTH = {"plateau": 5, "reward_drop": 10}  # log entries of the running median, at least
    NOISE_SE = 1.75
    GAIN_SE = 3.0
    MIN_PATIENCE = 4
    DROP_SE = 4.0

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.rewards = RunningMedian(self.SMOOTH, self.MIN_SMOOTH[name])
        self.start: float | None = None  # the first running median
        self.best: float | None = None
        self.entries = 0  # plateau: the reward's entries so far, the clock of a history without steps
        self.since = 0.0  # plateau: the step (or entry) at which the best was set
        self.entries_since = 0  # plateau: the reward's entries since then

    def plateau(self, entry):
        value = number(entry, REWARD)
        if value is None:
            return None
        self.entries += 1
        step = step_of(entry)
        median = self.rewards.add(value, step)
        if median is None:
            return None
        now = step if step is not None else self.entries
        error = self.rewards.step_error()
        if self.best is None:
            self.start, self.best, self.since, self.entries_since = median, median, now, 0
            return None
        if median > self.best + self.NOISE_SE * error:
            self.best, self.since, self.entries_since = median, now, 0
        else:
            self.entries_since += 1
        waited = now - self.since
        if waited >= self.threshold and self.entries_since >= self.MIN_PATIENCE:
            return (
                f"the reward has not improved for {waited:g} steps: its running median ({median:.3g}, over "
                f"{self.rewards.size} log steps) stays within its noise of its best ({self.best:.3g}). The run has "
                "converged or stopped learning; if the held-out metric is flat too, stop it, or change what limits "
                "it (harder prompts, a higher learning_rate, more num_generations or temperature)."
            )
        if self.best - self.start > self.GAIN_SE * math.sqrt(2) * error:
            return False
        return None  # no gain yet, and not for long enough to call it a plateau

    def reward_drop(self, entry):
        value = number(entry, REWARD)
        if value is None:
            return None
        now = self.rewards.add(value, step_of(entry))
        if now is None:
            return None
        if self.start is None:
            self.start = now
        self.best = now if self.best is None else max(self.best, now)
        noise = self.DROP_SE * math.sqrt(2) * self.rewards.error()
        gain, drop = self.best - self.start, self.best - now
        if gain <= noise:
            return None  # nothing gained yet: nothing to give back
        if drop <= noise or drop < self.threshold * gain:
            return False
        return (
            f"the reward fell from its best {self.best:.3g} to {now:.3g} (running medians of {self.rewards.size} log "
            f"steps), giving back {drop / gain:.0%} of what it gained since the start ({self.start:.3g}): the policy "
            "is unlearning (a collapse after too large updates, or a reward whose easy part is exhausted). Lower the "
            "learning_rate, raise beta, and keep the best checkpoint (metric_for_best_model, load_best_model_at_end)."
        )

    def pending(self) -> str:
        window = f"a running median over {self.rewards.size} log entries"
        if self.name == "plateau" and self.best is not None:
            return f"a gain beyond the reward's noise, or {self.threshold:g} steps without one (after {window})"
        if self.name == "plateau":
            return f"{window} first, then a gain beyond the reward's noise or {self.threshold:g} steps without one"
        return super().pending()


class HeldOut(Rule):
    """`reward_vs_heldout`: the training reward (the mean of its last `RECENT` values) is above its level at a
    held-out metric's best (`heldout/<metric>/mean@<k>`) while that metric fell from its best by at least
    `threshold` of it and by more than the evaluation's noise:

    - where its sample size was logged (`heldout/<metric>/scored@<k>`) and it lies in [0, 1], `NOISE_SE` standard
      errors of the difference, `sqrt(p_best (1 - p_best) / n_best + p (1 - p) / n)` (the binomial variance, the
      largest a [0, 1] score with that mean can have);
    - else `NOISE_SE` standard deviations of the differences between its successive evaluations before this one,
      judged once more than `MIN_SPREAD` are there (a trend moves every difference alike).
    """

    alarms = {"reward_vs_heldout": Alarm(0.1, POSITIVE, "warn_heldout_drop")}
    RECENT = 3
    NOISE_SE = 3.0
    MIN_SPREAD = 4
    HISTORY = 50  # evaluations whose differences make the spread

    def __init__(self, name: str, threshold: float, **settings):
        super().__init__(name, threshold)
        self.rewards: list[float] = []
        #: key -> (value, its noise variance or None, the reward then, step)
        self.best: dict[str, tuple[float, float | None, float | None, int | None]] = {}
        self.series: dict[str, list[float]] = {}  # key -> its last HISTORY evaluations

    def _allowance(self, key: str, noise: float | None, best_noise: float | None) -> tuple[float, str] | None:
        """How far below its best an evaluation of `key` may fall by its noise alone, and how that was measured;
        `None` while it cannot be known."""
        if noise is not None and best_noise is not None:
            return self.NOISE_SE * math.sqrt(noise + best_noise), f"{self.NOISE_SE:g} standard errors"
        before = self.series[key][:-1]
        if len(before) <= self.MIN_SPREAD:
            return None
        differences = [later - earlier for earlier, later in zip(before, before[1:], strict=False)]
        centre = mean(differences)
        spread = math.sqrt(sum((d - centre) * (d - centre) for d in differences) / (len(differences) - 1))
        return self.NOISE_SE * spread, f"{self.NOISE_SE:g} standard deviations of its successive differences"

    def reward_vs_heldout(self, entry):
        reward = number(entry, REWARD)
        if reward is not None:
            self.rewards.append(reward)
        found = None
        for key in sorted(entry):
            match = HELDOUT_KEY.match(key)
            value = number(entry, key) if match else None
            if value is None:
                continue
            now = mean(self.rewards[-self.RECENT :]) if self.rewards else None
            self.series[key] = (self.series.get(key, []) + [value])[-self.HISTORY :]
            noise = _binomial_noise(value, number(entry, _size_key(match)))
            best = self.best.get(key)
            if best is None or value >= best[0]:
                self.best[key] = (value, noise, now, entry.get("step"))
                found = found or False
                continue
            best_value, best_noise, reward_then, best_step = best
            allowance = self._allowance(key, noise, best_noise)
            if allowance is None:
                continue  # its noise is not known yet
            found = found or False
            if reward_then is None and self.rewards:  # the best came before any training reward (step 0)
                reward_then = self.rewards[0]
            drop = best_value - value
            fell = drop >= self.threshold * max(abs(best_value), 1e-8) and drop > allowance[0]
            if fell and reward_then is not None and now is not None and now > reward_then:
                at = f" (step {best_step})" if best_step is not None else ""
                found = (
                    f"{key} fell from its best {best_value:.3g}{at} to {value:.3g}, more than the evaluation's noise "
                    f"({allowance[1]}: {allowance[0]:.3g}), while the training reward rose from {reward_then:.3g} to "
                    f"{now:.3g}: the policy may be exploiting the reward rather than learning the task (reward "
                    "hacking). Read completions for loopholes the reward pays for, raise beta, and keep the best "
                    f"checkpoint (metric_for_best_model='{key}', load_best_model_at_end=True)."
                )
        return found


def _size_key(match: re.Match) -> str:
    """`heldout/<metric>/scored@<k>` (its sample size) for the held-out mean `match` (of `HELDOUT_KEY`)."""
    key = match.string
    return key[: match.start("metric")] + f"{match['metric']}/scored@{match['k']}"


def _binomial_noise(value: float, size: float | None) -> float | None:
    """The variance `p (1 - p) / n` of a mean `p` over `n` scored completions, `None` when not known: no size logged
    (a stock or older run), or a mean outside [0, 1] (a metric on another scale)."""
    if size is None or size < 1 or not 0.0 <= value <= 1.0:
        return None
    return value * (1.0 - value) / size
