"""The alarm rules that judge a value against the run's own history: entropy against its start, gradient-norm
spikes against a running median, the KL against its own running median 50 log steps earlier, completion length
against the reward and the run's start, a held-out metric against its best."""

from __future__ import annotations

import math
import re
import statistics

from ..metrics import (
    COMPLETIONS_MEAN_LENGTH,
    DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH,
    ENTROPY,
    GRAD_NORM,
    KL,
    REWARD,
    REWARD_LENGTH_CORR,
    REWARD_STD,
    REWARD_STD_GROUP_MEAN,
)
from .rule import (
    HELDOUT_KEY,
    SKIPPED_STEPS_KEY,
    Cadence,
    Rule,
    Series,
    _first_number,
    _number,
    _step,
    curvature_t,
    mean,
    pearson,
)


class EntropyCollapseRule(Rule):
    keys = (ENTROPY,)
    BASELINE = 3  # the first logged values whose mean is the reference

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.first: list[float] = []

    def judge(self, entry):
        value = _number(entry, ENTROPY)
        if value is None:
            return None
        if len(self.first) < self.BASELINE:
            self.first.append(value)
            return None  # the baseline, not judged
        baseline = mean(self.first)
        if baseline <= 0 or value >= self.threshold * baseline:
            return False
        return (
            f"entropy fell to {value:.3g}, {value / baseline:.0%} of its first logged values ({baseline:.3g}): the "
            "policy stopped exploring, its completions of a prompt become alike and their rewards equal. Raise "
            "temperature, lower the learning_rate, widen epsilon_high (clip-higher, e.g. 0.28), or add an entropy "
            "bonus (entropy_coef)."
        )


class GradNormSpikeRule(Rule):
    """`grad_norm` far above its running median, or not finite. Norms at or below `FLOOR` (steps without reward
    spread have next to no gradient) say nothing about the usual scale: they stay out of the median, so the first
    real gradient after a stretch of them is no spike.

    A non-finite norm logged where the guard's count (`nonfinite/skipped_steps`) rose since the last entry is that of
    a step the guard skipped: its update never reached the weights, the guard warned and counts it, so it is no
    spike (the entry does not tell). With the guard off (no count logged) it is one: that update was applied."""

    keys = (GRAD_NORM,)
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
        value = entry.get(GRAD_NORM)
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
        if baseline is None:
            return None  # too few values to judge yet
        if value <= self.threshold * max(baseline, self.FLOOR):
            return False
        return (
            f"grad_norm spiked to {value:.3g}, {value / max(baseline, self.FLOOR):.0f}x its running median "
            f"{baseline:.3g}: spikes like this often precede a collapse. Lower the learning_rate, set or lower "
            "max_grad_norm, or raise beta."
        )


class KLGrowthRule(Rule):
    """`kl` keeps growing, faster and faster: its running median has multiplied by at least `threshold` over the last
    `LAG` log steps, by at least its square root over the last `LAG / 2` of them, is at least `FLOOR`, and the episode
    starts only where the KL accelerates (the curvature of its last `LAG + SMOOTH` values is positive by at least
    `CURVATURE_T` standard errors; it goes on while the growth holds):

        now = median(kl[t - SMOOTH + 1 .. t]),  m(d) = the same median d log steps earlier
        grows when now >= threshold * m(LAG) and now >= sqrt(threshold) * m(LAG / 2) and now >= FLOOR
        starts when it grows and curvature_t(kl[t - LAG - SMOOTH + 1 .. t]) >= CURVATURE_T
        (judged from the (LAG + SMOOTH)th logged kl)

    `KLJumpRule` compares one value with the last 10 and `KLHighRule` waits for a level (1.0): a KL that doubles
    every few dozen log steps passes neither until late. The peers' blow-ups (rl-doctor's `kl_blowup`, rlprobe's) are
    flagged at steps 85-86 and 303-307 over 10 seeds; rlprobe flags them at 114-121 and 308-313, `kl_high` at about
    213 and 424 (docs/diagnostics.md, "Peer scenarios").

    Every run's KL rises from 0 as the policy leaves the reference, and such a rise stops; medians over 20 log steps
    lag it, so that ratios of them alone still read growth 10 log steps after a rise stopped (a rise from 0 that ends
    between steps 60 and 100 was flagged in 19-20 of 20 simulated runs, at step 70). A blow-up accelerates (rlprobe's
    grows exponentially, rl-doctor's quadratically); a rise from 0 is a straight line at best, and one that stops
    bends down: the curvature tells them apart (3 standard errors: no such rise, ending at steps 50-100 at a level of
    0.2 to 1.0 under 0-30% noise per step, is flagged over 20 seeds; the peers' blow-ups are flagged at the same
    steps as by the ratios alone).

    `FLOOR`: a KL growing linearly from near 0 doubles over any 50 log steps while it is small (rl-doctor's healthy
    run, 0.02 to 0.37 over 400 steps, while below 0.086): above 0.1 its ratio stays below 1.7 over 10 seeds.
    `SMOOTH` is 20, not 10: one step's KL is noisy (the demo logged at every step: 0.2 to 0.9 late in its run); a
    median over 20 log steps takes in most of a run's rise from 0. rlprobe's blow-up grows 1.5x per 25 steps;
    rl-doctor's (quadratic) slows below 1.4x per 25 steps near a KL of 0.8, where its episode may end and start again
    until `kl_high` takes over."""

    keys = (KL,)
    SMOOTH = 20  # log steps per running median
    LAG = 50  # log steps between the two medians compared
    FLOOR = 0.1  # the least running median that counts as a blow-up in the making
    CURVATURE_T = 3.0  # standard errors of positive curvature that start an episode

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.values: list[float] = []  # the last LAG + SMOOTH logged values
        self.growing = False  # in an episode: the growth held at the last judged entry

    def judge(self, entry):
        value = _number(entry, KL)
        if value is None:  # a non-finite KL is `KLHighRule`'s
            return None
        self.values = (self.values + [value])[-(self.LAG + self.SMOOTH) :]
        if len(self.values) < self.LAG + self.SMOOTH:
            return None  # too few values to judge yet
        half = self.LAG // 2
        then = statistics.median(self.values[: self.SMOOTH])
        halfway = statistics.median(self.values[half : half + self.SMOOTH])
        now = statistics.median(self.values[-self.SMOOTH :])
        grows = now >= self.FLOOR and now >= self.threshold * then and now >= math.sqrt(self.threshold) * halfway
        self.growing = grows and (self.growing or curvature_t(self.values) >= self.CURVATURE_T)
        if not self.growing:
            return False
        factor = f" ({now / then:.1f}x)" if then > 0 else ""
        return (
            f"kl keeps growing: its median over the last {self.SMOOTH} log steps is {now:.3g}, up from {halfway:.3g} "
            f"{self.LAG - half} and {then:.3g} {self.LAG} log steps earlier{factor}. The policy is leaving the "
            "reference faster and faster, a KL blow-up before kl_high's level. Lower the learning_rate, raise beta, "
            "or check the rewards for hacking."
        )


class LengthDriftRule(Rule):
    """Across log steps: the mean completion length moves in step with the rising reward."""

    keys = (COMPLETIONS_MEAN_LENGTH, REWARD)
    #: The mean completion length of the batch that trains (under dynamic sampling, `completions/*` count every
    #: generated round while `reward` is the trained batch's).
    LENGTH_KEYS = (DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH, COMPLETIONS_MEAN_LENGTH)
    WINDOW = 10  # the last log steps carrying both the reward and the length
    MIN_WINDOW = 6
    MIN_CHANGE = 0.2  # relative change of the length (mean of the window's second half over its first half)

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.pairs: list[tuple[float, float]] = []

    def judge(self, entry):
        reward, (_, length) = _number(entry, REWARD), _first_number(entry, self.LENGTH_KEYS)
        if reward is None or length is None:
            return None
        self.pairs = (self.pairs + [(reward, length)])[-self.WINDOW :]
        if len(self.pairs) < self.MIN_WINDOW:
            return None  # too few values to judge yet
        rewards, lengths = [pair[0] for pair in self.pairs], [pair[1] for pair in self.pairs]
        half = len(self.pairs) // 2
        length_before, length_after = mean(lengths[:half]), mean(lengths[-half:])
        reward_before, reward_after = mean(rewards[:half]), mean(rewards[-half:])
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

    keys = (COMPLETIONS_MEAN_LENGTH,)
    BASELINE = 5
    RECENT = 5

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.lengths = Series(self.BASELINE, self.RECENT)

    def judge(self, entry):
        _, length = _first_number(entry, LengthDriftRule.LENGTH_KEYS)
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
            "completions/clipped_ratio) and every step costs more. Check the reward on long and short completions; "
            "cap or penalise length in the reward. Where the task rewards longer reasoning, raise the threshold."
        )


class LengthInGroupRule(Rule):
    """Inside groups: the longer completions of a prompt score higher (GRPOTrainerExt's pooled correlation)."""

    keys = (REWARD_LENGTH_CORR,)

    def judge(self, entry):
        value = _number(entry, REWARD_LENGTH_CORR)
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
    than `threshold` of that best and by more than the evaluation's noise:

    - where the evaluation's sample size was logged (`heldout/<metric>/scored@<k>`) and the metric lies in [0, 1],
      `NOISE_SE` standard errors of the difference: sqrt(p_best (1 - p_best) / n_best + p (1 - p) / n);
    - else the series' own spread: `NOISE_SE` standard deviations of the differences between successive
      evaluations before this one (a difference of two evaluations is what the drop is), judged once `MIN_SPREAD`
      such differences are there (before, the evaluation does not tell: `None`). A trend moves every difference
      alike and adds nothing to their spread.

    The best is the highest of every evaluation so far, so it carries the luck of the best draw: with 2 standard
    errors a run whose held-out accuracy does not move fired in 40% (10 evaluations) to 80% (20) of simulated
    runs, with 3 in 5% to 20%. 3 still flags 0.6 -> 0.3 over 50 completions (3.2 standard errors) and over 200
    (6.3). The relative drop alone flagged rl-doctor's healthy run evaluated every 25 steps in 7 of 10 seeds (0.214 ->
    0.183 at step 101, within its noise); with the series' spread none, and its reward-hacking run in all 10
    (tests/test_health_scenarios.py)."""

    keys = ("heldout/<metric>/mean@<k>", REWARD)
    RECENT = 3  # training rewards averaged around a held-out evaluation
    NOISE_SE = 3.0  # standard errors (or deviations of the differences) a drop must exceed
    MIN_SPREAD = 4  # differences between successive evaluations before the series' spread is known
    HISTORY = 50  # evaluations whose differences make the spread

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.rewards: list[float] = []
        #: key -> (value, its noise variance or None, the reward then, step)
        self.best: dict[str, tuple[float, float | None, float | None, int | None]] = {}
        self.series: dict[str, list[float]] = {}  # key -> its last HISTORY evaluations

    def _recent_reward(self) -> float | None:
        return mean(self.rewards[-self.RECENT :]) if self.rewards else None

    def _allowance(self, key: str, noise: float | None, best_noise: float | None) -> tuple[float, str] | None:
        """How far below its best an evaluation of `key` may fall by its noise alone, and how that was measured;
        `None` while it cannot be known (no sample size, too few evaluations before this one)."""
        if noise is not None and best_noise is not None:
            return self.NOISE_SE * math.sqrt(noise + best_noise), f"{self.NOISE_SE:g} standard errors"
        before = self.series[key][:-1]
        if len(before) <= self.MIN_SPREAD:
            return None
        differences = [later - earlier for earlier, later in zip(before, before[1:], strict=False)]
        centre = mean(differences)
        spread = math.sqrt(sum((d - centre) * (d - centre) for d in differences) / (len(differences) - 1))
        return self.NOISE_SE * spread, f"{self.NOISE_SE:g} standard deviations of its successive differences"

    def judge(self, entry):
        reward = _number(entry, REWARD)
        if reward is not None:
            self.rewards.append(reward)
        found = None
        for key in sorted(entry):
            match = HELDOUT_KEY.match(key)
            if match is None or _number(entry, key) is None:
                continue
            value, now = _number(entry, key), self._recent_reward()
            self.series[key] = (self.series.get(key, []) + [value])[-self.HISTORY :]
            noise = _heldout_noise(value, _number(entry, _heldout_size_key(match)))
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


class RewardScaleRule(Rule):
    """The reward's spread jumps against its own recent history: the median of its last `RECENT` training steps (at
    least one log entry) is at least `threshold` times the largest of the `HISTORY` steps before them (at least
    `MIN_HISTORY` entries), that history being steady (above 0, its largest at most `STEADY` times its median). The
    spread is this package's `reward_std/group_mean` (inside groups), else TRL's `reward_std` (over the batch).

    Learning a bounded reward moves its spread slowly and within its bounds (a 0/1 reward's std inside a group of 8
    cannot exceed 0.53: learned from a pass rate of 0.5% to 60% over 20 to 100 steps, it grows about 15-fold, but
    never 4-fold past the largest of the steps before within 3 steps, logged every step or every 10); a spread that
    multiplies within a few steps and stays is the mark of a reward whose scale changed (rlwatch's scenario: 0.5 to
    5.4 at step 110). A history without a steady scale (a too-hard run's spread near 0, most groups flat) has none to
    jump from. The episode ends once the history has caught up with the new level."""

    keys = (REWARD_STD_GROUP_MEAN, REWARD_STD)
    RECENT = 3  # training steps of the new level
    HISTORY = 20  # training steps before them
    MIN_HISTORY = 10  # log entries of the history, at least
    STEADY = 3.0  # the history's largest value at most this many times its median

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.cadence = Cadence()
        self.values: list[float] = []

    def judge(self, entry):
        key, value = _first_number(entry, self.keys)
        if value is None:
            return None
        self.cadence.add(_step(entry))
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


class VanishingGradientRule(Rule):
    """`grad_norm` vanishes without reaching 0: the median of its last `RECENT` logged values is above 0 and below
    `threshold` times the median of its first `BASELINE` logged values above 0. `no_gradient` catches an exact 0;
    this catches updates that shrink to nothing (every advantage tiny, a loss scaled down by a bug; a learning-rate
    schedule is not a cause: `grad_norm` is taken before the learning rate scales the update)."""

    keys = (GRAD_NORM,)
    BASELINE = 5
    RECENT = 5

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.norms = Series(self.BASELINE, self.RECENT)

    def judge(self, entry):
        value = _number(entry, GRAD_NORM)
        if value is None or not math.isfinite(value):
            return None
        self.norms.add(value, start=value > 0)
        if not self.norms.full():
            return None  # too few values to judge yet
        start, now = self.norms.start(), self.norms.now()
        if now <= 0 or now >= self.threshold * start:
            return False
        return (
            f"grad_norm fell to {now:.3g} (median of the last {self.RECENT} log steps), {now / start:.1%} of its "
            f"start ({start:.3g}): the updates vanish without stopping. Check the reward spread "
            "(frac_reward_zero_std: advantages near 0 everywhere), the loss's scale (loss_type, a gradient "
            "accumulation or scaling bug), and whether most tokens are clipped."
        )
