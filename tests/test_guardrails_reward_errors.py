"""Guardrails: a reward function that raises is named with the completion it failed on, before the step's update;
`None` rewards (unscored completions) are left out and counted."""

import math
import os

import pytest
import torch
from datasets import Dataset
from helpers import WeightRecorder, make_trainer
from safetensors.torch import load_file

from trl_grpo_ext import GRPOTrainerExt
from trl_grpo_ext.guardrails import RewardFunctionError
from trl_grpo_ext.guardrails.reward_errors import guard_reward_funcs, reward_kwarg_names


class TestRewardFunctions:
    def test_an_exception_names_the_function_and_the_completion(
        self, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
    ):
        def picky_reward(prompts, completions, trainer_state, **kwargs):
            if trainer_state.global_step == 1 and "xyz=" in prompts:
                raise ZeroDivisionError("cannot score xyz")
            return [float(len(c)) for c in completions]

        recorder = WeightRecorder()
        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            callbacks=[recorder],
            reward_funcs=picky_reward,
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

        trainer = make_trainer(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=Recording,
            reward_funcs=partial_reward,
            per_device_train_batch_size=16,
        )
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["reward"]) for entry in logs)
        assert {entry["frac_reward_unscored"] for entry in logs} == {0.25}
        # Unscored rows carry advantage 0 (TRL shuffles the rows before the loss, so count them).
        assert all((advantages == 0).sum() >= 4 for advantages in seen)


class TestRewardSignatures:
    def test_a_reward_without_kwargs_is_refused_when_the_trainer_is_built_naming_what_it_lacks(
        self, tiny_model_path, tiny_tokenizer, tmp_path
    ):
        dataset = Dataset.from_dict({"prompt": ["abc=", "xyz="] * 8, "solution": ["a", "b"] * 8})

        def strict_reward(completions, solution):
            return [float(c == s) for c, s in zip(completions, solution, strict=True)]

        with pytest.raises(TypeError) as error:
            make_trainer(tmp_path, tiny_model_path, tiny_tokenizer, dataset, reward_funcs=[strict_reward])
        message = str(error.value)
        assert "\n" not in message and message.startswith("Reward function 'strict_reward' does not take")
        assert "(prompts, completion_ids, trainer_state, log_extra, log_metric)" in message
        assert "add `**kwargs`" in message and "solution" not in message.split("):")[0]

    def test_the_dataset_columns_are_among_the_arguments_checked(self):
        kwarg_names = reward_kwarg_names(Dataset.from_dict({"prompt": ["a"], "solution": ["b"], "completion": ["c"]}))
        assert kwarg_names[-1] == "solution" and "completion" not in kwarg_names and "prompt" not in kwarg_names

        def no_solution(prompts, completions, completion_ids, trainer_state, log_extra, log_metric):
            return [0.0] * len(completions)

        with pytest.raises(
            TypeError, match=r"'no_solution' does not take the keyword arguments TRL passes it \(solution\)"
        ):
            guard_reward_funcs([no_solution], kwarg_names)

    def test_rewards_that_take_every_argument_or_kwargs_are_kept(self):
        def explicit(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, *, solution):
            return [0.0] * len(completions)

        async def with_kwargs(completions, **kwargs):
            return [0.0] * len(completions)

        kwarg_names = reward_kwarg_names(Dataset.from_dict({"prompt": ["a"], "solution": ["b"]}))
        guarded = guard_reward_funcs([explicit, with_kwargs, "some/reward-model"], kwarg_names)
        assert [getattr(func, "__name__", func) for func in guarded] == [
            "explicit",
            "with_kwargs",
            "some/reward-model",
        ]

    def test_only_the_logging_hooks_the_installed_trl_has_are_expected(self, monkeypatch):
        import trl

        assert {"log_extra", "log_metric"} <= set(reward_kwarg_names())
        monkeypatch.delattr(trl.GRPOTrainer, "_log_metric")
        assert "log_metric" not in reward_kwarg_names() and "log_extra" in reward_kwarg_names()
