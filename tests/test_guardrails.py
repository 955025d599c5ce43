"""Guardrails: non-finite updates never reach the weights, anomaly warnings, failing reward functions, bad input."""

import copy
import math
import os

import pytest
import torch
from datasets import Dataset
from helpers import count_a_reward, tiny_grpo_args
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.guardrails import AnomalyMonitor, NonFiniteGuard, NonFiniteTrainingError, RewardFunctionError


class WeightRecorder(TrainerCallback):
    """Keeps a copy of the trainable weights after every optimizer step (index 0: before training)."""

    def __init__(self):
        self.snapshots = []

    def snapshot(self, model):
        self.snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)


def nan_loss_trainer(nan_steps):
    class NanLossTrainer(GRPOTrainerExt):
        """Makes the loss NaN during the given optimizer steps (1-based)."""

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * math.nan if self.state.global_step + 1 in nan_steps else loss

    return NanLossTrainer


def build(trainer_class, tmp_path, tiny_model_path, tiny_tokenizer, dataset, reward=count_a_reward, **config):
    recorder = WeightRecorder()
    trainer = trainer_class(
        model=tiny_model_path,
        reward_funcs=reward,
        args=GRPOConfigExt(**tiny_grpo_args(tmp_path, **config)),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
        callbacks=[recorder],
    )
    return trainer, recorder


def same(a, b):
    return all(torch.equal(a[name], b[name]) for name in a)


class TestNonFiniteUpdates:
    def test_a_nan_loss_step_is_skipped_and_counted(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer, recorder = build(nan_loss_trainer({2}), tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset)
        trainer.train()
        before, step1, step2, step3 = recorder.snapshots[:4]
        assert not same(before, step1)
        assert same(step1, step2)  # the NaN step did not touch the weights
        assert not same(step2, step3)  # training went on
        assert all(torch.isfinite(p).all() for p in recorder.snapshots[-1].values())
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["nonfinite/skipped_steps"] for entry in logs] == [0, 1, 1, 1]
        assert math.isnan(logs[1]["grad_norm"])

    def test_stop_policy_checkpoints_the_last_good_state(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        trainer, recorder = build(
            nan_loss_trainer({3}), tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, nonfinite_policy="stop"
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
        trainer, recorder = build(
            nan_loss_trainer({2, 3, 4}),
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            max_nonfinite_skips=2,
        )
        with pytest.raises(NonFiniteTrainingError, match="3 steps in a row"):
            trainer.train()
        assert same(recorder.snapshots[1], recorder.snapshots[-1])

    def test_off_lets_nan_reach_the_weights(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer, recorder = build(
            nan_loss_trainer({2}), tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, nonfinite_policy="off"
        )
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            trainer.train()  # the NaN weights then break sampling: what the guard prevents
        assert any(torch.isnan(p).any() for p in recorder.snapshots[2].values())

    def test_guard_decisions(self):
        guard = NonFiniteGuard("skip", max_consecutive_skips=2)
        assert [guard.decide(finite) for finite in (True, False, False, True, False, False, False)] == [
            "step",
            "skip",
            "skip",
            "step",
            "skip",
            "skip",
            "stop",
        ]
        assert guard.skipped == 4
        assert NonFiniteGuard("stop").decide(False) == "stop"
        assert NonFiniteGuard("skip", max_consecutive_skips=0).decide(False) == "skip"
        with pytest.raises(ValueError, match="nonfinite_policy"):
            NonFiniteGuard("maybe")


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
        assert len(started[1]) == 1 and "Lower the learning rate" in started[1][0]  # clip, after 2 steps
        assert started[2] == []  # zero std cleared; clip still the same episode
        assert len(started[3]) == 4  # zero std again, ratio p95, ratio max, KL jump (0.5 > 10 x median 0.02)
        assert any("raise beta" in w for w in started[3]) and any("vLLM" in w for w in started[3])

    def test_thresholds_can_be_switched_off(self):
        monitor = AnomalyMonitor(zero_std_fraction=None, ratio_max=None)
        assert monitor.check({"frac_reward_zero_std": 1.0, "ratio/max": 1e9}) == []

    def test_a_run_without_reward_spread_warns_once(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        def constant_reward(completions, **kwargs):
            return [1.0] * len(completions)

        trainer, _ = build(
            GRPOTrainerExt, tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward=constant_reward
        )
        trainer.train()
        (monitor,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]
        assert len(monitor.warnings) == 1 and "groups whose rewards are all equal" in monitor.warnings[0]

    def test_monitor_can_be_switched_off(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        trainer, _ = build(
            GRPOTrainerExt, tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, warn_on_anomalies=False
        )
        assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]


class TestRewardFunctions:
    def test_an_exception_names_the_function_and_the_completion(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def picky_reward(prompts, completions, trainer_state, **kwargs):
            if trainer_state.global_step == 1 and "xyz=" in prompts:
                raise ZeroDivisionError("cannot score xyz")
            return [float(len(c)) for c in completions]

        trainer, recorder = build(
            GRPOTrainerExt,
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward=picky_reward,
            save_strategy="steps",
            save_steps=1,
        )
        with pytest.raises(RewardFunctionError) as error:
            trainer.train()
        message = str(error.value)
        assert "Reward function 'picky_reward' raised ZeroDivisionError: cannot score xyz" in message
        index = int(message.split("on completion ")[1].split(" ")[0])
        assert "prompt 'xyz='" in message and index >= 0
        # The failure came before the step's update: the weights are those of the last checkpoint.
        assert len(recorder.snapshots) == 2
        saved = load_file(os.path.join(tmp_path, "checkpoint-1", "model.safetensors"))
        assert all(torch.equal(saved[n], t) for n, t in recorder.snapshots[1].items() if n in saved)

    def test_none_rewards_are_left_out_and_counted(self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
        seen = []

        def partial_reward(completions, **kwargs):
            # The first completion of every group of 4 cannot be scored.
            return [None if i % 4 == 0 else float(c.count("a")) + 0.1 * len(c) for i, c in enumerate(completions)]

        class Recording(GRPOTrainerExt):
            def _compute_loss(self, model, inputs):
                seen.append(inputs["advantages"])
                return super()._compute_loss(model, inputs)

        trainer, _ = build(
            Recording,
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            reward=partial_reward,
            per_device_train_batch_size=16,
        )
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["reward"]) for entry in logs)
        assert {entry["frac_reward_unscored"] for entry in logs} == {0.25}
        # Unscored rows carry advantage 0 (TRL shuffles the rows before the loss, so count them).
        assert all((advantages == 0).sum() >= 4 for advantages in seen)


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
            (dict(per_device_train_batch_size=6, num_generations=4), "divisible by num_generations"),
            (dict(nonfinite_policy="ignore"), "`nonfinite_policy`"),
            (dict(warn_clip_fraction=0.0), "`warn_clip_fraction`"),
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
