"""The metrics on the console's line, with their labels (`console.py` reads them as `WATCHED` records).

Until the console holds its `CONSOLE_SIGNALS` itself (issue 49): the report's signals are
`trl_grpo_ext.tools.report.health.SIGNALS`, the metrics' documentation docs/diagnostics.md.
"""

from types import SimpleNamespace

from ..metrics import (
    CLIP_RATIO_REGION_MEAN,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    KL,
    RATIO_P95,
    REWARD,
    REWARD_STD_GROUP_MEAN,
)

#: (logged metric, its label on the line), in the order of the line.
CONSOLE_SIGNALS = (
    (REWARD, "reward"),
    (REWARD_STD_GROUP_MEAN, "spread"),
    (KL, "kl"),
    (CLIP_RATIO_REGION_MEAN, "clip"),
    (RATIO_P95, "ratio p95"),
    (ENTROPY, "entropy"),
    (COMPLETIONS_MEAN_LENGTH, "len"),
)
WATCHED = tuple(SimpleNamespace(console=signal) for signal in CONSOLE_SIGNALS)
