"""`report --format text|markdown|json` (one set of findings written three ways) and `--fail-on` exit codes."""

import json
import math
import os

import pytest
from test_tools_report_command import flat, report, write_state

from trl_grpo_ext.tools.report.formats import forward_summary, unrecognised_keys
from trl_grpo_ext.tools.report.health import SIGNALS


def healthy_history(steps: int = 12) -> list[dict]:
    return [
        {"loss": 0.1, "reward": 0.2 + step / 100, "grad_norm": 1.0, "entropy": 1.5, "step": step}
        for step in range(1, steps + 1)
    ]


def nan_loss_history(first_nan_step: int = 6, steps: int = 12) -> list[dict]:
    history = healthy_history(steps)
    for entry in history[first_nan_step - 1 :]:
        entry["loss"] = math.nan
    return history


def unscored_history() -> list[dict]:
    """A run whose only finding is a note: one completion went unscored at step 3."""
    history = healthy_history()
    for entry in history:
        entry["frac_reward_unscored"] = 0.25 if entry["step"] == 3 else 0.0
    return history


def truncated_history(share: float) -> list[dict]:
    """A run with `share` of its completions cut at every log step."""
    return [{**entry, "completions/clipped_ratio": share} for entry in healthy_history()]


def test_a_nan_loss_trace_is_not_called_healthy(tmp_path, capsys):
    write_state(tmp_path, 12, nan_loss_history())
    status, out, _ = report(tmp_path, capsys)
    assert status == 0  # findings change the status only with --fail-on
    assert "FAIL    loss split" in out and "not finite (NaN or inf) from step 6" in out
    assert "No alarm was raised and no health check failed" not in out
    write_state(tmp_path, 12, healthy_history())
    _, out, _ = report(tmp_path, capsys)
    assert "FAIL" not in out and "No alarm was raised and no health check failed." in out


def test_json_holds_every_finding_with_verdict_severity_and_onset(tmp_path, capsys):
    write_state(tmp_path, 12, nan_loss_history())
    status, out, _ = report(tmp_path, capsys, "--format", "json")
    assert status == 0
    document = json.loads(out)  # stdout is the JSON document and nothing else
    findings = {finding["name"]: finding for finding in document["findings"]}
    assert list(findings) == [signal.name for signal in SIGNALS]
    assert findings["loss split"]["verdict"] == "FAIL" and findings["loss split"]["severity"] == "critical"
    assert findings["loss split"]["onset_step"] == 6 and "from step 6" in findings["loss split"]["message"]
    assert findings["reward"]["severity"] == "ok" and findings["reward"]["onset_step"] is None
    assert document["severity"] == "critical" and document["global_step"] == 12 and document["alarms"] == []
    assert document["training_entries"] == 12 and document["read"] == "trainer_state.json"
    assert document["source"] == "trainer_state"


def test_json_lists_each_alarm_with_its_onset_step(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, capsys):
    from test_tools_report_command import truncated_run

    truncated_run(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset)
    status, out, _ = report(tmp_path, capsys, "--format", "json", "--fail-on", "warning")
    assert status == 2
    document = json.loads(out)
    truncation = next(alarm for alarm in document["alarms"] if alarm["name"] == "truncation")
    assert truncation["onset_step"] == 1 and truncation["steps"] == "steps 1-4" and truncation["severity"] == "warning"
    assert "Raise max_completion_length" in truncation["message"]
    length = next(finding for finding in document["findings"] if finding["name"] == "completion length")
    assert length["verdict"] == "ALARM" and length["onset_step"] == 1


@pytest.mark.parametrize(("share", "severity"), [(0.08, "note"), (0.2, "warning")])
def test_sustained_truncation_is_reported_with_its_tier_and_onset(tmp_path, capsys, share, severity):
    write_state(tmp_path, 12, truncated_history(share))
    document = json.loads(report(tmp_path, capsys, "--format", "json")[1])
    (alarm,) = document["alarms"]
    assert alarm["name"] == "truncation_sustained" and alarm["severity"] == severity
    assert alarm["onset_step"] == 5 and alarm["steps"] == "steps 5-12"  # the 5th log step in a row
    length = next(finding for finding in document["findings"] if finding["name"] == "completion length")
    assert length["verdict"] == "ALARM" and length["severity"] == severity and length["onset_step"] == 5
    assert document["severity"] == severity
    _, text, _ = report(tmp_path, capsys)
    assert "ALARM   completion length         truncation_sustained at steps 5-12" in text
    assert "No alarm was raised" not in text


def test_markdown_is_a_table_of_the_same_findings(tmp_path, capsys):
    write_state(tmp_path, 12, nan_loss_history())
    _, text, _ = report(tmp_path, capsys)
    status, out, _ = report(tmp_path, capsys, "--format", "markdown")
    assert status == 0 and out.startswith(f"### Training health: `{tmp_path}`")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| signal")]
    assert len(rows) == len(SIGNALS) + 1  # the separator row, then one row per signal
    loss_row = next(row for row in rows if row.startswith("| loss split |"))
    assert loss_row.startswith("| loss split | FAIL | not finite (NaN or inf) from step 6")
    assert "No alarm was raised" not in out and "Health, one line per signal" not in out
    assert "Health, one line per signal" in text  # the default is today's text


@pytest.mark.parametrize(
    ("history", "fail_on", "status"),
    [
        (nan_loss_history(), None, 0),
        (nan_loss_history(), "critical", 2),
        (nan_loss_history(), "note", 2),
        (unscored_history(), "note", 2),
        (unscored_history(), "warning", 0),
        (healthy_history(), "note", 0),
        (truncated_history(0.08), "note", 2),
        (truncated_history(0.08), "warning", 0),
        (truncated_history(0.2), "warning", 2),
        (truncated_history(0.2), "critical", 0),
        (truncated_history(0.02), "note", 0),
    ],
)
def test_fail_on_exits_2_at_or_above_its_tier(tmp_path, capsys, history, fail_on, status):
    write_state(tmp_path, 12, history)
    assert report(tmp_path, capsys, *(["--fail-on", fail_on] if fail_on else []))[0] == status


def test_an_unreadable_folder_exits_1_whatever_fail_on_says(tmp_path, capsys):
    status, out, err = report(tmp_path / "nowhere", capsys, "--fail-on", "critical", "--format", "json")
    assert status == 1 and out == "" and "is not a folder" in err


def test_the_help_names_the_formats_and_the_exit_codes(capsys):
    from trl_grpo_ext.tools import cli

    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--format {text,markdown,json}" in text and "--fail-on {note,warning,critical}" in text
    assert "1 it could not be read" in text and "2 a finding or alarm at or above the --fail-on tier" in text


def forward_history(padding: float, repeated: float, per_distinct: float) -> list[dict]:
    return [
        {
            **entry,
            "forward/padding_fraction": padding,
            "forward/repeated_prompt_fraction": repeated,
            "forward/tokens_per_distinct": per_distinct,
        }
        for entry in healthy_history(4)
    ]


def test_the_summary_says_what_the_forward_wastes_and_what_packing_saves(tmp_path, capsys):
    write_state(tmp_path, 4, forward_history(0.22, 0.15, 1.63))
    _, out, _ = report(tmp_path, capsys)
    text = flat(out)
    assert "forward: stock TRL's padded layout forwards 1.63 tokens per distinct token here (22% padding, 15%" in text
    assert "packs them (padding_free and shared_prompt_forward, on by default with GRPOConfigExt)" in text
    assert "forwards about 1.03: 37% fewer" in text
    forward = json.loads(report(tmp_path, capsys, "--format", "json")[1])["forward"]
    assert forward["tokens_per_distinct"] == 1.63
    assert forward["packed_tokens_per_distinct"] == pytest.approx(1.63 * 0.63)


def test_a_forward_with_nothing_to_save_is_not_told_to_pack_and_a_stock_run_has_no_forward_line():
    unpadded = forward_summary(forward_history(0.0, 0.1, 1.11))
    assert unpadded["message"].endswith("forwards about 0.999: 10% fewer")
    nothing = forward_summary(forward_history(0.0, 0.0, 1.0))
    assert nothing["message"] == (
        "forward: stock TRL's padded layout forwards 1 token per distinct token here (0% padding, 0% repeated "
        "prompts): little for packing to save"
    )
    assert forward_summary(healthy_history()) is None


def test_keys_the_report_does_not_know_are_named():
    history = [{"loss": 0.1, "step": 1, "eval_reward": 0.2, "rewards/acc/mean": 1.0, "my_custom": 3, "Loss": 1.0}]
    assert unrecognised_keys(history) == ["Loss", "my_custom"]
    assert unrecognised_keys(healthy_history()) == []


def test_a_stock_run_logged_every_10_steps_that_learned_nothing_fails_on_note(tmp_path, capsys):
    from test_guardrails_alarms_progress import logged_every

    # 400 steps, logging_steps=10, a flat reward: what TRL's defaults log
    history = [
        {**entry, "entropy": 1.0, "completions/mean_length": 40.0, "frac_reward_zero_std": 0.3}
        for entry in logged_every(10, lambda step: 0.3)
    ]
    write_state(tmp_path, 400, history)
    status, out, _ = report(tmp_path, capsys, "--fail-on", "note")
    assert status == 2 and "plateau" in out and "No alarm was raised" not in out


def test_a_run_too_short_to_judge_says_so(tmp_path, capsys):
    history = [{"step": step, "loss": 0.0, "grad_norm": 0.5, "reward": -2.0, "kl": 1e-9} for step in (5, 10)]
    write_state(tmp_path, 10, history)
    status, out, _ = report(tmp_path, capsys)
    assert status == 0 and "too short to judge" in out and "No alarm was raised" not in out
    document = json.loads(report(tmp_path, capsys, "--format", "json")[1])
    reward = next(finding for finding in document["findings"] if finding["name"] == "reward")
    assert reward["verdict"] == "short" and reward["message"].startswith("too short to judge")


def test_text_lines_fit_a_readable_width(tmp_path, capsys):
    """Every line of the text report, the alarms' advice included, is at most `formats.WIDTH` characters."""
    from trl_grpo_ext.tools.report.formats import WIDTH

    history = [
        {**entry, "completions/clipped_ratio": 0.9, "frac_reward_unscored": 0.25 if entry["step"] == 3 else 0.0}
        for entry in nan_loss_history()
    ]
    write_state(tmp_path / "checkpoint-400", 400, [{"loss": 1.0, "step": step} for step in range(1, 401)])
    stamp = (tmp_path / "checkpoint-400" / "trainer_state.json").stat().st_mtime - 60  # another run's, before
    os.utime(tmp_path / "checkpoint-400" / "trainer_state.json", (stamp, stamp))
    write_state(tmp_path, 12, history)
    status, out, _ = report(tmp_path, capsys)
    assert status == 0 and "another run" in out and "truncation (" in out
    assert WIDTH <= 100 and max(len(line) for line in out.splitlines()) <= WIDTH


def test_the_verdict_words_are_explained_where_they_are_used(tmp_path, capsys):
    write_state(tmp_path, 12, healthy_history())
    _, out, _ = report(tmp_path, capsys)
    (legend,) = [line for line in out.splitlines() if line.startswith("Verdicts: ")]
    assert "ok: judged, no alarm" in legend and "shown: drawn, never judged" in legend
    assert "missing: not logged" in legend and "FAIL" not in legend  # only the words the summary uses


def test_the_markdown_table_has_no_column_that_repeats_another(tmp_path, capsys):
    write_state(tmp_path, 12, truncated_history(0.08))
    _, out, _ = report(tmp_path, capsys, "--format", "markdown")
    assert "| signal | verdict | details |" in out
    row = next(line for line in out.splitlines() if line.startswith("| completion length |"))
    assert row.startswith("| completion length | ALARM (note) | truncation_sustained at steps 5-12")


def test_the_forward_line_says_what_stock_trl_s_padding_would_forward_and_what_packing_does():
    message = forward_summary(forward_history(0.44, 0.15, 2.44))["message"]
    assert message.startswith("forward: stock TRL's padded layout forwards 2.44 tokens per distinct token")
    assert "(44% padding, 15% repeated prompts)" in message and "59% fewer" in message
    assert "packs them" in message and "padding_free and shared_prompt_forward" in message
    options = {"padding_free": True, "shared_prompt_forward": True}
    packed = forward_summary(forward_history(0.44, 0.15, 2.44), packed=options)["message"]
    assert "this run packed its forward" in packed and "forwarded about 1 token per distinct token" in packed
    options = {"padding_free": False, "shared_prompt_forward": False}
    unpacked = forward_summary(forward_history(0.44, 0.15, 2.44), packed=options)["message"]
    assert "this run forwarded the padded layout" in unpacked and "packing would forward 59% fewer" in unpacked


def test_the_sampling_line_is_shown_only_where_it_says_what_to_do(tmp_path, capsys):
    from test_tools_report_sampling import history as flat_history

    write_state(tmp_path, 4, flat_history([0.1, 0.1, 0.15, 0.1], epochs=5.0))
    _, out, _ = report(tmp_path, capsys)
    assert "sampling:" not in out  # few groups without spread: nothing to change
    write_state(tmp_path, 4, flat_history([0.6, 0.6, 0.7, 0.7], epochs=1.0))
    _, out, _ = report(tmp_path, capsys)
    line = flat(out).split("sampling: ", 1)[1]
    assert "every completion scored the same" in line and "dynamic_sampling=True replaces those groups" in line
    assert "selective_rollouts" not in line  # the prompts do not recur: nothing it could do
