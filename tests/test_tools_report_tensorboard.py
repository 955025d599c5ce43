"""`report` on a folder with only TensorBoard event files: stock TRL with save_strategy="no", report_to=tensorboard."""

import builtins
import json
import math
import time

import pytest
from test_tools_report_command import flat, report

from trl_grpo_ext.tools.report import tensorboard


def write_events(folder, entries, name="Dec03_12-00-00_host", args="{}"):
    """Event files as transformers' TensorBoardCallback writes them into `runs/<name>` (a folder per run, and per
    resume of a run): `train/<key>` scalars, `eval/<key>` for eval."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "runs" / name))
    for entry in entries:
        for key, value in entry.items():
            if key != "step":
                tag = "eval/" + key.removeprefix("eval_") if key.startswith("eval_") else "train/" + key
                writer.add_scalar(tag, value, entry["step"])
    writer.add_text("args", args, 0)  # the training arguments, as transformers records them
    writer.close()


def test_event_files_are_read_as_trl_s_log_history(tmp_path):
    write_events(tmp_path, [{"step": 1, "loss": 0.5, "reward": 0.25}, {"step": 2, "loss": 0.25, "eval_reward": 0.5}])
    history = tensorboard.read_event_files(tensorboard.event_files(str(tmp_path))).history
    assert history == [{"loss": 0.5, "reward": 0.25, "step": 1}, {"loss": 0.25, "eval_reward": 0.5, "step": 2}]


def test_a_folder_with_only_event_files_is_reported_with_a_nan_loss_failing(tmp_path, capsys):
    entries = [
        {"step": step, "loss": 0.5 if step < 8 else math.nan, "reward": 0.1, "my_metric": 1.0} for step in range(1, 11)
    ]
    write_events(tmp_path, entries)
    status, out, _ = report(tmp_path, capsys, "--format", "json", "--fail-on", "critical")
    assert status == 2
    document = json.loads(out)
    assert (
        document["read"] == "runs/Dec03_12-00-00_host"
        and document["source"] == "tensorboard"
        and document["global_step"] == 10
    )
    assert document["training_entries"] == 10 and document["unrecognised_keys"] == ["my_metric"]
    loss = next(finding for finding in document["findings"] if finding["name"] == "loss split")
    assert loss["verdict"] == "FAIL" and loss["onset_step"] == 8
    _, text, _ = report(tmp_path, capsys)
    assert flat(text).startswith(
        f"Run {tmp_path}: TensorBoard event files in runs/Dec03_12-00-00_host at global step 10"
    )
    assert "Keys not recognised (not judged): my_metric" in flat(text)


def test_without_tensorboard_the_reason_says_to_install_it(tmp_path, capsys, monkeypatch):
    events = tmp_path / "runs" / "x"
    events.mkdir(parents=True)
    (events / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    status, out, err = report(tmp_path, capsys)
    assert status == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "only TensorBoard event files" in err and "pip install tensorboard" in err and "[recipes]" in err


def test_a_run_restarted_in_the_same_folder_is_read_alone_and_the_earlier_run_is_named(tmp_path, capsys):
    # a 400-step run, then a new one from scratch into the same output_dir, stopped at step 20
    write_events(tmp_path, [{"step": step, "loss": 1.0, "reward": 0.9} for step in range(10, 401, 10)], "Dec03_first")
    time.sleep(0.05)  # the second run's files are written later
    write_events(tmp_path, [{"step": step, "loss": 0.5, "reward": 0.1} for step in range(1, 21)], "Dec04_second")
    status, out, _ = report(tmp_path, capsys, "--format", "json")
    document = json.loads(out)
    assert status == 0 and document["global_step"] == 20 and document["read"] == "runs/Dec04_second"
    assert document["training_entries"] == 20  # none of the first run's steps 30-400
    assert any("another run: runs/Dec03_first (step 400)" in note for note in document["notes"])


def test_a_resumed_run_s_event_files_are_one_run(tmp_path, capsys):
    # steps 1-30 logged, a checkpoint at 20, the crash, the resume: 21-50 logged again into a new folder
    write_events(tmp_path, [{"step": step, "loss": 1.0, "reward": 0.25} for step in range(1, 31)], "Dec03_first")
    time.sleep(0.05)
    write_events(tmp_path, [{"step": step, "loss": 0.5, "reward": 0.75} for step in range(21, 51)], "Dec03_resumed")
    history = tensorboard.read_event_files(tensorboard.event_files(str(tmp_path))).history
    assert [entry["step"] for entry in history] == list(range(1, 51))
    assert {entry["reward"] for entry in history if entry["step"] > 20} == {0.75}  # the resumed steps, not the lost
    status, out, _ = report(tmp_path, capsys, "--format", "json")
    document = json.loads(out)
    assert status == 0 and document["global_step"] == 50 and document["training_entries"] == 50
    assert not any("another run" in note for note in document["notes"])


def test_a_grpo_trainer_ext_run_s_event_files_are_judged_with_its_own_thresholds(tmp_path, capsys):
    from trl_grpo_ext import GRPOConfigExt

    entries = [{"step": step, "loss": 0.25, "kl": 0.75} for step in range(1, 6)]  # below the default kl_high (1.0)
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, report_to="none", alarm_thresholds={"kl_high": 0.5})
    write_events(tmp_path / "ext", entries, args=args.to_json_string())
    status, out, _ = report(tmp_path / "ext", capsys)
    assert (
        status == 0
        and "Thresholds: the run's own alarm_thresholds (from the arguments its event files record)." in flat(out)
    )
    assert "kl_high (step" in out and "exceeds 0.5" in out
    # a run of a release whose thresholds were `warn_*` fields: read as their alarms, not refused
    old = {key: value for key, value in json.loads(args.to_json_string()).items() if key != "alarm_thresholds"}
    write_events(
        tmp_path / "old", entries, args=json.dumps({**old, "warn_kl_max": 0.5, "warn_zero_std_fraction": 0.9})
    )
    status, out, _ = report(tmp_path / "old", capsys)
    assert status == 0 and "kl_high (step" in out and "exceeds 0.5" in out
    write_events(tmp_path / "stock", entries)  # a stock TRL run records no alarm settings
    status, out, _ = report(tmp_path / "stock", capsys)
    assert status == 0 and "Thresholds: GRPOConfigExt's defaults (no alarm settings in the arguments its event" in (
        flat(out)
    )
    assert "kl_high (" not in out
