"""Guardrails: a reward function that raises is named with the completion it failed on, before the step's update;
`None` rewards (unscored completions) are left out and counted."""

import math
import os

import pytest
import torch
from helpers import WeightRecorder, make_trainer
from safetensors.torch import load_file

from trl_grpo_ext import GRPOTrainerExt
from trl_grpo_ext.guardrails import RewardFunctionError


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
