"""`trl-grpo-ext report RUN_DIR`: a GRPOTrainerExt run, a stock trl.GRPOTrainer run, folders without a run."""

import json
import os

import pytest
from helpers import count_a_reward, tiny_grpo_args
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.guardrails.alarms import DEFAULTS
from trl_grpo_ext.tools import cli
from trl_grpo_ext.tools.report.command import find_run
from trl_grpo_ext.tools.report.health import SIGNALS, assess

PNG = b"\x89PNG\r\n\x1a\n"


def report(run_dir, capsys, *extra):
    capsys.readouterr()  # what the training printed
    status = cli.main(["report", str(run_dir), *extra])
    out, err = capsys.readouterr()
    return status, out, err


def flat(text: str) -> str:
    """`text` on one line: the report wraps its lines at `formats.WIDTH`."""
    return " ".join(text.split())


def health_lines(out: str) -> dict[str, str]:
    """signal name -> verdict, from the summary's lines (`  <verdict> <signal name> <detail>`)."""
    verdicts = {}
    for line in out.splitlines():
        verdict, _, rest = line.strip().partition(" ")
        if line.startswith("  ") and verdict in ("ok", "ALARM", "FAIL", "note", "short", "shown", "missing"):
            names = [signal.name for signal in SIGNALS if rest.lstrip().startswith(signal.name + " ")]
            verdicts[max(names, key=len)] = verdict  # "reward spread in groups", not "reward"
    return verdicts


def write_state(folder, global_step, log_history):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": global_step, "log_history": log_history}))


def test_a_folder_without_a_run_exits_non_zero_with_a_one_line_reason(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    status, out, err = report(tmp_path / "empty", capsys)
    assert status == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "holds no trainer_state.json" in err
    status, _, err = report(tmp_path / "nowhere", capsys)
    assert status == 1 and "is not a folder" in err


def test_an_unreadable_state_exits_non_zero(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text("{")
    status, _, err = report(tmp_path, capsys)
    assert status == 1 and "cannot be read as a trainer state" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "trainer_state.json").write_text("[]")
    status, _, err = report(tmp_path, capsys)
    assert status == 1 and "no log_history" in err


def test_the_state_further_on_is_read_the_folder_s_or_its_last_checkpoint_s(tmp_path):
    write_state(tmp_path, 2, [{"loss": 1.0, "step": 2}])
    write_state(tmp_path / "checkpoint-4", 4, [{"loss": 1.0, "step": 4}])
    found = find_run(str(tmp_path))
    path, state = found.path, found.state
    assert path.endswith("checkpoint-4/trainer_state.json") and state["global_step"] == 4
    write_state(tmp_path, 6, [{"loss": 1.0, "step": 6}])  # the end of the run, after its last checkpoint
    assert find_run(str(tmp_path)).state["global_step"] == 6


def test_a_run_without_logged_steps_is_read(tmp_path, capsys):
    write_state(tmp_path, 0, [])
    status, out, _ = report(tmp_path, capsys)
    assert status == 0 and "report.png: not written, no training step was logged" in flat(out)
    assert set(health_lines(out)) == {signal.name for signal in SIGNALS}


def test_report_on_a_finished_grpo_trainer_ext_run(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, capsys):
    run_dir = tmp_path / "ext"
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(
            **tiny_grpo_args(run_dir, max_completion_length=1, save_strategy="steps", save_steps=4, max_steps=4)
        ),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    (run_dir / "report.png").unlink()  # written with the checkpoint's model card: the command rewrites it
    status, out, _ = report(run_dir, capsys)
    assert status == 0
    first = f"Run {run_dir}: checkpoint-4/trainer_state.json at global step 4, 4 training log entries"
    assert flat(out).startswith(first)
    assert (run_dir / "report.png").read_bytes()[:8] == PNG
    assert "panels without data" not in flat(out)  # every panel has something to draw
    verdicts = health_lines(out)
    assert list(verdicts) == [signal.name for signal in SIGNALS]  # one line per signal, in the table's order
    assert verdicts["completion length"] == "ALARM" and verdicts["importance ratio"] == "ok"
    assert verdicts["held-out metric"] == "missing" and verdicts["loss split"] == "shown"
    assert "not logged: heldout/<metric>/mean@<k> (no held-out evaluation was logged during training)" in flat(out)
    assert "truncation (steps 1-4): " in flat(out) and "Raise max_completion_length" in flat(out)
    assert "Keys not recognised" not in flat(out)  # every key the run logged is documented (TRL's step_time included)


def test_report_on_a_stock_trl_run_says_what_is_missing(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, capsys
):
    run_dir = tmp_path / "stock"
    trainer = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=GRPOConfig(**tiny_grpo_args(run_dir, save_strategy="steps", save_steps=4)),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    status, out, _ = report(run_dir, capsys)
    assert status == 0 and (run_dir / "report.png").read_bytes()[:8] == PNG
    verdicts = health_lines(out)
    assert list(verdicts) == [signal.name for signal in SIGNALS]
    # TRL logs these: judged; the reward of 4 log steps is too short to tell whether the run learned.
    for name in ("groups without spread", "entropy", "completion length", "gradient norm"):
        assert verdicts[name] in ("ok", "ALARM"), name
    assert verdicts["reward"] == "short" and "too short to judge (4 log entries): plateau needs" in flat(out)
    # GRPOTrainerExt's own metrics, and kl with TRL's beta = 0: missing, with the reason.
    for name in ("importance ratio", "unscored completions", "KL to the reference"):
        assert verdicts[name] == "missing", name
    assert "not logged: ratio/p95 (GRPOTrainerExt logs it with log_diagnostics; stock TRL does not)" in flat(out)
    assert "not logged: kl (logged only when beta > 0" in flat(out)
    assert "panels without data: " in flat(out) and "importance ratio r = pi / pi_old (ratio/p50" in flat(out)
    assert "Keys not recognised" not in flat(out)  # every key of stock TRL's is known (step_time included)


def test_the_command_is_listed_and_has_help(capsys):
    assert cli.main([]) == 2 and "report" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0 and text.startswith("usage: trl-grpo-ext report [-h] [--output OUTPUT] [--format")


def test_health_verdicts_of_counts_and_of_a_held_out_metric_that_falls():
    history = [
        {"loss": 0.0, "step": 1, "reward": 0.1, "frac_reward_unscored": 0.0, "nonfinite/skipped_steps": 0},
        {"loss": 0.0, "step": 2, "reward": 0.2, "frac_reward_unscored": 0.25, "nonfinite/skipped_steps": 1},
        {"step": 2, "heldout/accuracy/mean@4": 0.6, "heldout/accuracy/scored@4": 200},
        {"loss": 0.0, "step": 3, "reward": 0.5, "frac_reward_unscored": 0.0, "nonfinite/skipped_steps": 1},
        {"step": 3, "heldout/accuracy/mean@4": 0.3, "heldout/accuracy/scored@4": 200},
    ]
    health = {signal.signal.name: signal for signal in assess(history).signals}
    unscored, skipped = health["unscored completions"], health["skipped non-finite steps"]
    assert unscored.verdict == "note" and "not 0 at step 2" in unscored.detail
    assert skipped.verdict == "note" and "not 0 at steps 2-3" in skipped.detail
    held_out = health["held-out metric"]
    assert held_out.verdict == "ALARM" and "reward_vs_heldout at step 3" in held_out.detail
    assert "heldout/accuracy/mean@4 0.6 -> 0.3" in held_out.detail
    assert health["reward"].verdict == "short" and health["KL to the reference"].verdict == "missing"


def test_the_run_that_wrote_the_folder_last_is_read_and_the_other_run_is_named(tmp_path, capsys):
    old = [{"loss": 1.0, "step": step, "reward": 0.1} for step in range(1, 401)]
    write_state(tmp_path / "checkpoint-400", 400, old)
    new = [{"loss": 0.5, "step": step, "reward": 0.2} for step in range(1, 21)]
    write_state(tmp_path / "checkpoint-10", 10, new[:10])  # the new run's own checkpoint: not another run
    write_state(tmp_path, 20, new)
    for age, folder in ((300, tmp_path / "checkpoint-400"), (10, tmp_path / "checkpoint-10"), (0, tmp_path)):
        stamp = (tmp_path / "trainer_state.json").stat().st_mtime - age
        os.utime(folder / "trainer_state.json", (stamp, stamp))
    found = find_run(str(tmp_path))
    path, state = found.path, found.state
    assert path == str(tmp_path / "trainer_state.json") and state["global_step"] == 20
    status, out, _ = report(tmp_path, capsys)
    first = f"Run {tmp_path}: trainer_state.json at global step 20, 20 training log"
    assert status == 0 and flat(out).startswith(first)
    assert "also holds trainer states of another run: checkpoint-400/trainer_state.json (step 400)." in flat(out)
    assert "checkpoint-10" not in flat(out)


def test_one_run_s_checkpoints_and_final_state_are_not_called_other_runs(tmp_path, capsys):
    history = [{"loss": 0.5, "step": step} for step in range(1, 5)]
    write_state(tmp_path / "checkpoint-2", 2, history[:2])
    write_state(tmp_path / "checkpoint-4", 4, history)
    status, out, _ = report(tmp_path, capsys)
    assert status == 0 and "another run" not in flat(out)


def truncated_run(run_dir, model, tokenizer, dataset, **fields):
    """A 4-step run whose one-token completions are all truncated, with a checkpoint at its end."""
    options = tiny_grpo_args(run_dir, max_completion_length=1, save_strategy="steps", save_steps=4, **fields)
    trainer = GRPOTrainerExt(
        model=model,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(**options),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer


def test_the_report_judges_with_the_run_s_own_thresholds(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, capsys
):
    truncated_run(
        tmp_path / "off", tiny_model_path, tiny_tokenizer, prompt_dataset, alarm_thresholds={"truncation": None}
    )
    status, out, _ = report(tmp_path / "off", capsys)
    assert status == 0 and "Thresholds: the run's own alarm_thresholds (from its trainer state)." in flat(out)
    assert "truncation (" not in flat(out)  # the run switched that alarm off
    truncated_run(tmp_path / "quiet", tiny_model_path, tiny_tokenizer, prompt_dataset, warn_on_anomalies=False)
    status, out, _ = report(tmp_path / "quiet", capsys)
    assert status == 0 and "it ran with warn_on_anomalies=False" in flat(out)
    assert "truncation (steps 1-4): " in flat(out)  # judged all the same, with its thresholds


def test_the_image_is_drawn_with_the_run_s_own_thresholds(tmp_path, capsys, monkeypatch):
    from trl_grpo_ext.tools.report import figure

    drawn = []
    monkeypatch.setattr(figure, "plot_training_report", lambda *args, **kwargs: drawn.append(kwargs) or args[1])
    # recorded by a release whose thresholds were `warn_*` fields (`kl_max`: `warn_kl_max`), read as their alarms
    settings = {"args": {"enabled": True, "patience": 3, "thresholds": {"kl_max": 0.5}}, "attributes": {}}
    state = {
        "global_step": 1,
        "log_history": [{"loss": 0.1, "kl": 0.4, "step": 1}],
        "stateful_callbacks": {"AlarmSettings": settings},
    }
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps(state))
    write_state(tmp_path / "stock", 1, state["log_history"])
    assert report(tmp_path / "run", capsys)[0] == 0 and report(tmp_path / "stock", capsys)[0] == 0
    assert [kwargs["thresholds"]["kl_high"] if kwargs["thresholds"] else None for kwargs in drawn] == [0.5, None]
    assert drawn[0]["thresholds"]["zero_std"] == DEFAULTS["zero_std"]  # not recorded: the default


def test_a_run_with_infinite_values_is_reported_without_a_traceback(tmp_path, capsys):
    """A reward of +inf and -inf a few steps apart, infinite ratio quantiles and KL, NaN elsewhere: `report` reads
    any log, draws it and exits 0 (2 with --fail-on: every such run fails)."""
    inf = float("inf")
    history = []
    for step in range(1, 41):
        odd = {3: inf, 7: -inf, 11: inf, 12: float("nan")}
        history.append(
            {
                "loss": 0.1 if step != 12 else inf,
                "step": step,
                "reward": odd.get(step, 0.2 + step / 100),
                "kl": odd.get(step + 1, 0.01),
                "ratio/p05": -inf if step == 5 else 0.9,
                "ratio/p50": 1.0,
                "ratio/p95": odd.get(step, 1.1),
                "ratio/max": inf,
                "forward/tokens_per_distinct": odd.get(step, 1.5),
                "reward_std/frac_zero_groups": odd.get(step, 0.3),
                "grad_norm": odd.get(step - 1, 1.0),
            }
        )
    write_state(tmp_path, 40, history)
    for form in ("text", "markdown", "json"):
        status, out, err = report(tmp_path, capsys, "--format", form)
        assert status == 0 and out and "Traceback" not in err, (form, err)
    assert json.loads(out)["severity"] == "critical"
    assert report(tmp_path, capsys, "--fail-on", "critical")[0] == 2
    # finite values at the edge of the float range, which no axis can frame: the image is not drawn, and says why
    write_state(tmp_path, 40, [{**entry, "ratio/p05": -1e308, "ratio/p95": 1e308} for entry in history])
    status, out, _ = report(tmp_path, capsys)
    assert status == 0 and "report.png: not written, " in flat(out)


def test_the_auxiliary_reward_functions_are_the_run_s_or_those_named_on_the_command_line(tmp_path, capsys):
    from test_guardrails_alarms_rewards import composed_run, gaming, stalled

    history = composed_run(None, stalled, brevity=gaming)  # `brevity`'s name says nothing of what it scores
    write_state(tmp_path / "stock", 400, history)
    assert "reward_composition (" not in report(tmp_path / "stock", capsys)[1]
    status, out, _ = report(tmp_path / "stock", capsys, "--auxiliary-rewards", "brevity")
    assert status == 0 and "reward_composition (steps " in flat(out)
    assert "Auxiliary reward functions (for reward_composition): brevity, from --auxiliary-rewards." in flat(out)
    settings = {"args": {"enabled": True, "patience": 3, "thresholds": {}, "auxiliary_rewards": ["brevity"]}}
    state = {"global_step": 400, "log_history": history, "stateful_callbacks": {"AlarmSettings": settings}}
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "trainer_state.json").write_text(json.dumps(state))
    status, out, _ = report(tmp_path / "ext", capsys)
    assert "reward_composition (steps " in flat(out) and "brevity, from the run's warn_auxiliary_rewards." in flat(out)


def test_the_auxiliary_reward_functions_travel_from_the_configuration_to_the_trainer_state(tmp_path):
    from trl_grpo_ext.guardrails.anomaly import AlarmSettings

    for given, kept in ((["brevity", "tags"], ("brevity", "tags")), ("brevity", ("brevity",)), (None, None)):
        args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, report_to="none", warn_auxiliary_rewards=given)
        state = {"stateful_callbacks": {"AlarmSettings": AlarmSettings.from_config(args).state()}}
        restored = AlarmSettings.from_trainer_state(json.loads(json.dumps(state)))
        assert restored.auxiliary_rewards == kept and restored.monitor().auxiliary_rewards == kept
