"""Alarms sent as trackio and W&B alerts (`report.alerts.TrackerAlerts`): which episodes, to which trackers, and
what their offline stores hold after a run."""

import glob
import json
import sqlite3
import struct
from types import SimpleNamespace

import pytest
from helpers import make_trainer, run_alone
from transformers import TrainerControl, TrainerState

from trl_grpo_ext.extras import alerts
from trl_grpo_ext.extras.alerts import TrackerAlerts, alert_title
from trl_grpo_ext.guardrails.anomaly import AnomalyMonitor, Episode


@pytest.fixture
def sent(monkeypatch):
    """The alerts each tracker was sent, (title, text) in order, instead of sending them."""
    record = {"trackio": [], "wandb": []}
    for name in record:
        monkeypatch.setitem(alerts._SENDERS, name, lambda title, text, name=name: record[name].append((title, text)))
    return record


def log_step(callback, monitor, step, *new_episodes, report_to=("trackio", "wandb"), main=True):
    monitor.episodes.extend(new_episodes)
    state = TrainerState(global_step=step, is_world_process_zero=main)
    callback.on_log(SimpleNamespace(report_to=list(report_to)), state, TrainerControl(), logs={"loss": 0.0})


def test_each_episode_is_sent_once_to_each_tracker_of_report_to(sent):
    monitor = AnomalyMonitor()
    callback = TrackerAlerts(monitor)
    callback.on_train_begin(None, TrainerState(), TrainerControl())
    truncation = Episode("truncation", 3, 3, "Most completions were cut. Raise max_completion_length.")
    log_step(callback, monitor, 3, truncation, Episode("zero_std", 3, 3, "No spread."))
    log_step(callback, monitor, 4)  # the episodes go on: nothing new
    log_step(callback, monitor, 5, Episode("truncation", 5, 5, "Cut again."), report_to=("wandb", "tensorboard"))
    first = [
        ("GRPO alarm: truncation", "Step 3: Most completions were cut. Raise max_completion_length."),
        ("GRPO alarm: zero_std", "Step 3: No spread."),
    ]
    assert sent["trackio"] == first
    assert sent["wandb"] == [*first, ("GRPO alarm: truncation", "Step 5: Cut again.")]


def test_only_the_main_process_sends_and_a_resumed_run_does_not_send_again(sent):
    monitor = AnomalyMonitor()
    callback = TrackerAlerts(monitor)
    log_step(callback, monitor, 1, Episode("kl_jump", 1, 1, "KL jumped."), main=False)
    assert sent == {"trackio": [], "wandb": []}
    monitor.episodes.append(Episode("entropy_collapse", 2, 2, "replayed from the checkpoint's history"))
    callback.on_train_begin(None, TrainerState(), TrainerControl())
    log_step(callback, monitor, 3)
    assert sent == {"trackio": [], "wandb": []}


def test_a_tracker_that_refuses_an_alert_is_named_once_and_training_goes_on(monkeypatch, caplog):
    def refuse(title, text):
        raise RuntimeError("no run")

    monkeypatch.setitem(alerts._SENDERS, "wandb", refuse)
    monitor = AnomalyMonitor()
    callback = TrackerAlerts(monitor)
    for step in (1, 2):
        log_step(callback, monitor, step, Episode("kl_jump", step, step, "KL jumped."), report_to=("wandb",))
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["Could not send the alarm to wandb as an alert (RuntimeError: no run)."]


def test_a_tracker_without_a_run_is_left_alone():
    import trackio
    import wandb

    assert trackio.context_vars.current_run.get() is None and wandb.run is None
    assert alerts._send_trackio("t", "x") is False and alerts._send_wandb("t", "x") is False


def test_the_title_fits_w_and_b(sent):
    assert len(alert_title("x" * 100)) < 64 and alert_title("kl_jump") == "GRPO alarm: kl_jump"


def test_the_trainer_puts_the_alerts_after_the_monitor_and_the_loggers(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    def build(**overrides):
        return make_trainer(
            tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, report_to=["tensorboard"], **overrides
        )

    kinds = [type(callback).__name__ for callback in build().callback_handler.callbacks]
    assert kinds.index("AnomalyMonitor") < kinds.index("TensorBoardCallback") < kinds.index("TrackerAlerts")
    trainer = build(warn_on_anomalies=False)
    assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, (TrackerAlerts, AnomalyMonitor))]


def run_with_alarms(tmp_path, model_path, report_to: str, **env) -> str:
    """tests/launched.py's `alerts` phase: two steps that raise `truncation` and `zero_std` at step 1, reporting to
    `report_to`."""
    result = run_alone(tmp_path / "run", model_path, ["alerts"], "--report_to", report_to, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ALARMS ['truncation', 'zero_std']" in result.stdout
    return result.stdout


@pytest.mark.slow
def test_trackio_stores_one_alert_per_alarm_at_the_step_of_its_metrics(tiny_model_path, tmp_path):
    run_with_alarms(tmp_path, tiny_model_path, "trackio", TRACKIO_DIR=str(tmp_path / "trackio"))  # local store only
    with sqlite3.connect(tmp_path / "trackio" / "grpo-alerts.db") as connection:
        stored = connection.execute("SELECT title, text, level, step FROM alerts ORDER BY id").fetchall()
        metrics = connection.execute("SELECT step, metrics FROM metrics").fetchall()
    assert [(title, level) for title, _, level, _ in stored] == [
        ("GRPO alarm: zero_std", "warn"),
        ("GRPO alarm: truncation", "warn"),
    ]
    assert all(text.startswith("Step 1: 100% of completions") for _, text, _, _ in stored)
    assert "Raise max_completion_length" in stored[1][1]
    step_1 = {step for step, row in metrics if json.loads(row).get("train/global_step") == 1}
    assert {step for *_, step in stored} == step_1  # beside the metrics of global step 1 in the dashboard


def wandb_records(wandb_dir, kind: str) -> list:
    """The `kind` records of the offline W&B run under `wandb_dir`, from its `run-<id>.wandb` file (LevelDB's log
    format: 32 KiB blocks of records, each after a 7-byte header of checksum, length and type: full, first, middle or
    last fragment)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(path, "rb") as handle:
        data = handle.read()
    chunks, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, fragment = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if fragment == 1:
            chunks.append(chunk)
        elif fragment in (2, 3):
            pending = (pending if fragment == 3 else b"") + chunk
        elif fragment == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == kind:
            records.append(getattr(record, kind))
    return records


@pytest.mark.slow
def test_wandb_records_one_alert_per_alarm_offline(tiny_model_path, tmp_path):
    home = {name: str(tmp_path / "wandb-home") for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    run_with_alarms(
        tmp_path, tiny_model_path, "wandb", WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", **home
    )
    stored = wandb_records(tmp_path, "alert")
    assert [(alert.title, alert.level) for alert in stored] == [
        ("GRPO alarm: zero_std", "WARN"),
        ("GRPO alarm: truncation", "WARN"),
    ]
    assert all(alert.text.startswith("Step 1: 100% of completions") for alert in stored)
