"""The peers' own scenario corpus: rl-doctor's simulated runs (`rl_doctor.simulate`) and rlprobe's synthetic
recordings (`rlprobe.testing.synth`), converted to TRL log histories (`benchmarks/health_scenarios.py`) and judged
by `report`'s rules. Every sick scenario is flagged with an alarm of the kind its generator injected, every healthy
one stays quiet."""

import pathlib
import statistics

import pytest

pytest.importorskip("rl_doctor")
pytest.importorskip("rlprobe")

from rl_doctor.simulate import EXPECTED_DETECTIONS, SCENARIOS, simulate  # noqa: E402
from rlprobe.testing.synth import PATHOLOGIES  # noqa: E402

from benchmarks.health_scenarios import (  # noqa: E402
    EXPECTED_ALARMS,
    HELDOUT_ACCURACY,
    judge,
    logged_every,
    rldoctor_history,
    rldoctor_scenarios,
    rlprobe_judge,
    rlprobe_scenarios,
    table,
)
from trl_grpo_ext.tools.report.health import assess  # noqa: E402

#: Sick scenarios this package does not flag yet with the kind injected: (generator, scenario) -> why.
GAPS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def corpus():
    """(generator, scenario) -> `Scenario`, judged by this package; the peers' own findings too."""
    scenarios = rldoctor_scenarios() + rlprobe_scenarios()
    for scenario in scenarios:
        if scenario.skipped is None:
            scenario.ours = judge(scenario.history)
    return {(scenario.source, scenario.name): scenario for scenario in scenarios}


def injected_kinds(source: str, name: str) -> tuple[str, ...]:
    """The kinds of finding the generator labels its scenario with."""
    if source == "rl-doctor":
        return EXPECTED_DETECTIONS[name]
    return (name.upper(),)


SICK = [("rl-doctor", name) for name in SCENARIOS if name != "healthy"] + [("rlprobe", name) for name in PATHOLOGIES]


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=GAPS[key])) if key in GAPS else key
        for key in SICK
    ],
    ids="/".join,
)
def test_every_sick_peer_scenario_is_flagged_with_the_kind_injected(corpus, key):
    scenario = corpus[key]
    if scenario.skipped is not None:
        pytest.skip(f"not judged: {scenario.skipped}")
    assert scenario.ours["flagged"], f"{key}: nothing flagged"
    for kind in injected_kinds(*key):
        assert set(EXPECTED_ALARMS[kind]) & set(scenario.ours["alarms"]), (kind, scenario.ours["alarms"])


def test_the_peers_flag_their_own_sick_scenarios_and_the_corpus_covers_them(corpus):
    # The corpus is the peers' ground truth: each peer flags its injected kind (rlprobe misses its own length hack).
    for (source, name), scenario in corpus.items():
        if name == "healthy":
            assert scenario.peer_kinds == (), (source, scenario.peer_kinds)
        elif source == "rl-doctor":
            assert set(EXPECTED_DETECTIONS[name]) <= set(scenario.peer_kinds)
        for kind in scenario.peer_kinds:
            if scenario.skipped is None:
                assert kind in EXPECTED_ALARMS, f"{source}/{name}: {kind} has no answering alarm"


def test_a_creeping_step_time_is_in_trl_s_logs_and_rlprobe_files_it_below_a_warning(corpus):
    # Not judged here (NOT_JUDGED): TRL logs `step_time`, and rlprobe itself gives its creep as information only.
    history = corpus["rlprobe", "throughput_rot"].history
    times = [entry["step_time"] for entry in history]
    assert statistics.median(times[-50:]) > 1.5 * statistics.median(times[:50])
    assert "THROUGHPUT_ROT" in rlprobe_judge(history, tiers=("info",))["kinds"]
    assert "THROUGHPUT_ROT" not in rlprobe_judge(history)["kinds"]


def test_a_stock_trl_run_s_names_are_what_is_judged(corpus):
    entry = corpus["rl-doctor", "healthy"].history[0]
    assert entry["step"] == 1 and {"reward", "frac_reward_zero_std", "kl", "clip_ratio/low_mean"} <= entry.keys()
    assert "rewards/format/mean" in entry and "heldout/accuracy/mean@1" in entry
    probe = corpus["rlprobe", "healthy"].history[0]
    assert {"reward", "frac_reward_zero_std", "entropy", "completions/clipped_ratio"} <= probe.keys()
    assert "rewards/correctness/mean" in probe


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_healthy_peer_scenario_is_flagged(seed):
    histories = [rldoctor_history(simulate("healthy", n_steps=400, seed=seed)[0])]
    histories += [s.history for s in rlprobe_scenarios(seed=seed, judge_peer=False)[:1]]
    for history in histories:
        verdict = judge(history)
        assert not verdict["flagged"], verdict


@pytest.mark.parametrize("seed", range(10))
def test_kl_growth_flags_the_peers_kl_blowups_no_later_than_rlprobe_and_no_healthy_run(seed):
    """rlprobe flags a KL blow-up first among the peers (docs/diagnostics.md, "Peer scenarios"); kl_high waits for a
    KL of 1.0, about 100 steps later."""
    doctor = {name: rldoctor_history(simulate(name, n_steps=400, seed=seed)[0]) for name in ("healthy", "kl_blowup")}
    probe = {s.name: s for s in rlprobe_scenarios(seed=seed, pathologies=(None, "kl_blowup"))}
    blowups = {
        "rl-doctor": (doctor["kl_blowup"], rlprobe_judge(doctor["kl_blowup"])["onset"]),
        "rlprobe": (probe["kl_blowup"].history, probe["kl_blowup"].peer_onset),
    }
    for source, (history, rlprobe_onset) in blowups.items():
        episodes = [e for e in assess(history).episodes if e.name == "kl_growth"]
        assert episodes and rlprobe_onset is not None and episodes[0].start <= rlprobe_onset, (source, episodes)
    for history in (doctor["healthy"], probe["healthy"].history):
        assert "kl_growth" not in assess(history).alarms


@pytest.mark.parametrize("seed", range(10))
def test_reward_composition_flags_the_peers_format_takeovers_and_no_healthy_run(seed):
    """rl-doctor's format domination (correctness near 0 under a noisy format reward) from its 150th step, rlprobe's
    format gaming (the format rising from step 250 while correctness stalls) once the format's rise dominates."""
    doctor = {
        name: rldoctor_history(simulate(name, n_steps=400, seed=seed)[0]) for name in ("healthy", "format_domination")
    }
    probe = {
        s.name: s.history for s in rlprobe_scenarios(seed=seed, pathologies=(None, "format_gaming"), judge_peer=False)
    }
    for history, earliest, latest in ((doctor["format_domination"], 149, 165), (probe["format_gaming"], 300, 335)):
        episodes = [e for e in assess(history).episodes if e.name == "reward_composition"]
        assert episodes and earliest <= episodes[0].start <= latest, episodes
    for history in (doctor["healthy"], probe["healthy"]):
        assert "reward_composition" not in assess(history).alarms


@pytest.mark.parametrize("seed", range(10))
def test_plateau_flags_rl_doctor_s_plateau_and_no_healthy_run_logged_every_1_10_or_50_steps(seed):
    """The plateau's length counts training steps: a run logged every 10 or 50 steps (TRL's means over each interval)
    is judged as one logged at every step. rl-doctor's plateau (the reward flat from about step 100 of 400) is flagged
    from step 255 on, logged every step or every 10; neither peer's healthy run raises any alarm, however often it
    logs (logged every 50 steps, its 8 or 10 entries may be too short to tell whether it learned: never "ok" by
    default)."""
    plateau = rldoctor_history(simulate("plateau", n_steps=400, seed=seed)[0])
    for steps in (1, 10):
        episodes = [e for e in assess(logged_every(plateau, steps)).episodes if e.name == "plateau"]
        assert episodes and 255 <= episodes[0].start <= 400, (steps, episodes)
    healthy = [rldoctor_history(simulate("healthy", n_steps=400, seed=seed)[0])]
    healthy += [s.history for s in rlprobe_scenarios(seed=seed, pathologies=(None,), judge_peer=False)]
    for history in healthy:
        for steps in (1, 10, 50):
            health = assess(logged_every(history, steps))
            verdicts = ("ok", "short") if steps == 50 else ("ok",)
            assert not health.alarms and health.signals[0].verdict in verdicts, (steps, health.alarms)


def evaluated_every(history: list[dict], steps: int) -> list[dict]:
    """rl-doctor's history with its held-out score at every `steps`-th step only (from the first) and without its
    sample size: what a run that evaluates every `steps` steps and logs no `scored@` key (a stock or older one)
    leaves."""
    size_key = HELDOUT_ACCURACY.replace("/mean@", "/scored@")
    entries = []
    for entry in history:
        kept = {key: value for key, value in entry.items() if key != size_key}
        if (entry["step"] - 1) % steps:
            kept.pop(HELDOUT_ACCURACY, None)
        entries.append(kept)
    return entries


@pytest.mark.parametrize("seed", range(10))
def test_reward_vs_heldout_without_a_sample_size_allows_for_the_series_own_spread(seed):
    """rl-doctor's healthy run evaluated every 25 steps (0.15 -> 0.59, with dips such as 0.214 -> 0.183 at step 101)
    raises no alarm; its reward-hacking run (held-out falling while the reward rises) still does."""
    healthy = evaluated_every(rldoctor_history(simulate("healthy", n_steps=400, seed=seed)[0]), 25)
    assert "reward_vs_heldout" not in assess(healthy).alarms
    hacking = evaluated_every(rldoctor_history(simulate("reward_hacking", n_steps=400, seed=seed)[0]), 25)
    assert "reward_vs_heldout" in assess(hacking).alarms


#: Sick scenarios whose pathology a run logged every 10 steps does not show: transformers logs the gradient norm of
#: the last step of each interval, so spikes between log steps are not in the log.
UNSEEN_EVERY_10 = {("rl-doctor", "grad_spikes"): "spikes between log steps"}


def test_every_sick_peer_scenario_logged_every_10_steps_is_flagged_with_the_kind_injected(corpus):
    for key in SICK:
        scenario = corpus[key]
        if scenario.skipped is not None or key in UNSEEN_EVERY_10:
            continue
        verdict = judge(logged_every(scenario.history, 10))
        for kind in injected_kinds(*key):
            assert set(EXPECTED_ALARMS[kind]) & set(verdict["alarms"]), (key, kind, verdict["alarms"])


def test_the_benchmark_table_has_a_row_per_scenario_and_a_column_per_tool():
    from benchmarks.health_scenarios import run, table

    results = run()
    text = table(results)
    assert text.splitlines()[0] == "| scenario | trl-grpo-ext | rl-doctor | rlprobe | rlwatch |"
    assert len(text.splitlines()) == 2 + len(SCENARIOS) + 1 + len(PATHOLOGIES)
    healthy = [row for row in results["scenarios"] if row["scenario"] == "healthy"]
    assert all(not row["trl-grpo-ext"]["flagged"] for row in healthy)


def _first_two_columns(markdown: str) -> list[tuple[str, str]]:
    rows = [line.split(" | ")[:2] for line in markdown.splitlines() if line.startswith("| r")]
    return [(scenario.removeprefix("| "), ours) for scenario, ours in rows]


def test_the_docs_peer_table_shows_what_this_package_flags_now(corpus):
    # `python -m benchmarks health` writes the table; this package's column must follow every change to an alarm.
    rows = [
        {"source": s.source, "scenario": s.name, "skipped": s.skipped, "trl-grpo-ext": s.ours or None}
        for s in corpus.values()
    ]
    document = (pathlib.Path(__file__).parents[1] / "docs" / "diagnostics.md").read_text()
    documented = _first_two_columns(document.split("## Peer scenarios", 1)[1])
    assert documented == _first_two_columns(table({"scenarios": rows})), "rerun `python -m benchmarks health`"
