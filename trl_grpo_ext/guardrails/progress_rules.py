"""The alarm rules that judge whether the run is still making progress: the reward's plateau, groups that stay
without reward spread (too easy or too hard), a reward that gives back its gain, and an auxiliary reward function
(format, tags, length) that carries the reward's variation while the task's does not."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Collection, Mapping

from ..metrics import REWARD, reward_function_metric, reward_function_of
from .rule import ZERO_SPREAD_KEYS, Cadence, Rule, _first_number, _number, _step


def _function_means(entry: Mapping) -> dict[str, float]:
    """Each reward function's logged mean (`rewards/<name>/mean`), where it is a number."""
    means = {}
    for key in entry:
        if (name := reward_function_of(key)) is not None:
            value = _number(entry, key)
            if value is not None:
                means[name] = value
    return means


class RunningMedian:
    """A metric's running median over the last `steps` training steps, as the run logs it (`Cadence`): over
    `Cadence.entries(steps, least)` log entries, 10 at one entry per step, 5 at one per 10 or 50 (each entry then
    averages its steps' values already). `add` returns `None` until the window is full.

    Its noise is the series' own: `sigma`, the scatter of the last `HISTORY` differences between successive values
    (1.4826 times their median absolute deviation, over sqrt(2): a normal's standard deviation), which a trend does
    not inflate and a few values do not make small by chance. `error` is the standard error of the running median,
    `1.2533 sigma / sqrt(n)` for a window of `n` values of normal noise; `step_error` that of a median over `steps`
    steps logged one by one, `1.2533 sigma_step / sqrt(steps)` with `sigma_step = sigma sqrt(interval)` (an entry
    averages its interval's steps), and at least `error`: a change counts where a run logged at every step would see
    it, so that logging less often does not make a drift of no practical size significant (rl-doctor's plateau,
    still rising 0.01 over 150 steps, would set new bests logged every 10)."""

    HISTORY = 200  # successive differences whose scatter is the noise

    def __init__(self, steps: int, least: int):
        self.steps, self.least = steps, least
        self.cadence = Cadence()
        self.values: list[float] = []
        self.differences: list[float] = []
        self.size = least  # the entries of the last window

    def add(self, value: float, step: float | None) -> float | None:
        self.cadence.add(step)
        self.size = self.cadence.entries(self.steps, self.least)
        if self.values:
            self.differences = (self.differences + [value - self.values[-1]])[-self.HISTORY :]
        self.values = (self.values + [value])[-max(self.steps, self.least) :]
        return statistics.median(self.values[-self.size :]) if len(self.values) >= self.size else None

    def sigma(self) -> float:
        middle = statistics.median(self.differences)
        return 1.4826 * statistics.median(abs(value - middle) for value in self.differences) / math.sqrt(2)

    def error(self) -> float:
        """The standard error of the running median."""
        return 1.2533 * self.sigma() / math.sqrt(self.size)

    def step_error(self) -> float:
        """The standard error of the running median as a run logged at every step would see it."""
        return 1.2533 * self.sigma() * math.sqrt(max(self.cadence.interval() / self.steps, 1 / self.size))


class PlateauRule(Rule):
    """The reward made no progress for `threshold` training steps: its running median (over `SMOOTH` steps, at least
    `MIN_SMOOTH` log entries: `RunningMedian`) has not risen above its best by more than `NOISE_SE` standard errors of
    such a median since then (its standard error from the series' own noise, `RunningMedian.step_error`: as a run
    logged at every step would see it), so a noisy but rising
    reward keeps setting new bests and a flat one stops; 1.75, not 1: the best is the luckiest median so far, and a
    flat reward's medians beat it by one standard error now and then, which would end a plateau by chance (with 1.5,
    one of rl-doctor's 10 plateau runs set a chance best at step 256 and went unflagged). A run that
    never improves at all is a plateau from its start. A `note`: a converged run plateaus too, and then its remaining
    steps cost compute for nothing.

    The length counts training steps, not log entries (at least `MIN_PATIENCE` of them), so that a run logged every
    10 or 50 steps is judged as one logged at every step (400 steps logged every 10: 40 entries, a window of 5; logged
    every 50, 8 entries are too short to tell, 16 are not). Until the run either gained (its best
    is `GAIN_SE` standard errors of a difference of two medians above its first running median) or plateaued, the
    rule cannot tell (`None`): a run too short to have learned anything is not called fine."""

    keys = (REWARD,)
    SMOOTH = 10  # training steps of the running median
    MIN_SMOOTH = 5  # log entries of the running median, at least
    NOISE_SE = 1.75
    GAIN_SE = 3.0  # standard errors of a difference of two medians that make a gain
    # log entries without a new best, at least: logged every 50 steps, 150 steps are 3 entries, and with 3 one of 20
    # healthy peer runs logged so (rlprobe's, rising more slowly at its end) was flagged; with 4 none.
    MIN_PATIENCE = 4
    severity = "note"

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards = RunningMedian(self.SMOOTH, self.MIN_SMOOTH)
        self.entries = 0  # the reward's entries so far: the clock of a history without steps
        self.first: float | None = None  # the first running median
        self.best: float | None = None
        self.since = 0.0  # the step (or entry) at which the best was set
        self.entries_since = 0  # the reward's entries since then

    def judge(self, entry):
        value = _number(entry, REWARD)
        if value is None:
            return None
        self.entries += 1
        step = _step(entry)
        median = self.rewards.add(value, step)
        if median is None:
            return None
        now = step if step is not None else self.entries
        error = self.rewards.step_error()
        if self.best is None:
            self.first, self.best, self.since, self.entries_since = median, median, now, 0
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
        if self.best - self.first > self.GAIN_SE * math.sqrt(2) * error:
            return False
        return None  # no gain yet, and not for long enough to call it a plateau

    def pending(self) -> str:
        window = f"a running median over {self.rewards.size} log entries"
        if self.best is None:
            return f"{window} first, then a gain beyond the reward's noise or {self.threshold:g} steps without one"
        return f"a gain beyond the reward's noise, or {self.threshold:g} steps without one (after {window})"


class FlatGroupsRule(Rule):
    """Most groups stay without reward spread: the share of groups whose rewards are all equal (`ZERO_SPREAD_KEYS`)
    is at least `threshold` at each log step of the last `WINDOW` training steps (at least `MIN_WINDOW` log entries:
    10 at one entry per step, 3 at one per 10 or 50, each an average over its steps already). A `note`, below
    `zero_std`'s warning (90% at one step): the run still learns from the other groups, at a fraction of its cost.

    Which way the groups are flat follows from the mean reward `r` and the flat share `z` where every logged reward
    lies in [0, 1] (a 0/1 reward, say): the groups with spread hold at most `1 - z` of the reward's mass and at least
    none of it, so at least `r - (1 - z)` of the groups scored the maximum everywhere (too easy) and at least `z - r`
    scored the minimum everywhere (too hard); the larger bound names the side.

    The default, 60%, on the peers' scenarios: rlprobe's degenerate groups (a share rising to 75%) are flagged about
    step 460 of 500; rl-doctor's too-easy (a pass rate near 97%) and too-hard (near 3.5%) runs at about step 230 and
    step 10, and no healthy scenario (at most 20%). 50% also flags rl-doctor's reward-hacking run at its end."""

    keys = ZERO_SPREAD_KEYS
    WINDOW = 10  # training steps
    MIN_WINDOW = 3  # log entries, at least
    severity = "note"

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.cadence = Cadence()
        self.shares: list[float] = []
        self.unit_rewards = True  # every logged reward so far lies in [0, 1]

    def judge(self, entry):
        reward = _number(entry, REWARD)
        if reward is not None and not 0.0 <= reward <= 1.0:
            self.unit_rewards = False
        _, share = _first_number(entry, ZERO_SPREAD_KEYS)
        if share is None:
            return None
        self.cadence.add(_step(entry))
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
                text += (
                    f"They are mostly too easy: at the mean reward {reward:.2f}, at least {easy:.0%} of the groups "
                    "scored the maximum on every completion. Use harder prompts (or drop the solved ones), or "
                    "dynamic_sampling=True."
                )
                return text
            if hard > 0 and hard > easy:
                text += (
                    f"They are mostly too hard: at the mean reward {reward:.2f}, at least {hard:.0%} of the groups "
                    "scored the minimum on every completion. Use easier prompts, more num_generations, a higher "
                    "temperature, or a reward with partial credit."
                )
                return text
        return text + (
            "Too easy if the mean reward is near its maximum, too hard if near its minimum: change the prompts' "
            "difficulty, raise num_generations or temperature, or use dynamic_sampling=True."
        )


class RewardDropRule(Rule):
    """The reward gives back what it gained: its running median (over `SMOOTH` training steps, at least `MIN_SMOOTH`
    log entries: `RunningMedian`; 10 entries either way) has fallen from its best by at least `threshold` of the gain
    from the run's start (its first running median) to that best, and by more than `NOISE_SE` standard errors of a
    difference of two such medians (the series' own noise, `RunningMedian.error`), after a gain larger than that
    noise too (before it, the rule cannot tell: `None`). A reward that rises steadily (learning) or drifts up and
    stays is no drop; a collapse after learning, or a reward that slowly drifts down from its best, is."""

    keys = (REWARD,)
    SMOOTH = 10
    # 10 log entries, however often the run logs: with 5, one of 10 flat runs of 2,000 steps logged every 10 gave a
    # chance gain back (none of 20 with 8 or 10).
    MIN_SMOOTH = 10
    NOISE_SE = 4.0  # 3 fired on 1 of 30 flat noisy runs of 500 log steps, 4 on none; collapses are found as early

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards = RunningMedian(self.SMOOTH, self.MIN_SMOOTH)
        self.start: float | None = None
        self.best: float | None = None

    def judge(self, entry):
        value = _number(entry, REWARD)
        if value is None:
            return None
        now = self.rewards.add(value, _step(entry))
        if now is None:
            return None
        if self.start is None:
            self.start = now
        self.best = now if self.best is None else max(self.best, now)
        size = self.rewards.size
        noise = self.NOISE_SE * math.sqrt(2) * self.rewards.error()
        gain, drop = self.best - self.start, self.best - now
        if gain <= noise:
            return None  # nothing gained yet: nothing to give back
        if drop <= noise or drop < self.threshold * gain:
            return False
        return (
            f"the reward fell from its best {self.best:.3g} to {now:.3g} (running medians of {size} log steps), "
            f"giving back {drop / gain:.0%} of what it gained since the start ({self.start:.3g}): the policy is "
            "unlearning (a collapse after too large updates, or a reward whose easy part is exhausted). Lower the "
            "learning_rate, raise beta, and keep the best checkpoint (metric_for_best_model, load_best_model_at_end)."
        )


#: Words of a reward function's name that mark it as auxiliary (it scores the form of a completion, not whether it
#: solves the task): `format_reward`, `xml_tags`, `think_length`, `language_consistency`... `xmlcount` is one word in
#: the function names of the GRPO script most recipes copied (`xmlcount_reward_func`).
AUXILIARY_WORDS = frozenset(
    {
        "format", "formats", "formatted", "formatting", "tag", "tags", "xml", "xmlcount", "json", "length", "len",
        "lang", "language", "style", "think", "thinking",
    }
)  # fmt: skip

#: A word of a name: a run of capitals (an acronym, `XML`), or an optional capital and lower-case letters.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def name_words(function: str) -> list[str]:
    """The words of a reward function's name, lower-cased: split at `_`, `-`, any other sign, digits and camelCase
    (`XMLTagReward` -> `xml`, `tag`, `reward`)."""
    return [word.lower() for word in _WORD.findall(function)]


def is_auxiliary(function: str, named: Collection[str] | None = None) -> bool:
    """Whether the reward function `function` is auxiliary: one of `named` where the run names its auxiliary functions
    (`warn_auxiliary_rewards`), else by a whole word of its name (`AUXILIARY_WORDS`): `information_gain` holds the
    letters of "format" and no such word."""
    if named is not None:
        return function in named
    return not AUXILIARY_WORDS.isdisjoint(name_words(function))


def _spread(values: list[float]) -> float:
    """A robust variance: the square of 1.4826 times the values' median absolute deviation."""
    middle = statistics.median(values)
    scatter = 1.4826 * statistics.median(abs(value - middle) for value in values)
    return scatter * scatter


def auxiliary_share(windows: Mapping[str, list[float]], auxiliary: Collection[str]) -> float | None:
    """The share of the functions `auxiliary` in the reward functions' summed spread (`_spread`) over `windows`
    (function -> its logged means); `None` when no function varies at all."""
    spreads = {function: _spread(values) for function, values in windows.items()}
    total = sum(spreads.values())
    if not total > 0:
        return None
    return sum(spread for function, spread in spreads.items() if function in auxiliary) / total


class RewardCompositionRule(Rule):
    """An auxiliary reward function (named as one by the run, `warn_auxiliary_rewards`, else by a word of its name,
    `AUXILIARY_WORDS`) carries the reward's variation: over the log entries of the last `WINDOW` training steps (at
    least `MIN_WINDOW` entries: 150 at one entry per step, 20 at one per 10 or 50), and over the last quarter of them,
    the auxiliary functions' share of the summed robust variance of every function's logged mean
    (`rewards/<function>/mean`) is at least `threshold`:

        spread(f) = (1.4826 * median |m_f(t) - median m_f|)^2   over the window's log steps t
        share = sum of spread(f) over the auxiliary f / sum of spread(f) over every f

    The policy gradient follows what varies between completions: a function whose per-step mean does not move (its
    trend nor its noise) teaches nothing. A task reward that keeps scoring near 0 has little spread (the noise of a
    mean of 0/1 scores, `sqrt(p (1 - p) / n)`, is small near 0 and near 1), as has one that stalls while the format
    reward rises (format gaming); a task reward that is learned rises and, near the middle of its range, is noisy. A
    format reward that saturates early (every recipe's) has carried the variation while it rose, and little after:
    the share over the window's last quarter is what keeps that rise from counting once it is over, and the window
    keeps a run's first steps from being judged. A format reward still rising steadily a window into the run while the
    task's barely moves is flagged: that is format gaming as the logs show it.

    A mean of 0/1 scores is as noisy near 0 as near 1: a task reward near 0.02 under a format reward saturated at
    0.98 gives a share near 0.5 (that run's groups have no spread, `zero_std`'s and `flat_groups`' to flag); under a
    format reward still short of its maximum (0.85) it is about 0.85.

    Judged from a window's logged means of at least one auxiliary and one other function; a run with one reward
    function, or none named auxiliary (or all of them), is never flagged. A function's NaN mean (TRL's when it scored
    nothing) is skipped. The peers' scenarios (docs/diagnostics.md, "Peer scenarios"): rl-doctor's format domination
    (correctness near 0.02 under a format reward near 0.97 whose noise it draws 6 times as large as in its healthy
    run: 0.06, not 0.01) reaches a share of 0.94-0.98 over 10 seeds and
    rlprobe's format gaming (correctness stalled at 0.44 while the format rises from 0.19 to 1.0) 0.99-1.0; their
    healthy runs stay at 0.33 and 0.16 at most."""

    keys = (reward_function_metric("<function>"),)
    WINDOW = 150  # training steps over which the shares are judged
    MIN_WINDOW = 20  # log entries, at least: a robust spread of fewer says little
    RECENT = 4  # the window's last quarter: the share there must be as large (not a rise that is over)

    def __init__(self, threshold: float, auxiliary: Collection[str] | None = None):
        super().__init__(threshold)
        self.auxiliary = None if auxiliary is None else frozenset(auxiliary)  # None: told by the names' words
        self.cadence = Cadence()
        self.means: dict[str, list[float]] = {}  # each function's last logged means, a window's at most

    def judge(self, entry):
        means = _function_means(entry)
        if not means:
            return None
        self.cadence.add(_step(entry))
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
