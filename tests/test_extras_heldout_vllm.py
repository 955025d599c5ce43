"""Held-out evaluation through the trainer's vLLM engine (a stand-in): the pass samples with TRL's
`vllm_generation.generate` after TRL's weight-sync check, its values are those of the engine's completions, training is
unchanged, and in server mode every process samples equal-sized chunks; the TRL attributes and methods it uses."""

import inspect

import pytest
import torch
import trl
from datasets import Dataset
from helpers import (
    HELDOUT_OPTIONS,
    SamplerStandIn,
    count_a_reward,
    heldout_dataset,
    letter_a_metric,
    make_trainer,
    tiny_grpo_args,
)
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext._compat import TRL_VLLM_ATTRIBUTES, VLLM_GENERATION_METHODS
from trl_grpo_ext.extras.generation import SamplingSettings
from trl_grpo_ext.extras.heldout import sync_vllm_weights
from trl_grpo_ext.extras.heldout_scoring import heldout_records, pool_heldout_records

VLLM = {"use_vllm": True, "vllm_mode": "colocate"}


class CountingStandIn(SamplerStandIn):
    """The stand-in engine, counting its weight syncs and recording each `generate` call (this process's)."""

    instances: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.syncs, self.calls = 0, []
        CountingStandIn.instances.append(self)

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        result = super().generate(prompts, images, num_generations, profiler)
        self.calls.append((len(prompts), num_generations, result[1]))
        return result


@pytest.fixture
def counting_engine(monkeypatch):
    import trl.trainer.grpo_trainer

    CountingStandIn.instances = []
    monkeypatch.setattr(trl.trainer.grpo_trainer, "VLLMGeneration", CountingStandIn)
    yield
    CountingStandIn.instances = []  # each holds its trainer's model: let them go with the test


def vllm_heldout_trainer(tmp_path, model_path, tokenizer, metrics=(letter_a_metric,), **config):
    """A trainer with `use_vllm` (the stand-in engine) and held-out evaluation."""
    return make_trainer(
        tmp_path,
        model_path,
        tokenizer,
        Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="] * 4}),
        trainer_kwargs={"heldout_metrics": list(metrics), "heldout_dataset": heldout_dataset()},
        **{**HELDOUT_OPTIONS, **VLLM, **config},
    )


def test_the_vllm_attributes_and_methods_the_package_uses_are_trl_s(
    counting_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from trl.generation.vllm_generation import VLLMGeneration

    stock = GRPOTrainer(
        tiny_model_path, count_a_reward, GRPOConfig(**tiny_grpo_args(tmp_path), **VLLM), prompt_dataset,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    for name in TRL_VLLM_ATTRIBUTES:
        assert hasattr(stock, name), f"trl.GRPOTrainer {trl.__version__} with vLLM has no attribute {name!r}"
    for name, arguments in VLLM_GENERATION_METHODS.items():
        inspect.signature(getattr(VLLMGeneration, name)).bind(None, **dict.fromkeys(arguments))


def test_the_weight_sync_check_is_trl_s(counting_engine, tiny_model_path, tiny_tokenizer, tmp_path):
    """TRL syncs before generating when `global_step` moved past `_last_loaded_step`; the copy does the same, so the
    training generation of a step whose weights a held-out pass already pushed does not push them again."""
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    for line in (
        "if self.state.global_step != self._last_loaded_step:",
        "self.vllm_generation.sync_weights()",
        "self._last_loaded_step = self.state.global_step",
    ):
        assert line in source, line
    trainer = vllm_heldout_trainer(tmp_path, tiny_model_path, tiny_tokenizer)
    engine = trainer.vllm_generation
    sync_vllm_weights(trainer)
    sync_vllm_weights(trainer)
    assert engine.syncs == 1 and trainer._last_loaded_step == 0
    trainer.state.global_step = 3
    sync_vllm_weights(trainer)
    assert engine.syncs == 2 and trainer._last_loaded_step == 3


def test_held_out_evaluation_samples_through_the_vllm_engine(
    counting_engine, tiny_model_path, tiny_tokenizer, tmp_path
):
    seen = []

    def recorded_letter_a(completions, completion_ids, **kwargs):
        seen.append((completions, completion_ids))
        return letter_a_metric(completions, **kwargs)

    trainer = vllm_heldout_trainer(tmp_path, tiny_model_path, tiny_tokenizer, metrics=(recorded_letter_a,))
    engine = trainer.vllm_generation
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    values = trainer.evaluate_heldout(log=False)
    assert torch.equal(torch.random.get_rng_state(), state)  # training's random stream is untouched
    assert engine.syncs == 1  # the weights of step 0, pushed once
    prompts = len(heldout_dataset())
    # Chunks of heldout_batch_size // n = 2 prompts, each prompt repeated n = 4 times, as TRL lays a batch out.
    assert [(rows, n) for rows, n, _ in engine.calls] == [(8, 4)] * (prompts // 2) + [(4, 4)] * (prompts % 2)
    # The metric scored the engine's own completions, decoded as TRL decodes them.
    engine_ids = [ids for _, _, completions in engine.calls for ids in completions]
    assert [ids for _, batch in seen for ids in batch] == engine_ids
    completions = [text for batch, _ in seen for text in batch]
    assert completions == tiny_tokenizer.batch_decode(engine_ids, skip_special_tokens=True)
    scores = [score for score in letter_a_metric(completions, ["a"] * len(completions)) if score is not None]
    assert values["heldout/recorded_letter_a/mean@4"] == pytest.approx(sum(scores) / len(scores))
    assert 0.0 <= values["heldout/recorded_letter_a/pass@1"] <= values["heldout/recorded_letter_a/pass@4"] <= 1.0


def test_held_out_evaluation_every_step_through_vllm_leaves_training_unchanged(
    counting_engine, tiny_model_path, tiny_tokenizer, tmp_path
):
    plain = vllm_heldout_trainer(tmp_path / "plain", tiny_model_path, tiny_tokenizer, metrics=())
    plain.train()
    evaluated = vllm_heldout_trainer(tmp_path / "heldout", tiny_model_path, tiny_tokenizer, heldout_every_steps=1)
    evaluated.train()
    heldout = [entry for entry in evaluated.state.log_history if "heldout/letter_a_metric/mean@4" in entry]
    assert [entry["step"] for entry in heldout] == [1, 2, 3, 4]
    assert len(evaluated.vllm_generation.calls) > len(plain.vllm_generation.calls)  # the passes went through it
    # One sync per optimizer step either way: the pass at the end of a step pushes the weights the next step
    # generates with (and the last pass those of the last step, which no training generation uses).
    assert plain.vllm_generation.syncs == 4 and evaluated.vllm_generation.syncs == 4 + 1
    trained = [[entry for entry in trainer.state.log_history if "loss" in entry] for trainer in (plain, evaluated)]

    def training_values(entry):  # without timing, and without the alarm that compares reward with held-out values
        return {key: value for key, value in entry.items() if key != "step_time" and not key.startswith("alarms/")}

    for first, second in zip(*trained, strict=True):
        assert training_values(first) == training_values(second)


class PooledEngine:
    """A stand-in for TRL's server-mode `generate` on one process: refuses a call whose size differs from the other
    processes' (TRL slices the pooled completions assuming equal sizes); completions depend on the prompt only."""

    def __init__(self):
        self.sizes = []

    def generate(self, prompts, images, num_generations):
        assert images is None
        self.sizes.append(len(prompts))
        return prompts, [list(reversed(ids))[:3] for ids in prompts], None, None


def test_in_server_mode_every_process_samples_equal_chunks_as_many_times(tiny_tokenizer):
    """5 prompts in chunks of 2 over 2 processes: process 0 samples chunks 0 and 2 (padded to 2 prompts), process 1
    chunk 1 and chunk 0 again; each makes 2 calls of 2 x n rows, and the pooled values are those of one process."""
    dataset = Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq=", "ba="], "target": ["a"] * 5})
    options = dict(num_generations=3, threshold=1.0, batch_size=6, seed=0)
    metrics = {"letter_a_metric": letter_a_metric}
    settings = SamplingSettings(max_completion_length=3)
    engines, parts = [PooledEngine(), PooledEngine()], []
    for rank, engine in enumerate(engines):
        parts.append(
            heldout_records(
                None, tiny_tokenizer, dataset, metrics, settings, process_index=rank, num_processes=2,
                vllm_generation=engine, equal_chunks=True, **options,
            )
        )  # fmt: skip
    assert [engine.sizes for engine in engines] == [[6, 6], [6, 6]]
    assert parts[0][:, 0].tolist() == [0, 1, 4] and parts[1][:, 0].tolist() == [2, 3, -1]
    one = heldout_records(None, tiny_tokenizer, dataset, metrics, settings, vllm_generation=PooledEngine(), **options)
    names = ["letter_a_metric"]
    assert pool_heldout_records(torch.cat(parts), names, 3, [1, 3]) == pool_heldout_records(one, names, 3, [1, 3])
