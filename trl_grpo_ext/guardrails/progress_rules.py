"""The alarm rules that judge whether the run is still making progress: the reward's plateau, groups that stay
without reward spread (too easy or too hard), a reward that gives back its gain, and an auxiliary reward function
(format, tags, length) that carries the reward's variation while the task's does not."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Collection, Mapping

from ..metrics import REWARD, reward_function_metric, reward_function_of
from .rule import ZERO_SPREAD_KEYS, Rule, Series, _first_number, _number, mean


def slope_t(values: list[float]) -> float:
    """The t statistic of the least-squares slope of `values` against their index: the slope over its standard
    error, `b / (s / sqrt(sum((i - mean i)^2)))` with `s^2` the residuals' variance over `n - 2`. 0 for a constant
    series (no trend) or fewer than 3 values; +-inf for an exact line."""
    n = len(values)
    if n < 3:
        return 0.0
    mean_i, mean_v = (n - 1) / 2, mean(values)
    sxx = sum((i - mean_i) ** 2 for i in range(n))
    slope = sum((i - mean_i) * (v - mean_v) for i, v in enumerate(values)) / sxx
    residuals = [v - mean_v - slope * (i - mean_i) for i, v in enumerate(values)]
    residual = sum(r * r for r in residuals) / (n - 2)
    if residual <= 1e-24:
        return 0.0 if abs(slope) <= 1e-12 else math.copysign(math.inf, slope)
    return slope / math.sqrt(residual / sxx)


def _function_means(entry: Mapping) -> dict[str, float]:
    """Each reward function's logged mean (`rewards/<name>/mean`), where it is a number."""
    means = {}
    for key in entry:
        if (name := reward_function_of(key)) is not None:
            value = _number(entry, key)
            if value is not None:
                means[name] = value
    return means


class PlateauRule(Rule):
    """The reward made no progress for `threshold` log steps: its running median (over `SMOOTH` log steps) has not
    risen above its best by more than `NOISE_SE` standard errors of such a median since then. The standard error is
    `1.2533 sigma / sqrt(SMOOTH)` (a median of normal noise), `sigma` the scatter of the reward's last `SMOOTH`
    values (their median absolute deviation times 1.4826), so a noisy but rising reward keeps setting new bests and a
    flat one stops; 1.5, not 1: the best is the luckiest median so far, and a flat reward's medians beat it by one
    standard error now and then, which would end a plateau by chance. A run that never improves at all is a plateau
    from its start. A `note`: a converged run plateaus too, and then its remaining steps cost compute for nothing."""

    keys = (REWARD,)
    SMOOTH = 10  # log steps of the running median
    NOISE_SE = 1.5
    severity = "note"

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards = Series(0, self.SMOOTH)
        self.best: float | None = None
        self.since = 0  # log steps since the best was set

    def judge(self, entry):
        value = _number(entry, REWARD)
        if value is None:
            return None
        self.rewards.add(value)
        if not self.rewards.full():
            return False
        median = self.rewards.now()
        noise = self.NOISE_SE * 1.2533 * self.rewards.scatter() / math.sqrt(self.SMOOTH)
        if self.best is None or median > self.best + noise:
            self.best, self.since = median, 0
            return False
        self.since += 1
        if self.since < self.threshold:
            return False
        return (
            f"the reward has not improved for {self.since} log steps: its running median ({median:.3g}, over "
            f"{self.SMOOTH} log steps) stays within its noise of its best ({self.best:.3g}). The run has converged "
            "or stopped learning; if the held-out metric is flat too, stop it, or change what limits it (harder "
            "prompts, a higher learning_rate, more num_generations or temperature)."
        )


class FlatGroupsRule(Rule):
    """Most groups stay without reward spread: the share of groups whose rewards are all equal (`ZERO_SPREAD_KEYS`)
    is at least `threshold` at each of `WINDOW` log steps in a row. A `note`, below `zero_std`'s warning (90% at one
    step): the run still learns from the other groups, at a fraction of its cost.

    Which way the groups are flat follows from the mean reward `r` and the flat share `z` where every logged reward
    lies in [0, 1] (a 0/1 reward, say): the groups with spread hold at most `1 - z` of the reward's mass and at least
    none of it, so at least `r - (1 - z)` of the groups scored the maximum everywhere (too easy) and at least `z - r`
    scored the minimum everywhere (too hard); the larger bound names the side.

    The default, 60%, on the peers' scenarios: rlprobe's degenerate groups (a share rising to 75%) are flagged about
    step 460 of 500; rl-doctor's too-easy (a pass rate near 97%) and too-hard (near 3.5%) runs at about step 230 and
    step 10, and no healthy scenario (at most 20%). 50% also flags rl-doctor's reward-hacking run at its end."""

    keys = ZERO_SPREAD_KEYS
    WINDOW = 10
    severity = "note"

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.shares: list[float] = []
        self.unit_rewards = True  # every logged reward so far lies in [0, 1]

    def judge(self, entry):
        reward = _number(entry, REWARD)
        if reward is not None and not 0.0 <= reward <= 1.0:
            self.unit_rewards = False
        _, share = _first_number(entry, ZERO_SPREAD_KEYS)
        if share is None:
            return None
        self.shares = (self.shares + [share])[-self.WINDOW :]
        if len(self.shares) < self.WINDOW or min(self.shares) < self.threshold:
            return False
        text = (
            f"{min(self.shares):.0%} or more of the groups ({share:.0%} now) had no reward spread at each of the "
            f"last {self.WINDOW} log steps: those groups teach nothing and cost a full generation each. "
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
    """The reward gives back what it gained: its running median (over `SMOOTH` log steps) has fallen from its best by
    at least `threshold` of the gain from the run's start (its first running median) to that best, and by more than
    `NOISE_SE` standard errors of a difference of two such medians (the scatter pooled over the run), after a gain
    larger than that noise too. A reward
    that rises steadily (learning) or drifts up and stays is no drop; a collapse after learning, or a reward that
    slowly drifts down from its best, is."""

    keys = (REWARD,)
    SMOOTH = 10
    NOISE_SE = 4.0  # 3 fired on 1 of 30 flat noisy runs of 500 log steps, 4 on none; collapses are found as early
    HISTORY = 200  # windows whose scatter is pooled

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards = Series(0, self.SMOOTH)
        self.start: float | None = None
        self.best: float | None = None
        self.sigmas: list[float] = []

    def judge(self, entry):
        value = _number(entry, REWARD)
        if value is None:
            return None
        self.rewards.add(value)
        if not self.rewards.full():
            return False
        now = self.rewards.now()
        if self.start is None:
            self.start = now
        self.best = now if self.best is None else max(self.best, now)
        # The scatter of one window of 10 is itself noisy (a small one would let chance excursions count): the
        # median of every window's so far.
        self.sigmas = (self.sigmas + [self.rewards.scatter()])[-self.HISTORY :]
        noise = self.NOISE_SE * 1.2533 * statistics.median(self.sigmas) * math.sqrt(2 / self.SMOOTH)
        gain, drop = self.best - self.start, self.best - now
        if gain <= noise or drop <= noise or drop < self.threshold * gain:
            return False
        return (
            f"the reward fell from its best {self.best:.3g} to {now:.3g} (running medians of {self.SMOOTH} log "
            f"steps), giving back {drop / gain:.0%} of what it gained since the start ({self.start:.3g}): the policy "
            "is unlearning (a collapse after too large updates, or a reward whose easy part is exhausted). Lower the "
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
    `AUXILIARY_WORDS`) carries the reward's variation: over the last
    `WINDOW` log steps, and over the last `RECENT` of them, the auxiliary functions' share of the summed robust
    variance of every function's logged mean (`rewards/<function>/mean`) is at least `threshold`:

        spread(f) = (1.4826 * median |m_f(t) - median m_f|)^2   over the window's log steps t
        share = sum of spread(f) over the auxiliary f / sum of spread(f) over every f

    The policy gradient follows what varies between completions: a function whose per-step mean does not move (its
    trend nor its noise) teaches nothing. A task reward that keeps scoring near 0 has little spread (the noise of a
    mean of 0/1 scores, `sqrt(p (1 - p) / n)`, is small near 0 and near 1), as has one that stalls while the format
    reward rises (format gaming); a task reward that is learned rises and, near the middle of its range, is noisy. A
    format reward that saturates early (every recipe's) has carried the variation while it rose, and little after:
    the share over the last `RECENT` log steps is what keeps that rise from counting once it is over, and `WINDOW`
    (150) keeps a run's first steps from being judged. A format reward still rising steadily `WINDOW` log steps into
    the run while the task's barely moves is flagged: that is format gaming as the logs show it.

    A mean of 0/1 scores is as noisy near 0 as near 1: a task reward near 0.02 under a format reward saturated at
    0.98 gives a share near 0.5 (that run's groups have no spread, `zero_std`'s and `flat_groups`' to flag); under a
    format reward still short of its maximum (0.85) it is about 0.85.

    Judged from the `WINDOW`th logged mean of at least one auxiliary and one other function; a run with one reward
    function, or none named auxiliary (or all of them), is never flagged. A function's NaN mean (TRL's when it scored
    nothing) is skipped. The peers' scenarios (docs/diagnostics.md, "Peer scenarios"): rl-doctor's format domination
    (correctness near 0.02 under a format reward near 0.97 whose noise it draws 6 times as large as in its healthy
    run: 0.06, not 0.01) reaches a share of 0.94-0.98 over 10 seeds and
    rlprobe's format gaming (correctness stalled at 0.44 while the format rises from 0.19 to 1.0) 0.99-1.0; their
    healthy runs stay at 0.33 and 0.16 at most."""

    keys = (reward_function_metric("<function>"),)
    WINDOW = 150  # log steps over which the shares are judged
    RECENT = WINDOW // 4  # the last log steps whose share must be as large: not a rise that is over

    def __init__(self, threshold: float, auxiliary: Collection[str] | None = None):
        super().__init__(threshold)
        self.auxiliary = None if auxiliary is None else frozenset(auxiliary)  # None: told by the names' words
        self.means: dict[str, list[float]] = {}  # each function's last WINDOW logged means

    def judge(self, entry):
        means = {name: value for name, value in _function_means(entry).items() if math.isfinite(value)}
        if not means:
            return None
        for name, value in means.items():
            self.means[name] = (self.means.get(name, []) + [value])[-self.WINDOW :]
        windows = {name: values for name, values in self.means.items() if len(values) == self.WINDOW}
        auxiliary = sorted(name for name in windows if is_auxiliary(name, self.auxiliary))
        if not auxiliary or len(auxiliary) == len(windows):
            return False
        share = auxiliary_share(windows, auxiliary)
        recent = auxiliary_share({name: values[-self.RECENT :] for name, values in windows.items()}, auxiliary)
        if share is None or recent is None or min(share, recent) < self.threshold:
            return False
        task = ", ".join(
            f"{name} {statistics.median(values[-self.RECENT :]):.3g}"
            for name, values in sorted(windows.items())
            if name not in auxiliary
        )
        return (
            f"the auxiliary reward function{'s' if len(auxiliary) > 1 else ''} {', '.join(auxiliary)} carr"
            f"{'y' if len(auxiliary) > 1 else 'ies'} {share:.0%} of the reward functions' variation over the last "
            f"{self.WINDOW} log steps ({recent:.0%} over the last {self.RECENT}), while the task's barely moves "
            f"(median of the last {self.RECENT}: {task}): the policy is learning the form, not the task (format "
            "gaming, or a task reward too hard to score). Read completions that score on the one and not on the "
            "other; make the auxiliary reward harder to earn without solving the task or lower its weight "
            "(reward_weights); if the task reward stays near 0, use easier prompts."
        )
