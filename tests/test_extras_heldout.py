"""Held-out evaluation during training: pass@k, k completions per prompt sampled as training samples, the split over
processes, best-checkpoint selection by a held-out metric, and training left unchanged."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from helpers import (
    HELDOUT_OPTIONS,
    count_a_reward,
    heldout_arguments,
    heldout_dataset,
    letter_a_metric,
    make_trainer,
    tiny_grpo_args,
    train_logs,
    training_entries,
)
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.extras import heldout as heldout_module
from trl_grpo_ext.extras import heldout_scoring
from trl_grpo_ext.extras.generation import SamplingSettings, generate_completions, tokenize_prompts
from trl_grpo_ext.extras.heldout_scoring import heldout_records, pass_at_k, pool_heldout_records

SETTINGS = SamplingSettings(max_completion_length=6)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 20])
def test_pass_at_k_is_the_closed_form_on_known_counts(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            closed_form = 1.0 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(closed_form, abs=1e-12), (n, c, k)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, n) == 1.0
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1 is the share that passes


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError, match="1 <= k <= n"):
            pass_at_k(n, c, k)


def test_pooled_metrics_are_the_means_of_known_per_prompt_counts():
    # (prompt index, score sum, scored, passing) for one metric, 4 samples per prompt, out of order, with padding.
    records = torch.tensor(
        [[2.0, 3.0, 4.0, 3.0], [0.0, 0.5, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [1.0, 4.0, 4.0, 4.0]], dtype=torch.float64
    )
    values = pool_heldout_records(records, ["m"], num_generations=4, pass_at=[1, 2, 4])
    assert values["heldout/m/mean@4"] == pytest.approx((3.0 + 0.5 + 4.0) / (4 + 2 + 4))  # unscored left out
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in (0, 4, 3)) / 3
        assert values[f"heldout/m/pass@{k}"] == pytest.approx(expected)
    assert values["heldout/m/scored@4"] == 10  # the sample size of mean@4: the scored completions


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path)


def records(model, tokenizer, dataset, num_processes=1, **overrides):
    options = {"num_generations": 4, "threshold": 1.0, "batch_size": 8, "seed": 3, **overrides}
    metrics = {"letter_a_metric": letter_a_metric}
    per_process = [
        heldout_records(
            model, tokenizer, dataset, metrics, SETTINGS, process_index=rank, num_processes=num_processes, **options
        )
        for rank in range(num_processes)
    ]
    assert len({part.shape for part in per_process}) == 1  # padded alike: one gather
    return torch.cat(per_process)


def test_k_completions_per_prompt_are_sampled_as_training_samples(tiny_model, tiny_tokenizer):
    seen = []

    def recording(prompts, completions, completion_ids, target, trainer_state, **kwargs):
        seen.append((prompts, completions, completion_ids, target, trainer_state))
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": ["abc=", "hello="], "target": ["x", "y"]})
    heldout_records(
        tiny_model,
        tiny_tokenizer,
        dataset,
        {"recording": recording},
        SETTINGS,
        num_generations=3,
        threshold=1.0,
        seed=7,
        metric_kwargs={"trainer_state": "state"},
    )
    ((prompts, completions, completion_ids, target, state),) = seen  # one chunk
    assert prompts == ["abc="] * 3 + ["hello="] * 3 and target == ["x"] * 3 + ["y"] * 3 and state == "state"
    # The same completions as the pinned training-like sampler, given the prompts repeated and the chunk's seed.
    expected, expected_ids = generate_completions(
        tiny_model, tiny_tokenizer, prompts, SETTINGS, seed=7, return_ids=True
    )
    assert completions == expected and completion_ids == expected_ids
    assert len(set(completions)) > 1  # sampled, not greedy


def test_extras_restores_the_model_mode_and_the_random_state(tiny_model, tiny_tokenizer):
    tiny_model.train()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    records(tiny_model, tiny_tokenizer, heldout_dataset())
    assert torch.equal(torch.rand(3), expected) and tiny_model.training


@pytest.mark.parametrize("num_processes", [2, 3, 7])
def test_splitting_the_prompts_over_processes_gives_the_numbers_of_one_process(
    num_processes, tiny_model, tiny_tokenizer
):
    dataset = heldout_dataset()
    one = pool_heldout_records(records(tiny_model, tiny_tokenizer, dataset), ["letter_a_metric"], 4, [1, 2, 4])
    several = records(tiny_model, tiny_tokenizer, dataset, num_processes=num_processes)
    assert pool_heldout_records(several, ["letter_a_metric"], 4, [1, 2, 4]) == one  # exactly
    assert 0.0 < one["heldout/letter_a_metric/pass@4"] < 1.0  # a metric that varies, so the check means something
    assert one["heldout/letter_a_metric/pass@1"] <= one["heldout/letter_a_metric/pass@2"]


def test_with_sharded_weights_every_process_makes_the_same_number_of_generate_calls(
    tiny_model, tiny_tokenizer, monkeypatch
):
    dataset = heldout_dataset()  # 6 chunks: 2 or 1 over 4 processes
    unsynced = records(tiny_model, tiny_tokenizer, dataset, num_processes=4)
    calls = []
    original = heldout_scoring.sample_batch

    def counting(*args, synced_gpus, **kwargs):
        assert synced_gpus
        calls[-1] += 1
        return original(*args, synced_gpus=False, **kwargs)  # one process here: nothing to synchronise with

    monkeypatch.setattr(heldout_scoring, "sample_batch", counting)
    parts = []
    for rank in range(4):
        calls.append(0)
        parts.append(
            heldout_records(
                tiny_model,
                tiny_tokenizer,
                dataset,
                {"letter_a_metric": letter_a_metric},
                SETTINGS,
                num_generations=4,
                threshold=1.0,
                batch_size=8,
                seed=3,
                process_index=rank,
                num_processes=4,
                synced_gpus=True,
            )
        )
    assert calls == [2, 2, 2, 2]  # ranks 2 and 3 sample a chunk again and drop it
    assert torch.equal(torch.cat(parts), unsynced)


def test_held_out_evaluation_every_n_steps_leaves_training_unchanged(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    _, plain = train_logs(tmp_path / "plain", *tiny_run, trainer_kwargs=heldout_arguments(), **HELDOUT_OPTIONS)
    _, evaluated = train_logs(
        tmp_path / "heldout",
        *tiny_run,
        trainer_kwargs=heldout_arguments(letter_a_metric),
        heldout_every_steps=2,
        **HELDOUT_OPTIONS,
    )
    heldout = [entry for entry in evaluated.state.log_history if "heldout/letter_a_metric/mean@4" in entry]
    assert [entry["step"] for entry in heldout] == [2, 4]
    assert all(set(entry) >= {"heldout/letter_a_metric/pass@1", "heldout/letter_a_metric/pass@4"} for entry in heldout)
    assert all("loss" not in entry for entry in heldout)  # an entry of its own: training's metrics are not flushed
    trained = [training_entries(trainer) for trainer in (plain, evaluated)]
    for first, second in zip(*trained, strict=True):
        assert {key: value for key, value in first.items() if key != "step_time"} == {
            key: value for key, value in second.items() if key != "step_time"
        }


def peak_at_step_4(completions, trainer_state, **kwargs):
    """A held-out metric whose best value is at step 4 of 6 (what a reward-hacking run shows: the last checkpoint is
    not the best)."""
    return [{2: 0.2, 4: 0.9, 6: 0.5}[trainer_state.global_step]] * len(completions)


@pytest.mark.slow
@pytest.mark.parametrize("with_eval_dataset", [False, True], ids=["heldout-only", "with-trl-eval"])
def test_the_best_checkpoint_is_the_one_with_the_best_held_out_metric(
    with_eval_dataset, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    passes = []
    original_records = heldout_module.heldout_records
    monkeypatch.setattr(
        heldout_module, "heldout_records", lambda *a, **k: passes.append(1) or original_records(*a, **k)
    )

    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        eval_dataset=Dataset.from_dict({"prompt": ["abc=", "qq="] * 2}) if with_eval_dataset else None,
        trainer_kwargs=heldout_arguments(peak_at_step_4),
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="heldout/peak_at_step_4/mean@2",
        heldout_num_generations=2,
        heldout_every_steps=0 if with_eval_dataset else 2,  # an evaluation at a scheduled step reuses its pass
    )
    seen_by_callbacks = []

    class Recording(TrainerCallback):  # what EarlyStoppingCallback reads
        def on_evaluate(self, args, state, control, metrics, **kwargs):
            seen_by_callbacks.append(metrics["eval_heldout/peak_at_step_4/mean@2"])

    trainer.add_callback(Recording())
    evaluations = []
    original = trainer.evaluate
    trainer.evaluate = lambda *args, **kwargs: evaluations.append(original(*args, **kwargs)) or evaluations[-1]
    trainer.train()

    assert [round(metrics["eval_heldout/peak_at_step_4/mean@2"], 6) for metrics in evaluations] == [0.2, 0.9, 0.5]
    assert all(("eval_reward" in metrics) == with_eval_dataset for metrics in evaluations)  # TRL's evaluation too
    assert [round(value, 6) for value in seen_by_callbacks] == [0.2, 0.9, 0.5]
    assert trainer.state.best_metric == pytest.approx(0.9)
    assert trainer.state.best_model_checkpoint == os.path.join(str(tmp_path), "checkpoint-4")
    saved = load_file(os.path.join(str(tmp_path), "checkpoint-4", "model.safetensors"))
    final = trainer.model.state_dict()
    assert saved and all(torch.equal(final[name], tensor) for name, tensor in saved.items())  # loaded at the end
    last = load_file(os.path.join(str(tmp_path), "checkpoint-6", "model.safetensors"))
    assert any(not torch.equal(final[name], tensor) for name, tensor in last.items())
    logged = [entry["step"] for entry in trainer.state.log_history if "heldout/peak_at_step_4/mean@2" in entry]
    assert logged == [2, 4, 6]  # each evaluation's held-out pass has its own entry too
    assert len(passes) == 3  # one pass per evaluation, whether scheduled too or not


def test_held_out_settings_that_cannot_run_are_refused(tiny_model_path, tiny_tokenizer, tmp_path):
    train = Dataset.from_dict({"prompt": ["abc="] * 8})

    def build(config=None, **kwargs):
        args = GRPOConfigExt(**tiny_grpo_args(tmp_path, **(config or {})))
        return GRPOTrainerExt(tiny_model_path, count_a_reward, args, train, processing_class=tiny_tokenizer, **kwargs)

    held_out = {"heldout_metrics": [letter_a_metric], "heldout_dataset": heldout_dataset()}
    with pytest.raises(ValueError, match="heldout_every_steps=5 needs heldout_metrics"):
        build({"heldout_every_steps": 5})
    with pytest.raises(ValueError, match="needs held-out prompts"):
        build(heldout_metrics=[letter_a_metric])
    with pytest.raises(ValueError, match="'prompt' column"):
        build(heldout_metrics=[letter_a_metric], heldout_dataset=Dataset.from_dict({"question": ["x"]}))
    with pytest.raises(ValueError, match="functions f"):
        build(heldout_metrics=["exact_match"], heldout_dataset=heldout_dataset())
    with pytest.raises(ValueError, match="two metrics are named"):
        build(heldout_metrics=[letter_a_metric, letter_a_metric], heldout_dataset=heldout_dataset())
    with pytest.raises(ValueError, match="evaluate_heldout\\(\\) needs heldout_metrics"):
        build().evaluate_heldout()
    with pytest.raises(ValueError, match="heldout_pass_at=\\[8\\] needs heldout_num_generations >= 8"):
        build({"heldout_num_generations": 4, "heldout_pass_at": [8]}, **held_out)
    with pytest.raises(ValueError, match="heldout_pass_at` must list values >= 1"):
        GRPOConfigExt(**tiny_grpo_args(tmp_path, heldout_pass_at=[0, 2]))
    with pytest.raises(ValueError, match="metric_for_best_model='heldout/x/mean@1' needs heldout_metrics"):
        build(
            {
                "eval_strategy": "steps",
                "load_best_model_at_end": True,
                "save_strategy": "steps",
                "metric_for_best_model": "heldout/x/mean@1",
            },
            eval_dataset=train,
        )


def checkpointing_options(model) -> list[dict]:
    """The keyword arguments transformers checkpoints every layer with (`gradient_checkpointing_enable`)."""
    return [
        dict(module._gradient_checkpointing_func.keywords)
        for module in model.modules()
        if getattr(module, "_gradient_checkpointing_func", None) is not None
    ]


def test_a_held_out_pass_leaves_the_run_s_gradient_checkpointing_as_configured(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """Generation switches checkpointing off and on again: on again with the run's `use_reentrant=True` (TRL forces
    it for PEFT with ZeRO-3), not transformers' default, for the training forwards after every held-out pass."""
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_kwargs=heldout_arguments(letter_a_metric),
        max_steps=2,
        heldout_every_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
        **HELDOUT_OPTIONS,
    )
    seen = []

    class AtEveryStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(checkpointing_options(trainer.model))

    trainer.add_callback(AtEveryStep())
    trainer.train()
    assert len(seen) == 2 and all(seen)
    assert all(options.get("use_reentrant") is True for step in seen for options in step)  # step 2: after a pass


def test_held_out_prompts_are_rendered_with_the_trainer_s_tools_and_chat_template(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from trl_grpo_ext.extras.heldout import prompt_options

    def weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city.
        """
        return "sunny"

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = (
        "{% if tools %}tools:{% for tool in tools %}{{ tool.function.name }},{% endfor %}{% endif %}"
        "{% for message in messages %}{{ message.content }}{% endfor %}"
    )
    trainer = SimpleNamespace(tools=[weather], chat_template="t{{ messages[0].content }}=")
    options = prompt_options(trainer)
    assert options == {"tools": [weather], "chat_template": "t{{ messages[0].content }}="}
    prompt = [{"role": "user", "content": "abc"}]
    (ids,) = tokenize_prompts(tokenizer, [prompt], tools=options["tools"])
    assert tokenizer.decode(ids) == "tools:weather,abc"
    (ids,) = tokenize_prompts(tokenizer, [prompt], **options)
    assert tokenizer.decode(ids) == "tabc="


def test_a_best_model_metric_that_the_held_out_evaluation_does_not_log_is_refused_at_construction(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    with pytest.raises(ValueError, match=r"'heldout/letter_a_metric/mean@4' is not among .* mean@2"):
        make_trainer(
            tmp_path,
            *tiny_run,
            trainer_kwargs=heldout_arguments(letter_a_metric),
            **{**HELDOUT_OPTIONS, "heldout_num_generations": 2, "heldout_pass_at": [1, 2]},
            metric_for_best_model="heldout/letter_a_metric/mean@4",
        )
    make_trainer(
        tmp_path,
        *tiny_run,
        trainer_kwargs=heldout_arguments(letter_a_metric),
        metric_for_best_model="heldout/letter_a_metric/pass@2",
        **HELDOUT_OPTIONS,
    )
