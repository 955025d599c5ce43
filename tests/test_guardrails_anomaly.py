"""`AnomalyMonitor` and `AlarmSettings` (`guardrails/anomaly.py`): the counts in the logs the later callbacks see and
in the history, a resume, the run's own settings, real tiny runs, a warning after a progress bar."""

import pytest
from helpers import count_a_reward, monitor_of, tiny_grpo_args, train_logs, training_entries
from transformers import TrainerControl, TrainerState, TrainingArguments
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.guardrails import ALARMS, AlarmSettings, AnomalyMonitor
from trl_grpo_ext.guardrails.alarms import DEFAULTS


def callback_args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)


def test_counts_reach_the_logs_the_later_callbacks_see_and_the_history(tmp_path):
    monitor, state = AnomalyMonitor(), TrainerState()
    seen = []
    for step, clipped in enumerate((0.9, 0.9, 0.1, 0.9), start=1):
        logs = {"loss": 0.0, "completions/clipped_ratio": clipped}
        state.global_step = step
        state.log_history.append({**logs, "step": step})  # as Trainer.log records it before the callbacks
        monitor.on_log(callback_args(tmp_path), state, TrainerControl(), logs=logs)
        seen.append(logs.get("alarms/truncation"))
    assert seen == [1, 1, 1, 2]  # how many times it was given so far
    assert [entry["alarms/truncation"] for entry in state.log_history] == [1, 1, 1, 2]
    evaluation = {"eval_loss": 0.1}
    monitor.on_log(callback_args(tmp_path), state, TrainerControl(), logs=evaluation)
    assert "alarms/truncation" not in evaluation  # counts go with the training entries


def test_a_resumed_run_keeps_its_counts_and_does_not_warn_again(tmp_path, caplog):
    history = [{"loss": 0.0, "completions/clipped_ratio": 0.9, "step": step} for step in (1, 2)]
    state = TrainerState(log_history=list(history), global_step=2)
    monitor = AnomalyMonitor()
    monitor.on_train_begin(callback_args(tmp_path), state, TrainerControl())
    assert monitor.counts == {"truncation": 1} and monitor.warnings == []
    logs = {"loss": 0.0, "completions/clipped_ratio": 0.9}
    state.global_step = 3
    assert monitor.check(logs, 3) == []  # the same episode, not a new one


def test_the_config_defaults_are_the_monitor_s(tmp_path):
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, alarm_thresholds={"truncation": None})
    monitor = AnomalyMonitor.from_config(args)
    assert monitor.thresholds == {**DEFAULTS, "truncation": None} and list(monitor.thresholds) == list(ALARMS)
    assert "truncation" not in [rule.name for rule in monitor.rules]
    assert AnomalyMonitor.from_config(GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)).thresholds == DEFAULTS


def test_a_plain_trl_config_gets_the_alarm_settings_of_grpo_config_ext_s_defaults(tmp_path):
    ours = AlarmSettings.from_config(GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)).state()
    assert AlarmSettings.from_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True)).state() == ours


class TestOnRealRuns:
    def test_the_monitor_comes_before_the_loggers(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer = GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=count_a_reward,
            args=GRPOConfigExt(**tiny_grpo_args(tmp_path, report_to="tensorboard")),
            train_dataset=prompt_dataset,
            processing_class=tiny_tokenizer,
        )
        names = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
        assert names.index("AnomalyMonitor") < names.index("TensorBoardCallback")

    def test_one_token_completions_raise_the_truncation_alarm(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        _, trainer = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_completion_length=1)
        monitor = monitor_of(trainer)
        assert monitor.counts["truncation"] == 1
        entries = training_entries(trainer)
        assert entries[0]["completions/clipped_ratio"] >= 0.5
        assert [entry["alarms/truncation"] for entry in entries] == [1] * len(entries)
        trainer.create_model_card()
        health = (tmp_path / "README.md").read_text().split("## Training health")[1].split("\n## ")[0]
        assert "- truncation (steps 1-4): " in health and "Raise max_completion_length" in health

    def test_a_constant_reward_raises_the_no_spread_alarm_once(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def constant_reward(completions, **kwargs):
            return [1.0] * len(completions)

        _, trainer = train_logs(
            tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=constant_reward
        )
        monitor = monitor_of(trainer)
        assert monitor.counts["no_spread"] == 1 and monitor.counts["zero_std"] == 1
        (no_spread,) = [episode for episode in monitor.episodes if episode.name == "no_spread"]
        assert no_spread.start == DEFAULTS["no_spread"]  # the 3rd log step without spread
        assert "Truncation is" in no_spread.message  # says whether truncation is the cause
        assert [entry.get("alarms/no_spread") for entry in training_entries(trainer)] == [None, None, 1, 1]

    def test_a_reward_equal_to_the_length_raises_the_length_alarm(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def length_reward(completion_ids, **kwargs):
            return [float(len(ids)) for ids in completion_ids]

        _, trainer = train_logs(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward_funcs=length_reward,
            max_completion_length=16,
        )
        correlations = [entry.get("reward_length_corr/within_group") for entry in training_entries(trainer)]
        assert any(value == pytest.approx(1.0) for value in correlations if value is not None)
        assert monitor_of(trainer).counts["length_in_group"] == 1

    def test_an_unrelated_reward_shows_a_weak_length_correlation(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def parity_reward(completion_ids, **kwargs):  # depends on the tokens, not on how many
            return [float(sum(ids) % 2) for ids in completion_ids]

        _, trainer = train_logs(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward_funcs=parity_reward,
            max_completion_length=16,
        )
        assert "length_in_group" not in monitor_of(trainer).counts


@pytest.mark.parametrize("with_bar", [True, False])
def test_in_a_redirected_log_a_warning_starts_its_own_line_after_the_progress_bar(with_bar, monkeypatch):
    import io
    import logging
    import sys

    from tqdm import tqdm

    log = io.StringIO()  # stderr redirected to a file: the bar and the warnings in one stream, not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    handler = logging.StreamHandler(log)
    anomaly_logger = logging.getLogger("trl_grpo_ext.guardrails.anomaly")
    anomaly_logger.addHandler(handler)
    bar = tqdm(total=10, file=log, disable=not with_bar, mininterval=0)
    try:
        bar.update(3)
        (message,) = AnomalyMonitor().check({"completions/clipped_ratio": 0.9}, step=3)
    finally:
        bar.close()
        anomaly_logger.removeHandler(handler)
    before, _, _ = log.getvalue().partition(message)
    if with_bar:
        assert "3/10" in before and before.endswith("\n") and not before.endswith("\n\n")
    else:
        assert before == ""
