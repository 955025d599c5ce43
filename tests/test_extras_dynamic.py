"""Dynamic sampling: the groups that train have a reward spread, their advantages are TRL's for the batch that trains,
rounds are bounded, nothing changes where nothing is dropped, and a killed run resumes exactly."""

import math
import signal

import pytest
import torch
from helpers import (
    CONSTANT_PROMPTS,
    constant_reward,
    count_a_reward,
    half_constant_reward,
    make_trainer,
    phase_results,
    run_alone,
    tiny_grpo_args,
    tiny_lora,
)
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

G = 4
REUSED = {"num_iterations": 2, "gradient_accumulation_steps": 2, "beta": 0.0}  # generations reused, no KL term


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """A second reward, constant on the same prompts as `half_constant_reward`."""
    return [
        0.0 if prompt in CONSTANT_PROMPTS else float(len(completion) % 3)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


class BatchRecorder:
    """Keeps every training batch `_generate_and_score_completions` hands to TRL (before TRL shuffles it)."""

    def __init__(self, trainer):
        self.batches = []
        original = trainer._generate_and_score_completions

        def recorded(inputs):
            output = original(inputs)
            if trainer.model.training:
                self.batches.append({key: value for key, value in output.items()})
            return output

        trainer._generate_and_score_completions = recorded


def generation_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry]


def batch_rewards(batch, tokenizer, reward_funcs) -> torch.Tensor:
    """`(N, F)`: each reward function on the batch's prompts and completions, decoded again."""
    prompts = tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    completions = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    return torch.tensor(
        [func(prompts=prompts, completions=completions) for func in reward_funcs], dtype=torch.float32
    ).T


def expected_advantages(rewards: torch.Tensor, scale_rewards: str, aggregation: str) -> torch.Tensor:
    """TRL's documented advantages, written out: group means, then group, batch or no scaling."""
    if aggregation == "normalize_then_sum":
        grouped = rewards.view(-1, G, rewards.size(1))
        normalised = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
        total = normalised.view(-1, rewards.size(1)).sum(dim=1)
        return (total - total.mean()) / (total.std() + 1e-4)
    total = rewards.sum(dim=1)
    grouped = total.view(-1, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "batch":
        return centred / (total.std() + 1e-4)
    return centred / (grouped.std(dim=1, keepdim=True).expand(-1, G).reshape(-1) + 1e-4)


# name -> (options, reward functions); each run takes about a second
COMBINATIONS = {
    "dapo-iterations-2-ga-2": ({"loss_type": "dapo"}, None),
    "steps-per-generation-4": ({"loss_type": "grpo", "steps_per_generation": 4, "num_iterations": 1}, None),
    "batch-scaling": ({"loss_type": "grpo", "scale_rewards": "batch"}, None),
    "no-scaling": ({"loss_type": "dr_grpo", "scale_rewards": "none"}, None),
    "normalize-then-sum": (
        {"loss_type": "bnpo", "multi_objective_aggregation": "normalize_then_sum"},
        [half_constant_reward, length_reward],
    ),
    "kl-penalty": ({"loss_type": "grpo", "beta": 0.04}, None),
    "lora": ({"loss_type": "dapo", "learning_rate": 5e-2, "lora": True}, None),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.1}, None),
    "sapo": ({"loss_type": "sapo"}, None),
    "vespo": ({"loss_type": "vespo"}, None),
    "with-skipping": ({"loss_type": "dapo", "skip_zero_advantage_rows": True}, None),
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_group_that_trains_has_a_reward_spread_and_trl_s_advantages_for_the_batch(
    name, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    options, rewards = COMBINATIONS[name]
    options = dict(options)
    lora = options.pop("lora", False)
    rewards = rewards or [half_constant_reward]
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=rewards,
        peft_config=tiny_lora() if lora else None,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        **{**REUSED, **options},
    )
    recorder = BatchRecorder(trainer)
    trainer.train()
    rows = trainer.args.generation_batch_size
    assert recorder.batches and all(batch["prompt_ids"].size(0) == rows for batch in recorder.batches)
    for batch in recorder.batches:
        assert batch["completion_ids"].shape == batch["completion_mask"].shape
        assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
        per_func = batch_rewards(batch, tiny_tokenizer, rewards)
        assert (per_func.sum(dim=1).view(-1, G).std(dim=1) > 0).all()  # no group without spread trains
        expected = expected_advantages(per_func, trainer.scale_rewards, trainer.multi_objective_aggregation)
        torch.testing.assert_close(batch["advantages"].float(), expected, rtol=1e-4, atol=1e-5)
    logs = generation_logs(trainer)
    assert logs and all(entry["frac_reward_zero_std"] == 0.0 for entry in logs)
    assert any(entry["dynamic_sampling/rounds"] > 0 for entry in logs)
    for entry in logs:
        generated = entry["dynamic_sampling/generated_groups"]
        # each extra round generates what the batch lacks: at least a group, at most a generation batch
        rounds = entry["dynamic_sampling/rounds"]
        assert rows / G + rounds <= generated <= (rounds + 1) * rows / G
        assert 0.0 < entry["dynamic_sampling/kept_fraction"] < 1.0
        if trainer.scale_rewards != "batch" and trainer.multi_objective_aggregation == "sum_then_normalize":
            # TRL's frac_reward_zero_std (else it tests the batch's std, not the groups')
            assert entry["dynamic_sampling/frac_reward_zero_std_generated"] > 0.0


def test_rounds_stop_at_the_limit_and_a_short_batch_keeps_its_zero_spread_groups(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=[constant_reward],
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=2,
        **REUSED,
    )
    recorder = BatchRecorder(trainer)
    trainer.train()
    logs = generation_logs(trainer)
    assert len(logs) == 2  # 4 steps, num_iterations=2
    for entry in logs:
        assert entry["dynamic_sampling/rounds"] == 2.0
        assert entry["dynamic_sampling/kept_fraction"] == 0.0
        assert entry["frac_reward_zero_std"] == 1.0
        assert entry["dynamic_sampling/generated_groups"] == 3 * trainer.args.generation_batch_size / G
    for batch in recorder.batches:  # the batch TRL sampled first, whole
        assert batch["prompt_ids"].size(0) == trainer.args.generation_batch_size
        assert (batch["advantages"] == 0).all()
    assert all(entry["loss"] == 0.0 for entry in trainer.state.log_history if "loss" in entry)


def test_where_no_group_is_dropped_the_run_is_stock_trl_s(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    stock = make_trainer(
        tmp_path / "s",
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=GRPOTrainer,
        config_cls=GRPOConfig,
        reward_funcs=count_a_reward,
        **REUSED,
    )
    stock.train()
    trainer = make_trainer(
        tmp_path / "o",
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=[count_a_reward],
        loss_type="dapo",  # TRL's defaults where GRPOConfigExt's differ
        use_bias_correction_kl=True,
        dynamic_sampling=True,
        **REUSED,
    )
    trainer.train()
    expected = [entry for entry in stock.state.log_history if "loss" in entry]
    got = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(expected) == len(got) == 4
    for want, have in zip(expected, got, strict=True):
        for key, value in want.items():
            if key != "step_time" and isinstance(value, float) and not math.isnan(value):
                assert have[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert all(entry["dynamic_sampling/rounds"] == 0.0 for entry in generation_logs(trainer))


def test_the_completions_table_holds_the_rows_that_train(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=[half_constant_reward],
        dynamic_sampling=True,
        max_steps=1,
        **REUSED,
    )
    recorder = BatchRecorder(trainer)
    trainer.train()
    batch = recorder.batches[-1]
    assert list(trainer._logs["prompt"]) == tiny_tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    assert list(trainer._logs["advantages"]) == pytest.approx(batch["advantages"].tolist())
    assert not set(trainer._logs["prompt"]) & {"xyz=", "qq="}


def test_a_plain_trl_config_and_the_default_do_not_sample_dynamically(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    for args in (GRPOConfig(**tiny_grpo_args(tmp_path)), GRPOConfigExt(**tiny_grpo_args(tmp_path))):
        trainer = GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=half_constant_reward,
            args=args,
            train_dataset=prompt_dataset,
            processing_class=tiny_tokenizer,
        )
        assert trainer._dynamic_sampler is None


def test_an_iterable_dataset_or_no_extra_round_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds"):
        GRPOConfigExt(**tiny_grpo_args(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=0))
    with pytest.raises(ValueError, match="map-style"):
        GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=half_constant_reward,
            args=GRPOConfigExt(**tiny_grpo_args(tmp_path, dynamic_sampling=True)),
            train_dataset=prompt_dataset.to_iterable_dataset(),
            processing_class=tiny_tokenizer,
        )


COMPARED = (
    "loss",
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "dynamic_sampling/rounds",
    "dynamic_sampling/kept_fraction",
    "dynamic_sampling/frac_reward_zero_std_generated",
)


@pytest.mark.slow
def test_a_killed_run_with_dynamic_sampling_resumes_to_the_logs_of_the_uninterrupted_run(tiny_model_path, tmp_path):
    def run(output_dir, *extra):  # tests/launched.py's crash and resume run, in <output_dir>/checkpointed
        return run_alone(output_dir, tiny_model_path, ["checkpointed"], "--dynamic_sampling", *extra)

    reference = run(tmp_path / "reference", "--save_steps", "100")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Checkpoint 3 falls between a generation (with extra rounds) and its reuse; die while writing checkpoint 6.
    killed = run(tmp_path / "run", "--save_steps", "3", "--kill_during_save_of", "6")
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path / "run", "--save_steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def logs(output_dir):
        (saved,) = phase_results(output_dir, "checkpointed", num_processes=1)
        return {entry["step"]: entry for entry in saved["log_history"] if "loss" in entry}

    expected, got = logs(tmp_path / "reference"), logs(tmp_path / "run")
    assert any(entry.get("dynamic_sampling/rounds", 0) > 0 for step, entry in expected.items() if step > 3)
    for step in (step for step in expected if step > 3):
        for key in COMPARED:
            if key in expected[step]:
                assert got[step][key] == expected[step][key], (step, key)


def test_the_checkpoint_of_a_non_finite_stop_holds_the_prompt_stream_of_the_step_start(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from trl_grpo_ext.checkpointing import load_grpo_state
    from trl_grpo_ext.guardrails import NonFiniteTrainingError

    drawn = {}

    class NanAtStep3(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.state.global_step + 1 == 3:
                drawn["during"] = self._dynamic_sampler.stream.state_dict()  # after step 3's generation drew
                loss = loss * math.nan
            return loss

    class AtStepStart(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                drawn["start"] = trainer._dynamic_sampler.stream.state_dict()

    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=NanAtStep3,
        reward_funcs=half_constant_reward,
        callbacks=[AtStepStart()],
        num_iterations=2,
        beta=0.0,
        dynamic_sampling=True,
        nonfinite_policy="stop",
    )
    with pytest.raises(NonFiniteTrainingError, match="checkpoint-2"):
        trainer.train()
    assert drawn["during"] != drawn["start"]  # step 3 generated with extra rounds
    state = load_grpo_state(str(tmp_path / "checkpoint-2"), 0, "cpu")
    assert state["extras"]["prompt_stream"] == drawn["start"]


def completion_length_reward(completions, **kwargs) -> list[float]:
    return [float(len(completion)) for completion in completions]


def test_dynamic_sampling_logs_the_length_reward_correlation_of_the_batch_that_trains(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """The alarm `length_in_group` reads it: the assembled batch's spread comes with its completion lengths."""
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        reward_funcs=[completion_length_reward],
        dynamic_sampling=True,
        max_completion_length=12,
        temperature=1.5,
        **REUSED,
    )
    trainer.train()
    logs = generation_logs(trainer)
    assert logs and all(entry["reward_length_corr/within_group"] > 0.9 for entry in logs)  # tokens: chars + EOS
    for entry in logs:  # the batch that trains, beside TRL's counts over every generated round
        assert 0.0 <= entry["dynamic_sampling/trained_clipped_ratio"] <= 1.0
        assert 1.0 <= entry["dynamic_sampling/trained_mean_length"] <= 12.0
