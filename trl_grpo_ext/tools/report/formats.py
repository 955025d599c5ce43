"""`report`'s summary from one set of findings (`Report`), written as `text`, `markdown` (a CI step summary) or
`json`: each writer only lays the findings out."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from ... import metrics
from ...metrics import (
    ALARMS_PREFIX,
    CLIP_RATIO_PREFIX,
    COMPLETIONS_PREFIX,
    DYNAMIC_SAMPLING_PREFIX,
    FORWARD_PADDING_FRACTION,
    FORWARD_PREFIX,
    FORWARD_REPEATED_PROMPT_FRACTION,
    FORWARD_TOKENS_PER_DISTINCT,
    HELDOUT_PREFIX,
    LOSS_PREFIX,
    NONFINITE_PREFIX,
    RATIO_PREFIX,
    REWARD_LENGTH_CORR_PREFIX,
    REWARD_STD_PREFIX,
    REWARDS_PREFIX,
    SAMPLING_PREFIX,
    SELECTIVE_ROLLOUTS_PREFIX,
    SKIPPED_ROWS_PREFIX,
)
from .health import HEALTHY, TOO_SHORT, RunHealth, SignalHealth, _episode_steps, _values, highest_severity

FORMATS = ("text", "markdown", "json")

#: The log-prob forward's waste metrics.
FORWARD_KEYS = (FORWARD_PADDING_FRACTION, FORWARD_REPEATED_PROMPT_FRACTION, FORWARD_TOKENS_PER_DISTINCT)
#: Below this many tokens forwarded per distinct token, the padded forward wastes too little to mention packing.
PACKING_WORTH_MENTIONING = 1.05

#: The metrics the report knows: every name of `trl_grpo_ext.metrics` and the trainer's bookkeeping; a logged key
#: outside them and `KNOWN_FAMILIES` is named as not recognised. `eval_` keys are their training key's.
KNOWN_KEYS = frozenset(
    {
        "step", "epoch", "total_flos", "clip_ratio", "train_runtime", "train_samples_per_second",
        "train_steps_per_second", "train_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second",
    }
    | {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}
)  # fmt: skip
KNOWN_FAMILIES = (
    ALARMS_PREFIX, CLIP_RATIO_PREFIX, COMPLETIONS_PREFIX, DYNAMIC_SAMPLING_PREFIX, FORWARD_PREFIX, HELDOUT_PREFIX,
    LOSS_PREFIX, "mismatch/", NONFINITE_PREFIX, RATIO_PREFIX, REWARD_LENGTH_CORR_PREFIX, REWARD_STD_PREFIX,
    REWARDS_PREFIX, SAMPLING_PREFIX, SELECTIVE_ROLLOUTS_PREFIX, SKIPPED_ROWS_PREFIX,
)  # fmt: skip


def unrecognised_keys(log_history: list[dict]) -> list[str]:
    """The keys of `log_history` that are no metric the report knows (see `KNOWN_FAMILIES`), sorted."""
    keys = {key for entry in log_history for key in entry}
    return sorted(
        key
        for key in keys
        if (name := key.removeprefix("eval_")) not in KNOWN_KEYS
        and key not in KNOWN_KEYS
        and not name.startswith(KNOWN_FAMILIES)
    )


def _tokens(count: float) -> str:
    """`1 token`, `2.44 tokens`."""
    shown = f"{count:.3g}"
    return f"{shown} token{'' if shown == '1' else 's'}"


def forward_summary(log_history: list[dict], packed: Mapping[str, bool] | None = None) -> dict | None:
    """What TRL's padded layout forwards per distinct token over the run (the means of `FORWARD_KEYS`), what the
    packed forward forwards instead, and which of the two the run forwarded where `packed` says (the run's
    `padding_free` and `shared_prompt_forward`; `None`: not known).

    Returns:
        `None` without `forward/*` metrics, else the means (`padding_fraction`, `repeated_prompt_fraction`,
        `tokens_per_distinct`), `packed_tokens_per_distinct` and `message`.
    """
    means = {}
    for key in FORWARD_KEYS:
        values = [value for _, value in _values(log_history, key) if math.isfinite(value)]
        means[key.removeprefix(FORWARD_PREFIX)] = sum(values) / len(values) if values else None
    if all(value is None for value in means.values()):
        return None
    per_distinct, padding, repeated = (
        means["tokens_per_distinct"],
        means["padding_fraction"],
        means["repeated_prompt_fraction"],
    )
    parts = [f"{padding:.0%} padding" if padding is not None else None]
    parts.append(f"{repeated:.0%} repeated prompts" if repeated is not None else None)
    shares = ", ".join(part for part in parts if part)
    saved = (padding or 0.0) + (repeated or 0.0)
    packed_per_distinct = per_distinct * (1 - saved) if per_distinct is not None else None
    if per_distinct is None:
        message = f"forward: stock TRL's padded layout: {shares}"
        return {**means, "packed_tokens_per_distinct": None, "message": message}
    padded = f"stock TRL's padded layout forwards {_tokens(per_distinct)} per distinct token here ({shares})"
    options = "padding_free and shared_prompt_forward"
    if packed is not None and (packed.get("padding_free") or packed.get("shared_prompt_forward")):
        # the options each leave out their part: padding, or the repeated prompts
        saved = (padding or 0.0) * bool(packed.get("padding_free")) + (repeated or 0.0) * bool(
            packed.get("shared_prompt_forward")
        )
        message = (
            f"forward: this run packed its forward and forwarded about {_tokens(per_distinct * (1 - saved))} per "
            f"distinct token, where {padded}: {saved:.0%} fewer"
        )
    elif packed is not None:
        message = (
            f"forward: this run forwarded the padded layout, {_tokens(per_distinct)} per distinct token ({shares}); "
            f"packing would forward {saved:.0%} fewer ({options}=True)"
        )
    elif per_distinct <= PACKING_WORTH_MENTIONING or not saved:
        message = f"forward: {padded}: little for packing to save"
    else:
        message = (
            f"forward: {padded}; GRPOTrainerExt packs them ({options}, on by default with GRPOConfigExt) and "
            f"forwards about {packed_per_distinct:.3g}: {saved:.0%} fewer"
        )
    return {**means, "packed_tokens_per_distinct": packed_per_distinct, "message": message}


@dataclass
class Report:
    """What `report` found about a run: what was read (`read`, relative to `run_dir`; `source`), the lines before the
    summary (`notes`) and about `report.png` (`image`), the verdicts (`health`), `forward_summary`, `sampling_summary`
    and `unrecognised_keys` of the history."""

    run_dir: str
    read: str
    source: str
    global_step: int | None
    notes: list[str]
    image: str
    health: RunHealth
    forward: dict | None = None
    sampling: dict | None = None
    unrecognised: list[str] = field(default_factory=list)

    def findings(self) -> list[dict]:
        """One record per signal: `name`, `verdict`, `severity` (of `SEVERITIES`), `onset_step`, `message`."""
        return [_finding(signal) for signal in self.health.signals]

    def alarms(self) -> list[dict]:
        """One record per alarm raised: `name`, `severity`, `onset_step`, `steps`, `message` (what to change)."""
        records = []
        for name in self.health.alarms:
            episodes = [episode for episode in self.health.episodes if episode.name == name]
            records.append(
                {
                    "name": name,
                    "severity": highest_severity(episode.severity for episode in episodes),
                    "onset_step": episodes[0].start,
                    "steps": _episode_steps(episodes),
                    "message": episodes[0].message,
                }
            )
        return records

    def worst_severity(self) -> str:
        """The highest tier of the findings and alarms (`"ok"` for none)."""
        tiers = [finding["severity"] for finding in self.findings()] + [alarm["severity"] for alarm in self.alarms()]
        return highest_severity(tiers)


def _finding(signal: SignalHealth) -> dict:
    return {
        "name": signal.signal.name,
        "verdict": signal.verdict,
        "severity": signal.severity,
        "onset_step": signal.onset,
        "message": signal.detail,
    }


def render(report: Report, form: str = "text") -> str:
    """`report` written as `form` (one of `FORMATS`)."""
    return {"text": _text, "markdown": _markdown, "json": _json}[form](report)


#: The text report's width: every line wraps at it, a continuation indented under what it continues.
WIDTH = 100
#: What each verdict word means, for the legend of the text report (the words it uses, in this order).
VERDICT_WORDS = {
    "ok": "judged, no alarm",
    "ALARM": "an alarm was raised (its tier: a warning, or a note)",
    "FAIL": "the run cannot have trained well",
    "note": "worth a look",
    "short": "too few log entries to judge yet",
    "shown": "drawn, never judged (the loss)",
    "missing": "not logged",
}
#: Where a signal's detail starts on its line: two spaces, the verdict (7), a space, the name (25), a space.
_DETAIL_COLUMN = 36


def _wrap(text: str, first: str = "", rest: str | None = None) -> list[str]:
    """`text` wrapped at `WIDTH`, its first line after `first`, the others after `rest` (default: as many spaces)."""
    rest = " " * len(first) if rest is None else rest
    return textwrap.wrap(
        text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    ) or [first.rstrip()]


def _signal_lines(signal: SignalHealth) -> list[str]:
    """A signal's verdict, name and detail, each part of the detail (` | `) on lines of its own under the first."""
    lines = []
    for index, part in enumerate(signal.detail.split(" | ")):
        head = f"  {signal.verdict:<7} {signal.signal.name:<25} " if index == 0 else " " * _DETAIL_COLUMN
        lines += _wrap(part, head, " " * _DETAIL_COLUMN)
    return lines


def _text(report: Report) -> str:
    lines = [wrapped for note in [*report.notes, report.image] for wrapped in _wrap(note, rest="  ")]
    lines += ["", "Health, one line per signal (what to watch: the metrics of docs/diagnostics.md):"]
    used = [word for word in VERDICT_WORDS if word in {signal.verdict for signal in report.health.signals}]
    lines += _wrap("; ".join(f"{word}: {VERDICT_WORDS[word]}" for word in used), "Verdicts: ", "  ")
    lines += [line for signal in report.health.signals for line in _signal_lines(signal)]
    for summary in (report.forward, report.sampling):
        if summary is not None and summary["message"]:
            lines += _wrap(summary["message"], "  ", "    ")
    problems = report.health.problem_lines()
    if report.health.too_short:
        lines += ["", *_wrap(TOO_SHORT)]
    elif problems:
        alarms = f"{len(report.health.alarms)} alarm(s) raised" if report.health.alarms else "no alarm raised"
        lines += ["", f"Problems found ({alarms}), with what to change:"]
    else:
        lines += ["", HEALTHY]
    lines += [wrapped for problem in problems for wrapped in _wrap(problem, "  ", "    ")]
    return "\n".join(lines)


def _cell(text) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(report: Report) -> str:
    lines = [f"### Training health: `{report.run_dir}`", "", "  \n".join([*report.notes, report.image]), ""]
    lines += ["| signal | verdict | details |", "| --- | --- | --- |"]
    for signal, finding in zip(report.health.signals, report.findings(), strict=True):
        # the tier is said where the verdict does not say it: an alarm that is a note
        verdict = (
            f"ALARM ({finding['severity']})"
            if signal.verdict == "ALARM" and signal.severity != "warning"
            else signal.verdict
        )
        lines.append(
            "| " + " | ".join(_cell(value) for value in (finding["name"], verdict, finding["message"])) + " |"
        )
    for summary in (report.forward, report.sampling):
        if summary is not None and summary["message"]:
            lines += ["", _cell(summary["message"])]
    alarms = report.alarms()
    if alarms:
        lines += ["", f"**{len(alarms)} alarm(s) raised**, with what to change:", ""]
        lines += [f"- `{alarm['name']}` ({alarm['steps']}): {_cell(alarm['message'])}" for alarm in alarms]
    elif report.health.too_short:
        lines += ["", TOO_SHORT, ""] + [f"- {_cell(line)}" for line in report.health.problem_lines()]
    elif report.health.ok:
        lines += ["", HEALTHY]
    return "\n".join(lines)


def _json(report: Report) -> str:
    document = {
        "run_dir": report.run_dir,
        "read": report.read,
        "source": report.source,
        "global_step": report.global_step,
        "training_entries": report.health.training_entries,
        "notes": report.notes,
        "report_png": report.image,
        "severity": report.worst_severity(),
        "findings": report.findings(),
        "alarms": report.alarms(),
        "forward": report.forward,
        "sampling": report.sampling,
        "unrecognised_keys": report.unrecognised,
    }
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def _finite(value):
    """`value` with every NaN or infinite number as `None` (JSON has no such numbers; a log may hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
