"""`report` on a folder with only TensorBoard event files: stock TRL with save_strategy="no", report_to=tensorboard."""

import builtins
import json
import math

import pytest
from test_report_command import report

from trl_grpo_ext.report import tensorboard


def write_events(folder, entries):
    """Event files as transformers' TensorBoardCallback writes them: `train/<key>` scalars, `eval/<key>` for eval."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "runs" / "Dec03_12-00-00_host"))
    for entry in entries:
        for key, value in entry.items():
            if key != "step":
                tag = "eval/" + key.removeprefix("eval_") if key.startswith("eval_") else "train/" + key
                writer.add_scalar(tag, value, entry["step"])
    writer.add_text("args", "{}", 0)  # not a scalar: not read
    writer.close()


def test_event_files_are_read_as_trl_s_log_history(tmp_path):
    write_events(tmp_path, [{"step": 1, "loss": 0.5, "reward": 0.25}, {"step": 2, "loss": 0.25, "eval_reward": 0.5}])
    history = tensorboard.history_from_event_files(tensorboard.event_files(str(tmp_path)))
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
    assert text.startswith(f"Run {tmp_path}: TensorBoard event files in runs/Dec03_12-00-00_host at global step 10")
    assert "Keys not recognised (not judged): my_metric" in text


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
