"""The alarms, by family: warnings, from a run's logged metrics, that it stopped learning or drifts. Each alarm is
counted as `alarms/<name>` and set by its threshold in `GRPOConfigExt.alarm_thresholds` (`None` switches it off).
`AnomalyMonitor` feeds the rules live; `trl-grpo-ext report` replays a run's log history through the same ones.

- `spread`: `Spread` (zero_std, no_spread, flat_groups), `Unscored` (unscored);
- `gradient`: `Gradient` (no_gradient, grad_norm_spike, vanishing_gradient);
- `kl`: `KL` (kl_jump, kl_high, kl_growth), `Entropy` (entropy_collapse);
- `ratio`: `Ratio` (ratio_p95, ratio_max), `Clip` (clip_fraction, clip_asymmetry);
- `length`: `Length` (length_drift, length_growth, length_in_group), `Truncation` (truncation, truncation_sustained);
- `progress`: `Progress` (plateau, reward_drop), `HeldOut` (reward_vs_heldout);
- `rewards`: `RewardScale` (reward_scale), `Composition` (reward_composition);
- `rule`: what a family is (`Rule`, `Alarm`) and what the families share.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from .gradient import Gradient
from .kl import KL, Entropy
from .length import Length, Truncation
from .progress import HeldOut, Progress
from .ratio import Clip, Ratio
from .rewards import Composition, RewardScale
from .rule import HELDOUT_KEY, SEVERITIES, ZERO_SPREAD_KEYS, Rule
from .spread import Spread, Unscored

__all__ = [
    "ALARMS",
    "DEFAULTS",
    "FAMILIES",
    "HELDOUT_KEY",
    "ORDER",
    "RENAMED",
    "SEVERITIES",
    "ZERO_SPREAD_KEYS",
    "Rule",
    "build_rules",
    "threshold_problems",
    "thresholds_of",
]

FAMILIES: tuple[type[Rule], ...] = (
    Spread,
    Unscored,
    Gradient,
    KL,
    Entropy,
    Ratio,
    Clip,
    Length,
    Truncation,
    Progress,
    HeldOut,
    RewardScale,
    Composition,
)
#: The order the monitor judges the alarms in (that of the warnings starting at one step, and of the report's ties).
ORDER = (
    "zero_std", "no_spread", "unscored", "no_gradient", "truncation", "truncation_sustained", "clip_fraction",
    "ratio_p95", "ratio_max", "kl_jump", "kl_high", "kl_growth", "entropy_collapse", "grad_norm_spike", "length_drift",
    "length_growth", "length_in_group", "reward_vs_heldout", "reward_scale", "vanishing_gradient", "clip_asymmetry",
    "flat_groups", "plateau", "reward_drop", "reward_composition",
)  # fmt: skip
#: alarm name -> its family, in `ORDER`.
ALARMS: dict[str, type[Rule]] = {name: family for name in ORDER for family in FAMILIES if name in family.alarms}
#: alarm name -> its default threshold.
DEFAULTS: dict[str, float] = {name: family.alarms[name].default for name, family in ALARMS.items()}
#: The `GRPOConfigExt` fields the thresholds had before `alarm_thresholds` -> the alarm: refused in a configuration,
#: read in the records of the runs that had them.
RENAMED: dict[str, str] = {family.alarms[name].was: name for name, family in ALARMS.items() if family.alarms[name].was}


def threshold_problems(thresholds, where: str = "alarm_thresholds") -> list[str]:
    """Every reason why `thresholds` (alarm name -> threshold or `None`) cannot be a run's, one sentence each: a
    name that is no alarm (with the nearest one, or the new name of an old field's), a value out of its range."""
    if thresholds is None:
        return []
    if not isinstance(thresholds, Mapping):
        return [
            f"`{where}` must map alarm names to thresholds (None switches one off), e.g. {{'kl_high': 0.5, "
            f"'zero_std': None}}; got {thresholds!r}."
        ]
    problems = []
    for name, value in thresholds.items():
        family = ALARMS.get(name)
        if family is None:
            nearest = [RENAMED.get(name) or RENAMED.get(f"warn_{name}")]
            nearest = nearest if nearest[0] else difflib.get_close_matches(str(name), list(ALARMS), n=1)
            hint = f"did you mean '{nearest[0]}'?" if nearest else f"the alarms are {', '.join(ALARMS)}."
            problems.append(f"`{where}` has no alarm {name!r}: {hint}")
        elif (problem := family.alarms[name].range.problem(value)) is not None:
            problems.append(f"`{where}['{name}']` {problem}.")
    return problems


def thresholds_of(given: Mapping[str, float | None] | None) -> dict[str, float | None]:
    """Every alarm's threshold, in `ALARMS` order: those of `given` (names checked by `threshold_problems`), the
    others' defaults."""
    return {name: (given or {}).get(name, default) for name, default in DEFAULTS.items()}


def build_rules(
    thresholds: Mapping[str, float | None], patience: int = 3, auxiliary: Collection[str] | None = None
) -> list[Rule]:
    """The rules of the alarms whose threshold is set, in `ALARMS` order.

    Args:
        thresholds: alarm name -> threshold; `None` (or absent) leaves that alarm out.
        patience: log steps in a row a high clip fraction must last (`warn_patience`).
        auxiliary: the names of the auxiliary reward functions (`warn_auxiliary_rewards`); `None`: told by the words
            of their names.
    """
    problems = threshold_problems({name: value for name, value in thresholds.items() if name not in ALARMS})
    if problems:
        raise ValueError(" ".join(problems))
    return [
        family(name, thresholds[name], patience=patience, auxiliary=auxiliary)
        for name, family in ALARMS.items()
        if thresholds.get(name) is not None
    ]
