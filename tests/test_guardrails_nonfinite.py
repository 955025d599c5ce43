"""Guardrails: non-finite updates never reach the weights, anomaly warnings, bad input (failing reward functions:
`test_guardrails_reward_errors.py`)."""

import copy
import math
import os

import pytest
import torch
from datasets import Dataset
from helpers import WeightRecorder, count_a_reward, make_trainer, tiny_grpo_args
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.guardrails import (
    AnomalyMonitor,
    NonFiniteGuard,
    NonFiniteTrainingError,
    StepVerdict,
)


def nan_loss_trainer(nan_steps):
    class NanLossTrainer(GRPOTrainerExt):
        """Makes the loss NaN during the given optimizer steps (1-based)."""

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * math.nan if self.state.global_step + 1 in nan_steps else loss

    return NanLossTrainer


def same(a, b):
    return all(torch.equal(a[name], b[name]) for name in a)


class TestNonFiniteUpdates:
    def test_a_nan_loss_step_is_skipped_and_counted(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        recorder = WeightRecorder()
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            callbacks=[recorder],
        )
        trainer.train()
        before, step1, step2, step3 = recorder.snapshots[:4]
        assert not same(before, step1)
        assert same(step1, step2)  # the NaN step did not touch the weights
        assert not same(step2, step3)  # training went on
        assert all(torch.isfinite(p).all() for p in recorder.snapshots[-1].values())
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["nonfinite/skipped_steps"] for entry in logs] == [0, 1, 1, 1]
        assert math.isnan(logs[1]["grad_norm"])
        assert not any("alarms/grad_norm_spike" in entry for entry in logs)  # a skipped step is no spike

    def test_stop_policy_checkpoints_the_last_good_state(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        recorder = WeightRecorder()
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({3}),
            callbacks=[recorder],
            nonfinite_policy="stop",
        )
        with pytest.raises(NonFiniteTrainingError, match="Step 3: the gradient norm is nan.*checkpoint-2"):
            trainer.train()
        after_step2 = recorder.snapshots[2]
        assert len(recorder.snapshots) == 3
        assert same(after_step2, {n: p for n, p in trainer.model.named_parameters() if p.requires_grad})
        saved = load_file(os.path.join(tmp_path, "checkpoint-2", "model.safetensors"))
        assert all(torch.equal(saved[name], tensor) for name, tensor in after_step2.items() if name in saved)
        assert os.path.isfile(os.path.join(tmp_path, "checkpoint-2", "optimizer.pt"))

    def test_too_many_skips_in_a_row_stop_training(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        recorder = WeightRecorder()
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2, 3, 4}),
            callbacks=[recorder],
            max_nonfinite_skips=2,
        )
        with pytest.raises(NonFiniteTrainingError, match="3 steps in a row"):
            trainer.train()
        assert same(recorder.snapshots[1], recorder.snapshots[-1])

    def test_off_lets_nan_reach_the_weights(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        recorder = WeightRecorder()
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            callbacks=[recorder],
            nonfinite_policy="off",
        )
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            trainer.train()  # the NaN weights then break sampling: what the guard prevents
        assert any(torch.isnan(p).any() for p in recorder.snapshots[2].values())

    def test_guard_verdicts(self):
        guard = NonFiniteGuard("skip", max_consecutive_skips=2)
        verdicts = [guard.judge(finite).action for finite in (True, False, False, True, False, False, False)]
        assert verdicts == ["step", "skip", "skip", "step", "skip", "skip", "stop"]
        assert guard.skipped == 4
        assert NonFiniteGuard("stop").judge(False) == StepVerdict("stop")
        assert NonFiniteGuard("skip", max_consecutive_skips=0).judge(False).action == "skip"
        assert NonFiniteGuard("off").judge(False).action == "step"
        with pytest.raises(ValueError, match="nonfinite_policy"):
            NonFiniteGuard("maybe")

    def test_verdicts_under_a_loss_scaler_and_an_engine_that_steps_inside_backward(self):
        def loss_was(nonfinite):
            return lambda: nonfinite

        for policy in ("skip", "stop"):
            guard = NonFiniteGuard(policy)
            # fp16: an overflow from finite losses is the scaler's business, not a broken step
            assert guard.judge(False, loss_scaled=True, any_loss_nonfinite=loss_was(False)).action == "overflow"
            assert guard.judge(False, loss_scaled=True, any_loss_nonfinite=loss_was(True)).action == policy
            # DeepSpeed: the engine stepped already; it skipped the update, or the update is in the weights
            skipped = guard.judge(False, engine_stepped=True, engine_skipped=True)
            assert skipped == StepVerdict(policy, applied=False)
            assert guard.judge(False, engine_stepped=True) == StepVerdict("stop", applied=True)
            assert guard.judge(True, engine_stepped=True, engine_skipped=True).action == policy
            assert guard.judge(True, engine_stepped=True).action == "step"
        guard = NonFiniteGuard("skip")
        asked = []
        guard.judge(True, loss_scaled=True, any_loss_nonfinite=lambda: asked.append(1) or True)
        assert not asked  # the collective behind it runs only for a non-finite norm

    def test_the_loss_flag_is_kept_on_the_device_per_micro_batch(self):
        guard = NonFiniteGuard("skip")
        assert guard.pop_losses_finite() is None
        guard.record_loss(torch.tensor(1.0))
        guard.record_loss(torch.tensor(math.inf))
        guard.record_loss(torch.tensor(2.0))
        assert guard.pop_losses_finite().item() is False
        guard.record_loss(torch.tensor(3.0))
        assert guard.pop_losses_finite().item() is True
        off = NonFiniteGuard("off")
        off.record_loss(torch.tensor(math.nan))
        assert off.pop_losses_finite() is None


class SchedulerRecorder(TrainerCallback):
    def __init__(self):
        self.last_epochs = []

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.last_epochs.append(lr_scheduler.last_epoch)


class CheckpointReader(TrainerCallback):
    """The bytes of every file of a checkpoint, read right after Trainer saved it."""

    def __init__(self, step):
        self.step, self.files = step, None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.files = read_folder(os.path.join(args.output_dir, f"checkpoint-{self.step}"))


def read_folder(folder):
    contents = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as handle:
                contents[os.path.relpath(os.path.join(root, name), folder)] = handle.read()
    return contents


class TestNonFiniteStepsAndTrainingState:
    def test_a_skipped_step_does_not_advance_the_scheduler(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            lr_scheduler_type="linear",
        )
        recorder = SchedulerRecorder()
        trainer.add_callback(recorder)
        trainer.train()
        assert recorder.last_epochs == [1, 1, 2, 3]
        rates = [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]
        assert rates[2] == rates[1] and rates[1] < rates[0] and rates[3] < rates[2]

    def test_stop_never_rewrites_an_existing_checkpoint(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({3}),
            nonfinite_policy="stop",
            save_strategy="steps",
            save_steps=1,
            num_iterations=2,
        )
        reader = CheckpointReader(step=2)
        trainer.add_callback(reader)
        with pytest.raises(NonFiniteTrainingError, match="Step 3: .*checkpoint-2"):
            trainer.train()
        assert reader.files and read_folder(os.path.join(tmp_path, "checkpoint-2")) == reader.files
        assert sorted(name for name in os.listdir(tmp_path) if name.startswith("checkpoint-")) == [
            "checkpoint-1",
            "checkpoint-2",
        ]

    def test_the_stop_checkpoint_is_the_state_before_the_step_and_resumes_exactly(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        config = dict(num_iterations=2, max_steps=4)  # step 2 reuses the completions generated at step 1
        reference = make_trainer(tmp_path / "ref", tiny_model_path, tiny_tokenizer, prompt_dataset, **config)
        reference.train()
        stopped = make_trainer(
            tmp_path / "run",
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            nonfinite_policy="stop",
            **config,
        )
        with pytest.raises(NonFiniteTrainingError, match="Step 2: .*last good state is in .*checkpoint-1"):
            stopped.train()
        resumed = make_trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, prompt_dataset, **config)
        resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-1"))

        def logs(trainer):
            return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}

        expected, got = logs(reference), logs(resumed)
        assert sorted(got) == [1, 2, 3, 4]  # step 1 from the checkpoint's trainer state
        for step in (2, 3, 4):
            for key in ("loss", "grad_norm", "kl", "entropy", "ratio/mean"):
                assert got[step][key] == expected[step][key], (step, key)

    def test_a_stop_at_the_first_step_of_an_epoch_resumes_exactly(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        # The epoch's data-loader iterator draws from the generators before the step begins; a run resumed at the
        # start of an epoch restores them before creating it, so the checkpoint must hold the epoch-begin state.
        config = dict(num_iterations=2, max_steps=3)
        reference = make_trainer(tmp_path / "ref", tiny_model_path, tiny_tokenizer, prompt_dataset, **config)
        reference.train()
        stopped = make_trainer(
            tmp_path / "run",
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({1}),
            nonfinite_policy="stop",
            **config,
        )
        with pytest.raises(NonFiniteTrainingError, match="Step 1: .*last good state is in .*checkpoint-0"):
            stopped.train()
        resumed = make_trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, prompt_dataset, **config)
        resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-0"))
        expected = [entry for entry in reference.state.log_history if "loss" in entry]
        got = [entry for entry in resumed.state.log_history if "loss" in entry]
        assert len(got) == len(expected) == 3
        for step, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
            for key in ("loss", "grad_norm", "reward", "kl"):
                if key in want:
                    assert have[key] == want[key], (step, key)

    def test_the_guard_s_counters_survive_a_resume(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        config = dict(max_steps=4, save_strategy="steps", save_steps=3)
        uninterrupted = make_trainer(
            tmp_path / "ref",
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            **config,
        )
        uninterrupted.train()
        first = make_trainer(
            tmp_path / "run",
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=nan_loss_trainer({2}),
            **config,
        )
        first.train()
        resumed = make_trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, prompt_dataset, **config)
        resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-3"))
        skipped = [entry["nonfinite/skipped_steps"] for entry in uninterrupted.state.log_history if "loss" in entry]
        assert skipped == [0, 1, 1, 1]
        step4 = [entry for entry in resumed.state.log_history if entry.get("step") == 4 and "loss" in entry]
        assert step4[-1]["nonfinite/skipped_steps"] == 1
        assert resumed._nonfinite_guard.state_dict() == uninterrupted._nonfinite_guard.state_dict()


def with_a_loss_scaler(trainer):
    """The trainer (built with fp16=True), its accelerator given a gradient scaler, as fp16 on a GPU has (here on the
    CPU)."""
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.native_amp = True  # so that gradients are unscaled before their norm is taken, as on a GPU
    return trainer


def overflowing_trainer(steps):
    class OverflowTrainer(GRPOTrainerExt):
        """A finite loss whose scaled gradient overflows during the given steps (a routine fp16 overflow)."""

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * 1e36 if self.state.global_step + 1 in steps else loss

    return OverflowTrainer


class TestNonFiniteStepsWithALossScaler:
    @pytest.mark.parametrize("policy", ["skip", "stop"])
    def test_a_loss_scale_overflow_is_left_to_the_scaler(
        self, policy, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        recorder = WeightRecorder()
        trainer = with_a_loss_scaler(
            make_trainer(
                tmp_path,
                tiny_model_path,
                tiny_tokenizer,
                prompt_dataset,
                trainer_cls=overflowing_trainer({2}),
                callbacks=[recorder],
                fp16=True,
                nonfinite_policy=policy,
            )
        )
        trainer.train()  # no NonFiniteTrainingError, even with "stop"
        assert same(recorder.snapshots[1], recorder.snapshots[2])  # the scaler skipped the update
        assert not same(recorder.snapshots[2], recorder.snapshots[3])
        assert trainer.accelerator.scaler.get_scale() == 2.0**15  # and lowered its scale once
        assert trainer._nonfinite_guard.skipped == 0

    def test_a_nan_loss_under_a_scaler_is_a_skipped_step(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        recorder = WeightRecorder()
        trainer = with_a_loss_scaler(
            make_trainer(
                tmp_path,
                tiny_model_path,
                tiny_tokenizer,
                prompt_dataset,
                trainer_cls=nan_loss_trainer({2}),
                callbacks=[recorder],
                fp16=True,
            )
        )
        trainer.train()
        assert same(recorder.snapshots[1], recorder.snapshots[2])
        assert trainer._nonfinite_guard.skipped == 1
        assert [e["nonfinite/skipped_steps"] for e in trainer.state.log_history if "loss" in e] == [0, 1, 1, 1]


class TestAnomalyWarnings:
    def test_each_warning_fires_once_per_episode_and_says_what_to_change(self):
        monitor = AnomalyMonitor(patience=2)
        for kl in (0.0, 0.01, 0.02, 0.02):  # KL grows from 0: no jump
            assert monitor.check({"kl": kl}) == []
        steps = [
            {"frac_reward_zero_std": 0.95, "clip_ratio/region_mean": 0.3, "kl": 0.02},
            {"frac_reward_zero_std": 0.97, "clip_ratio/region_mean": 0.3, "kl": 0.03},
            {"frac_reward_zero_std": 0.2, "clip_ratio/region_mean": 0.3, "kl": 0.02},
            {"frac_reward_zero_std": 0.92, "ratio/p95": 2.0, "ratio/max": 500.0, "kl": 0.5},
        ]
        started = [monitor.check(logs) for logs in steps]
        assert ["num_generations" in w for w in started[0]] == [True]  # zero std, once
        assert len(started[1]) == 1 and "Lower the learning_rate" in started[1][0]  # clip, after 2 steps
        assert started[2] == []  # zero std cleared; clip still the same episode
        assert len(started[3]) == 4  # zero std again, ratio p95, ratio max, KL jump (0.5 > 10 x median 0.02)
        assert any("raise beta" in w for w in started[3]) and any("vLLM" in w for w in started[3])

    def test_thresholds_can_be_switched_off(self):
        monitor = AnomalyMonitor({"zero_std": None, "ratio_max": None})
        assert monitor.check({"frac_reward_zero_std": 1.0, "ratio/max": 1e9}) == []

    def test_a_run_without_reward_spread_warns_once(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        def constant_reward(completions, **kwargs):
            return [1.0] * len(completions)

        trainer = make_trainer(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=constant_reward)
        trainer.train()
        (monitor,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]
        zero_std = [warning for warning in monitor.warnings if "groups whose rewards are all equal" in warning]
        no_spread = [warning for warning in monitor.warnings if "no reward spread for 3 log steps" in warning]
        assert len(zero_std) == 1 and len(no_spread) == 1  # each once, over 4 log steps without spread

    def test_monitor_can_be_switched_off(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer = make_trainer(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, warn_on_anomalies=False)
        assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]


class TestBadInput:
    def test_an_empty_dataset_is_refused(self, tiny_model_path, tmp_path):
        with pytest.raises(ValueError, match="`train_dataset` is empty"):
            GRPOTrainerExt(
                model=tiny_model_path,
                reward_funcs=count_a_reward,
                args=GRPOConfigExt(**tiny_grpo_args(tmp_path)),
                train_dataset=Dataset.from_dict({"prompt": []}),
            )

    def test_a_dataset_without_prompts_is_refused(self, tiny_model_path, tmp_path):
        with pytest.raises(ValueError, match=r"no 'prompt' column \(its columns are \['question'\]\)"):
            GRPOTrainerExt(
                model=tiny_model_path,
                reward_funcs=count_a_reward,
                args=GRPOConfigExt(**tiny_grpo_args(tmp_path)),
                train_dataset=Dataset.from_dict({"question": ["a="]}),
            )

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            (dict(epsilon=0.0), "`epsilon` must be"),
            (dict(epsilon=-0.2), "`epsilon` must be"),
            (dict(epsilon_high=-0.1), "`epsilon_high` must be"),
            (dict(beta=-1.0), "`beta` must be"),
            (dict(num_generations=1), "at least 2 generations"),
            (dict(per_device_train_batch_size=6, num_generations=4), "must give whole groups of `num_generations`"),
            (dict(nonfinite_policy="ignore"), "`nonfinite_policy`"),
            (dict(alarm_thresholds={"clip_fraction": 0.0}), "`alarm_thresholds\\['clip_fraction'\\]`"),
        ],
    )
    def test_bad_hyperparameters_are_refused_by_the_config(self, overrides, message, tmp_path):
        with pytest.raises(ValueError, match=message):
            GRPOConfigExt(**tiny_grpo_args(tmp_path, **overrides))

    def test_a_plain_trl_config_with_bad_hyperparameters_is_refused(self, tiny_model_path, prompt_dataset, tmp_path):
        args = GRPOConfig(
            **tiny_grpo_args(tmp_path, loss_type="grpo", beta=0.04, use_bias_correction_kl=False, epsilon=0.0)
        )
        with pytest.raises(ValueError, match="`epsilon` must be"):
            GRPOTrainerExt(model=tiny_model_path, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset)


def test_weights_are_copied_not_aliased():
    # WeightRecorder must keep copies: a guard against a test that would pass vacuously.
    recorder = WeightRecorder()
    model = torch.nn.Linear(2, 2)
    recorder.snapshot(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not same(recorder.snapshots[0], {n: p for n, p in model.named_parameters()})
    assert copy.deepcopy(recorder.snapshots[0]).keys() == {"weight", "bias"}
