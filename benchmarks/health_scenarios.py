"""`python -m benchmarks health`: the peers' own sick and healthy training scenarios, converted to TRL log histories,
judged by `trl-grpo-ext report`'s rules and, where installed, by the peers themselves; prints the scenario x tool
table of docs/diagnostics.md ("Peer scenarios").

The scenarios come from the peers' own generators, used as they are: rl-doctor's `rl_doctor.simulate.simulate`
(12 scenarios, 400 steps, its step records) and rlprobe's `rlprobe.testing.synth.generate_run` (a healthy run and 14
pathologies, 500 steps, a recording read back with `rlprobe.doctor.runview.RunView`). Each step becomes one entry of
a `trainer_state.json` log history with TRL's metric names (one log step per training step, `logging_steps=1`),
what a stock `trl.GRPOTrainer` run would have logged; a metric TRL has no name for is left out (rlprobe's advantage
statistics, value head, token-position KL and repetition rate), and a scenario whose pathology lives only in such
metrics, or only in the step time, which this package does not judge, is listed with the reason.

A peer "flags" a scenario with a finding of its `warning` tier or above (rl-doctor's `INFO` findings, which it
gives on its own healthy scenario too, are not counted). This package flags a scenario with an alarm of any tier or
a `FAIL` of `report` (`trl_grpo_ext.tools.report.health.assess`, the live alarms' rules with `GRPOConfigExt`'s default
thresholds). `EXPECTED_ALARMS` says which of this package's alarms answer each peer kind: the scenario corpus test
(tests/test_health_scenarios.py) asserts that every flagged scenario raises one of them and that no healthy scenario
raises anything.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field

__all__ = [
    "EXPECTED_ALARMS",
    "Scenario",
    "judge",
    "logged_every",
    "peer_available",
    "rldoctor_scenarios",
    "rlprobe_scenarios",
    "rldoctor_judge",
    "rlprobe_judge",
    "rlwatch_judge",
    "run",
    "table",
]

#: A peer's kind of finding (rl-doctor's detector names, rlprobe's signature ids) -> the alarms of this package that
#: answer it (any one of them counts).
EXPECTED_ALARMS: dict[str, tuple[str, ...]] = {
    # rl-doctor
    "entropy_collapse": ("entropy_collapse",),
    "advantage_collapse": ("zero_std", "no_spread", "flat_groups"),
    "reward_hacking": ("reward_vs_heldout",),
    "length_pathology": ("length_growth", "length_drift", "length_in_group", "truncation", "truncation_sustained"),
    "kl_drift": ("kl_high", "kl_jump", "kl_growth"),
    "clip_saturation": ("clip_fraction", "clip_asymmetry"),
    "gradient_pathology": ("grad_norm_spike", "vanishing_gradient", "no_gradient"),
    "plateau": ("plateau",),
    "reward_composition": ("reward_composition",),
    # rlprobe
    "KL_BLOWUP": ("kl_high", "kl_jump", "kl_growth"),
    "ENTROPY_COLLAPSE": ("entropy_collapse",),
    "FORMAT_GAMING": ("reward_composition",),
    "CLIP_SATURATION": ("clip_fraction", "clip_asymmetry", "ratio_p95"),
    "DEGENERATE_GROUPS": ("zero_std", "no_spread", "flat_groups"),
    "REWARD_STD_DEATH": ("zero_std", "no_spread", "flat_groups", "reward_variance"),
    "GRAD_PATHOLOGY": ("grad_norm_spike",),
    "TRUNCATION_STARVE": ("truncation", "truncation_sustained"),
    "REWARD_HACK_LENGTH": ("length_growth", "length_drift", "length_in_group"),
}

#: rlprobe's pathologies not judged here, with why: four live in metrics TRL does not log; the fifth in its step time.
NOT_JUDGED = {
    "adv_collapse": "advantage mean and std: TRL does not log them",
    "value_divergence": "a PPO value head: GRPO has none",
    "repetition_spiral": "a repetition rate of the completions: TRL does not log one",
    "ref_drift_asymmetry": "KL per token-position bucket: TRL logs the mean KL only",
    "throughput_rot": "a creeping step time (TRL's `step_time`) is a cost, not a run that stops learning; rlprobe "
    "files it below its warning tier too",
}

#: rlprobe's step-record field -> TRL's (or this package's) logged key.
_RLPROBE_KEYS = {
    "reward_mean": "reward",
    "reward_std": "reward_std",
    "zero_variance_group_frac": "frac_reward_zero_std",
    "group_reward_std_mean": "reward_std/group_mean",
    "kl_mean": "kl",
    "entropy_mean": "entropy",
    "clip_fraction": "clip_ratio/region_mean",
    "ratio_mean": "ratio/mean",
    "ratio_p95": "ratio/p95",
    "loss": "loss",
    "lr": "learning_rate",
    "grad_norm": "grad_norm",
    "completion_len_mean": "completions/mean_length",
    "completion_len_max": "completions/max_length",
    "truncation_rate": "completions/clipped_ratio",
    "step_time_s": "step_time",
}

#: rl-doctor's record keys that are already TRL's names; the others are left out or renamed below.
_RLDOCTOR_KEEP = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "grad_norm",
    "completions/mean_length",
    "completions/clipped_ratio",
    "learning_rate",
)
#: rl-doctor's held-out score, logged as a held-out evaluation of this package logs it: a mean and its sample size.
HELDOUT_ACCURACY = "heldout/accuracy/mean@1"
#: The sample size logged with it (`heldout/accuracy/scored@1`): rl-doctor's simulated score scatters by about 0.022
#: around its curve (normal noise of 0.018 on the pass rate and 0.012 on the score, rl_doctor/simulate.py), the
#: standard error of an accuracy near 0.5 over 536 completions (0.25 / 0.022^2); at lower accuracies the binomial
#: allowance is smaller than that scatter, so it errs towards flagging.
HELDOUT_SIZE = 536


@dataclass
class Scenario:
    """One training run of a peer's generator, as a TRL log history.

    Attributes:
        source: the generator (`"rl-doctor"`, `"rlprobe"`).
        name: its scenario or pathology name (`"healthy"` for the healthy ones).
        history: the log history, one entry per step, TRL's metric names.
        peer_kinds: the kinds of the peer's findings of its warning tier or above, on its own data (empty: healthy).
        peer_onset: the first step of the peer's first such finding, where it gives one.
        skipped: why the scenario is not judged (`None`: it is).
    """

    source: str
    name: str
    history: list[dict]
    peer_kinds: tuple[str, ...] = ()
    peer_onset: int | None = None
    skipped: str | None = None
    ours: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.name == "healthy"


def peer_available(name: str) -> bool:
    """Whether the peer's package imports (`"rldoctor"`, `"rlprobe"`, `"rlwatch"`)."""
    import importlib.util

    module = {"rldoctor": "rl_doctor"}.get(name, name)
    return importlib.util.find_spec(module) is not None


def _finite_or_nan(value) -> float:
    return float(value) if value is not None else math.nan


def rldoctor_history(records: list[dict]) -> list[dict]:
    """rl-doctor's simulated step records as a TRL log history: its TRL-named metrics kept, `step` from 1 (TRL's
    first optimizer step), `rewards/<func>/mean` kept, `eval/accuracy` as `heldout/accuracy/mean@1` with its sample
    size (`HELDOUT_SIZE`)."""
    history = []
    for record in records:
        entry = {key: record[key] for key in _RLDOCTOR_KEEP if key in record}
        entry.update({key: value for key, value in record.items() if key.startswith("rewards/")})
        if "eval/accuracy" in record:
            entry[HELDOUT_ACCURACY] = record["eval/accuracy"]
            entry[HELDOUT_ACCURACY.replace("/mean@", "/scored@")] = HELDOUT_SIZE
        entry["step"] = int(record["step"]) + 1
        history.append(entry)
    return history


#: What transformers logs of the last step of a logging interval, not a mean over it: the gradient norm of the last
#: optimizer step, the learning rate then.
_LAST_OF_INTERVAL = ("grad_norm", "learning_rate")


def logged_every(history: list[dict], steps: int) -> list[dict]:
    """A history of one entry per step as the same run logs it with `logging_steps=steps`: one entry at every
    `steps`-th step, holding the mean of each metric over the steps since the last entry (TRL's metrics and
    transformers' loss are such means, NaN left out), the last step's gradient norm and learning rate, and a held-out
    evaluation's last value."""
    entries = []
    for end in range(steps, len(history) + 1, steps):
        interval = history[end - steps : end]
        entry = {"step": interval[-1]["step"]}
        for key in dict.fromkeys(key for record in interval for key in record if key != "step"):
            values = [record[key] for record in interval if isinstance(record.get(key), (int, float))]
            numbers = [value for value in values if not math.isnan(value)]
            if not values:
                continue
            if key in _LAST_OF_INTERVAL or key.startswith("heldout/"):
                entry[key] = values[-1]
            else:
                entry[key] = sum(numbers) / len(numbers) if numbers else math.nan
        entries.append(entry)
    return entries


def rldoctor_scenarios(steps: int = 400, seed: int = 0, judge_peer: bool = True) -> list[Scenario]:
    """rl-doctor's scenarios (`rl_doctor.simulate.SCENARIOS`), each with what rl-doctor itself finds on it."""
    from rl_doctor.simulate import SCENARIOS, simulate

    scenarios = []
    for name in SCENARIOS:
        records, config = simulate(name, n_steps=steps, seed=seed)
        kinds: tuple[str, ...] = ()
        if judge_peer:
            from rl_doctor.detectors.base import Severity
            from rl_doctor.diagnosis import diagnose
            from rl_doctor.ingest.base import run_from_records

            diagnosis = diagnose(run_from_records(records, config=config, name=name, source="simulated"))
            kinds = tuple(sorted({f.detector for f in diagnosis.findings if f.severity >= Severity.WARNING}))
        scenarios.append(Scenario("rl-doctor", name, rldoctor_history(records), kinds))
    return scenarios


def rlprobe_history(records) -> list[dict]:
    """rlprobe's step records (`rlprobe.schemas.StepRecord`) as a TRL log history: the fields TRL has a name for,
    reward components as `rewards/<func>/mean`, a step with NaN gradients (`nan_count > 0`) as a NaN `grad_norm` (what
    transformers logs then), `step` from 1."""
    history = []
    for record in records:
        entry = {}
        for source, key in _RLPROBE_KEYS.items():
            value = getattr(record, source)
            if value is not None:
                entry[key] = float(value)
        for name, value in record.reward_components.items():
            entry[f"rewards/{name}/mean"] = float(value)
        if record.nan_count:
            entry["grad_norm"] = math.nan
        entry["step"] = int(record.step) + 1
        history.append(entry)
    return history


def rlprobe_scenarios(
    steps: int = 500, seed: int = 0, judge_peer: bool = True, pathologies: tuple[str | None, ...] | None = None
) -> list[Scenario]:
    """rlprobe's healthy run and pathologies (`rlprobe.testing.synth.PATHOLOGIES`), each with what rlprobe's doctor
    itself finds on it; `pathologies`: only these (`None` for the healthy run), in that order."""
    from rlprobe.doctor.engine import diagnose_view
    from rlprobe.doctor.runview import RunView
    from rlprobe.testing.synth import PATHOLOGIES, generate_run

    scenarios = []
    for pathology in [None, *PATHOLOGIES] if pathologies is None else pathologies:
        with tempfile.TemporaryDirectory() as folder:
            view = RunView.load(generate_run(f"{folder}/run", pathology, n_steps=steps, seed=seed))
            records = view._records
            kinds: tuple[str, ...] = ()
            onset = None
            if judge_peer:
                findings = [f for f in diagnose_view(view) if f.severity in ("warn", "critical")]
                kinds = tuple(sorted({f.signature_id for f in findings}))
                onsets = [f.first_step for f in findings if f.first_step is not None]
                onset = min(onsets) + 1 if onsets else None
        name = pathology or "healthy"
        scenarios.append(
            Scenario("rlprobe", name, rlprobe_history(records), kinds, onset, skipped=NOT_JUDGED.get(name))
        )
    return scenarios


def judge(history: list[dict]) -> dict:
    """This package's verdict on a log history: `report`'s (`assess`, default thresholds).

    Returns:
        `dict` with `alarms` (names raised, in order of first onset), `failed` (signals with a `FAIL`), `onset` (the
        first step of any alarm or `FAIL`) and `flagged`.
    """
    from trl_grpo_ext.tools.report.health import assess

    health = assess(history)
    failed = [signal.signal.name for signal in health.signals if signal.verdict == "FAIL"]
    onsets = [e.start for e in health.episodes if e.start is not None]
    onsets += [s.onset for s in health.signals if s.verdict == "FAIL" and s.onset is not None]
    return {
        "alarms": health.alarms,
        "failed": failed,
        "onset": min(onsets) if onsets else None,
        "flagged": bool(health.alarms or failed),
    }


def _verdict(kinds, onsets) -> dict:
    onsets = [step for step in onsets if step is not None]
    return {"kinds": sorted(set(kinds)), "onset": min(onsets) if onsets else None, "flagged": bool(kinds)}


def rldoctor_judge(history: list[dict]) -> dict:
    """rl-doctor's findings of its warning tier or above on a TRL log history (its `run_from_records`, which maps
    TRL's names; the held-out score also under `eval/accuracy`, the name it reads). rl-doctor gives no onset step."""
    from rl_doctor.detectors.base import Severity
    from rl_doctor.diagnosis import diagnose
    from rl_doctor.ingest.base import run_from_records

    records = [
        {**entry, "eval/accuracy": entry[HELDOUT_ACCURACY]} if HELDOUT_ACCURACY in entry else entry
        for entry in history
    ]
    diagnosis = diagnose(run_from_records(records, config={"algorithm": "grpo"}, name="run", source="trl"))
    return _verdict([f.detector for f in diagnosis.findings if f.severity >= Severity.WARNING], [])


def rlprobe_judge(history: list[dict], tiers: tuple[str, ...] = ("warn", "critical")) -> dict:
    """rlprobe's doctor on a TRL log history: each entry as the step record its TRL callback would write (the keys of
    `_RLPROBE_KEYS`, `rewards/<func>/mean` as reward components), its findings of `tiers` (`info`, `warn`,
    `critical`)."""
    from rlprobe.doctor.engine import diagnose_view
    from rlprobe.doctor.runview import RunView
    from rlprobe.schemas import RunManifest, StepRecord

    fields = {key: source for source, key in _RLPROBE_KEYS.items()}
    records = []
    for entry in history:
        values = {fields[k]: v for k, v in entry.items() if k in fields and isinstance(v, (int, float))}
        values = {k: v for k, v in values.items() if not math.isnan(v)}
        components = {
            k.removeprefix("rewards/").removesuffix("/mean"): v
            for k, v in entry.items()
            if k.startswith("rewards/") and k.endswith("/mean") and not math.isnan(v)
        }
        records.append(StepRecord(step=entry["step"], reward_components=components, **values))
    manifest = RunManifest(run_id="trl", created_at="", algorithm="grpo")
    findings = [f for f in diagnose_view(RunView(manifest, records)) if f.severity in tiers]
    return _verdict([f.signature_id for f in findings], [f.first_step for f in findings])


def rlwatch_judge(history: list[dict]) -> dict:
    """rlwatch's detectors (`DetectorSuite`, its default configuration, no alert channel: nothing leaves the machine)
    fed each entry as its TRL callback maps it."""
    from rlwatch.config import RLWatchConfig
    from rlwatch.detectors import DetectorSuite

    names = {
        "entropy": "entropy",
        "kl_divergence": "kl",
        "reward_mean": "reward",
        "reward_std": "reward_std",
        "loss": "loss",
        "grad_norm": "grad_norm",
    }
    suite = DetectorSuite(RLWatchConfig())
    alerts = []
    for entry in history:
        metrics = {name: entry[key] for name, key in names.items() if key in entry}
        alerts += suite.check_step(entry["step"], **metrics)
    return _verdict([alert.detector for alert in alerts], [alert.step for alert in alerts])


#: The tools of the table, each a function of a TRL log history; `judge` is this package's `report`.
TOOLS = {"rl-doctor": ("rldoctor", rldoctor_judge), "rlprobe": ("rlprobe", rlprobe_judge)}
TOOLS["rlwatch"] = ("rlwatch", rlwatch_judge)


def run() -> dict:
    """Every scenario of every installed peer generator, judged by this package and by every installed peer on the
    same TRL log history.

    Returns:
        `dict` with `scenarios` (one row each: generator, scenario, injected kinds, this package's verdict, each
        peer's, or why the scenario is not judged) and `tools` (peer -> whether it ran, or why not).
    """
    scenarios: list[Scenario] = []
    if peer_available("rldoctor"):
        scenarios += rldoctor_scenarios(judge_peer=False)
    if peer_available("rlprobe"):
        scenarios += rlprobe_scenarios(judge_peer=False)
    tools = {name: "ran" if peer_available(module) else "not installed" for name, (module, _) in TOOLS.items()}
    rows = []
    for scenario in scenarios:
        row = {"source": scenario.source, "scenario": scenario.name, "skipped": scenario.skipped}
        if scenario.skipped is None:
            row["trl-grpo-ext"] = judge(scenario.history)
            for name, (_, function) in TOOLS.items():
                if tools[name] == "ran":
                    row[name] = function(scenario.history)
        rows.append(row)
    return {"scenarios": rows, "tools": tools}


def _cell(verdict: dict | None, names_key: str) -> str:
    if verdict is None:
        return "not run"
    if not verdict["flagged"]:
        return "-"
    names = ", ".join(verdict[names_key])
    return f"{names} @{verdict['onset']}" if verdict.get("onset") is not None else names


def table(results: dict) -> str:
    """The scenario x tool table, markdown: what each tool flags (its kinds, `@` the first step where it says one)."""
    tools = ["trl-grpo-ext", *TOOLS]
    lines = ["| scenario | " + " | ".join(tools) + " |", "| --- " * (len(tools) + 1) + "|"]
    for row in results["scenarios"]:
        name = f"{row['source']} `{row['scenario']}`"
        if row["skipped"]:
            lines.append(f"| {name} | " + " | ".join(["not judged: " + row["skipped"]] + [""] * len(TOOLS)) + " |")
            continue
        cells = [_cell(row["trl-grpo-ext"], "alarms")]
        cells[0] += (" FAIL: " + ", ".join(row["trl-grpo-ext"]["failed"])) if row["trl-grpo-ext"]["failed"] else ""
        cells += [_cell(row.get(tool), "kinds") for tool in TOOLS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
