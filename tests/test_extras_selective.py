"""Selective rollouts: predicted-flat prompts are skipped before generation and replaced in place, the decisions and
metrics follow the per-prompt history, the option off (or never skipping) changes nothing, a killed run resumes
exactly, and two processes decide alike."""

import math
import signal
from collections import defaultdict

import pytest
import torch
from datasets import Dataset
from helpers import (
    CONSTANT_PROMPTS,
    half_constant_reward,
    launch,
    make_trainer,
    phase_results,
    run_alone,
    tiny_grpo_args,
    train_logs,
    training_entries,
)
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.checkpointing import load_grpo_state
from trl_grpo_ext.extras.selective import INDEX_COLUMN, Selection
from trl_grpo_ext.guardrails import NonFiniteTrainingError

G = 4
TEXTS = ("abc=", "hello=", "xyz=", "qq=", "kite=", "zz=")  # 2 of them in CONSTANT_PROMPTS


def spread_except_constant(prompts, completions, **kwargs) -> list[float]:
    """Constant on CONSTANT_PROMPTS, and the completion's place in its group elsewhere: only those two are ever
    flat."""
    return [1.0 if prompt in CONSTANT_PROMPTS else float(i % G) for i, prompt in enumerate(prompts)]


def epochs_dataset(copies: int = 2) -> Dataset:
    """6 texts, each `copies` times (distinct indices): several epochs of a few steps each."""
    return Dataset.from_dict({"prompt": list(TEXTS) * copies})


class Recorder:
    """Every call of TRL's generation (this process's rows, decoded prompts) and the rewards it scored."""

    def __init__(self, trainer):
        self.calls, self.reward_kwargs = [], []
        stock = GRPOTrainer._generate_and_score_completions
        recorder = self

        def recorded(self_, inputs):
            if trainer.model.training:
                recorder.calls.append([row["prompt"] for row in inputs])
            return stock(self_, inputs)

        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(GRPOTrainer, "_generate_and_score_completions", recorded)

    def close(self):
        self.patch.undo()


def run(model_path, tokenizer, output_dir, dataset=None, reward=half_constant_reward, **options):
    options = {"num_iterations": 2, "beta": 0.0, "max_steps": 12, "per_device_train_batch_size": 8, **options}
    dataset = dataset if dataset is not None else epochs_dataset()
    trainer = make_trainer(output_dir, model_path, tokenizer, dataset, reward_funcs=reward, **options)
    recorder = Recorder(trainer)
    try:
        trainer.train()
    finally:
        recorder.close()
    return trainer, recorder


def generation_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "selective_rollouts/skipped_prompts" in entry]


def test_a_prompt_flat_at_its_last_visit_is_never_generated_again_without_exploration(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    trainer, recorder = run(
        tiny_model_path,
        tiny_tokenizer,
        tmp_path,
        reward=spread_except_constant,
        selective_rollouts=True,
        selective_rollouts_exploration=0.0,
        selective_rollouts_exploration_schedule=[0.0, 0.0, 0.01],
        max_steps=24,  # 12 generation batches of 2 prompts: 24 visits of 12 prompts
    )
    rows = trainer.args.generation_batch_size
    assert len(recorder.calls) == 12
    assert all(len(call) == rows for call in recorder.calls)  # each skipped prompt replaced in its place
    constant_visits = sum(call[i] in CONSTANT_PROMPTS for call in recorder.calls for i in range(0, rows, G))
    # Indices 2, 3, 8 and 9 hold the two constant texts: each is generated once at most (that visit makes it flat).
    assert 1 <= constant_visits <= 4
    streak = trainer._selective.streak
    assert set(streak.nonzero().flatten().tolist()) <= {2, 3, 8, 9} and streak.max() == 1
    logs = generation_logs(trainer)
    assert sum(entry["selective_rollouts/skipped_prompts"] for entry in logs) > 0
    assert all("selective_rollouts/precision" not in entry for entry in logs)  # nothing predicted flat explored
    for call, entry in zip(recorder.calls, logs, strict=True):
        flat = sum(call[i] in CONSTANT_PROMPTS for i in range(0, rows, G)) / (rows // G)
        assert entry["selective_rollouts/zero_spread"] == flat
        assert entry["frac_reward_zero_std"] == flat


def test_explored_predictions_are_scored_and_the_exploration_probability_follows_the_target(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    trainer, recorder = run(
        tiny_model_path,
        tiny_tokenizer,
        tmp_path,
        reward=spread_except_constant,
        selective_rollouts=True,
        selective_rollouts_exploration=0.9,
        selective_rollouts_exploration_schedule=[0.8, 1.0, 0.05],
        selective_rollouts_target_zero_spread=0.3,
        max_steps=24,
    )
    logs = generation_logs(trainer)
    precision = [entry["selective_rollouts/precision"] for entry in logs if "selective_rollouts/precision" in entry]
    assert precision and all(value == 1.0 for value in precision)  # only the constant texts are ever predicted flat
    probabilities = [entry["selective_rollouts/exploration_probability"] for entry in logs]
    assert probabilities[0] == pytest.approx(0.9)
    assert len(set(probabilities)) > 1
    for before, after, entry in zip(probabilities, probabilities[1:], logs, strict=False):
        # down after a batch above the target, up after one at or below it, within [0.8, 1.0]
        expected = before - 0.05 if entry["selective_rollouts/zero_spread"] > 0.3 else before + 0.05
        assert after == pytest.approx(min(1.0, max(0.8, expected)))
    for entry in logs:
        assert 0.0 <= entry["selective_rollouts/predicted_flat"] <= 1.0


def reward_with_answer(prompts, completions, answer, **kwargs) -> list[float]:
    return [float(a in c) + 0.1 * len(c) for c, a in zip(completions, answer, strict=True)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["alone", "with-dynamic-sampling"])
def test_never_skipping_changes_nothing_and_reward_functions_get_the_columns_they_get_without_it(
    dynamic, tiny_model_path, tiny_tokenizer, tmp_path
):
    """Selective rollouts that never skip (exploration 1) train step for step like the run without them: the index
    column reaches neither TRL's generation nor the reward functions, and the rows are TRL's."""
    dataset = Dataset.from_dict({"prompt": list(TEXTS) * 2, "answer": ["a", "b", "c"] * 4})
    seen = {}

    def recording_reward(prompts, completions, **kwargs):
        seen.setdefault(trainer_name[0], set()).add(tuple(sorted(kwargs)))
        return reward_with_answer(prompts, completions, **kwargs)

    results = {}
    for name, selective in (("without", {}), ("never-skipping", {"selective_rollouts": True})):
        trainer_name = [name]
        options = dict(dynamic_sampling=dynamic, **selective)
        if selective:
            options.update(
                selective_rollouts_exploration=1.0, selective_rollouts_exploration_schedule=[1.0, 1.0, 0.01]
            )
        trainer, recorder = run(
            tiny_model_path, tiny_tokenizer, tmp_path / name, dataset=dataset, reward=recording_reward, **options
        )
        results[name] = (trainer, recorder)
    (without, without_calls), (selective, selective_calls) = results["without"], results["never-skipping"]
    expected_kwargs = {("answer", "completion_ids", "log_extra", "log_metric", "trainer_state")}
    assert seen["without"] == seen["never-skipping"] == expected_kwargs
    assert selective_calls.calls == without_calls.calls
    expected = training_entries(without)
    got = training_entries(selective)
    assert len(expected) == len(got) == 12
    for want, have in zip(expected, got, strict=True):
        for key, value in want.items():
            if key != "step_time":
                assert have[key] == value, key
    assert all(entry["selective_rollouts/skipped_prompts"] == 0 for entry in generation_logs(selective))
    assert INDEX_COLUMN in selective.train_dataset.column_names
    assert INDEX_COLUMN not in without.train_dataset.column_names


def test_the_option_off_is_stock_trl_step_for_step(tiny_model_path, tiny_tokenizer, tmp_path):
    dataset = epochs_dataset()
    logs = {}
    for name, trainer_cls, config_cls, options in (
        ("stock", GRPOTrainer, GRPOConfig, {}),
        ("plain-config", GRPOTrainerExt, GRPOConfig, {}),
        ("off", GRPOTrainerExt, GRPOConfigExt, {"loss_type": "dapo", "use_bias_correction_kl": True}),
    ):
        logs[name], trainer = train_logs(
            tmp_path / "s",
            tiny_model_path,
            tiny_tokenizer,
            dataset,
            trainer_cls=trainer_cls,
            config_cls=config_cls,
            reward_funcs=half_constant_reward,
            num_iterations=2,
            beta=0.0,
            max_steps=6,
            **options,
        )
        if trainer_cls is GRPOTrainerExt:
            assert trainer._selective is None
            assert trainer.train_dataset.column_names == ["prompt"]
    for name in ("plain-config", "off"):
        for want, have in zip(logs["stock"], logs[name], strict=True):
            assert not any(key.startswith("selective_rollouts/") for key in have)
            for key in ("loss", "grad_norm", "reward", "frac_reward_zero_std", "entropy"):
                if key in want:
                    assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, key)


def test_remove_unused_columns_keeps_the_index(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer, recorder = run(
        tiny_model_path,
        tiny_tokenizer,
        tmp_path,
        dataset=Dataset.from_dict({"prompt": list(TEXTS) * 2, "other": list(range(12))}),
        reward=spread_except_constant,
        selective_rollouts=True,
        selective_rollouts_exploration=0.0,
        selective_rollouts_exploration_schedule=[0.0, 1.0, 0.01],
        remove_unused_columns=True,
        max_steps=16,
    )
    skipped = sum(entry["selective_rollouts/skipped_prompts"] for entry in generation_logs(trainer))
    assert recorder.calls and skipped > 0


def test_configuration_errors_name_the_option(tiny_model_path, tiny_tokenizer, tmp_path):
    cases = {
        "selective_rollouts_history": dict(selective_rollouts_history=0),
        "selective_rollouts_target_zero_spread": dict(selective_rollouts_target_zero_spread=1.5),
        "0 <= min <= max <= 1": dict(selective_rollouts_exploration_schedule=[0.9, 0.5, 0.01]),
        "selective_rollouts_exploration`": dict(selective_rollouts_exploration=0.01),
        "step must be >= 0": dict(selective_rollouts_exploration_schedule=[0.05, 1.0, -0.1]),
        "three numbers": dict(selective_rollouts_exploration_schedule=[0.05, 1.0]),
    }
    for name, options in cases.items():
        with pytest.raises(ValueError, match=name):
            GRPOConfigExt(**tiny_grpo_args(tmp_path, selective_rollouts=True, **options))
    for name in ("min", "max", "step"):  # the fields folded into the schedule are refused naming it
        with pytest.raises(ValueError, match=f"the {name} of selective_rollouts_exploration_schedule"):
            GRPOConfigExt(**tiny_grpo_args(tmp_path, **{f"selective_rollouts_exploration_{name}": 0.5}))
    iterable = epochs_dataset().to_iterable_dataset()
    with pytest.raises(ValueError, match="map-style"):
        make_trainer(tmp_path, tiny_model_path, tiny_tokenizer, iterable, selective_rollouts=True)


def test_the_checkpoint_of_a_non_finite_stop_holds_the_history_of_the_step_start(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    captured = {}

    class NanAtStep5(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.state.global_step + 1 == 5:
                captured["during"] = self._selective.state_dict()  # after step 5's generation decided
                loss = loss * math.nan
            return loss

    class AtStepStart(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 4:
                captured["start"] = captured["trainer"]._selective.state_dict()

    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        epochs_dataset(),
        trainer_cls=NanAtStep5,
        reward_funcs=half_constant_reward,
        callbacks=[AtStepStart()],
        num_iterations=2,
        beta=0.0,
        max_steps=8,
        per_device_train_batch_size=8,
        selective_rollouts=True,
        nonfinite_policy="stop",
    )
    captured["trainer"] = trainer
    with pytest.raises(NonFiniteTrainingError, match="checkpoint-4"):
        trainer.train()
    state = load_grpo_state(str(tmp_path / "checkpoint-4"), 0, "cpu")["extras"]
    assert state["selective_rollouts"]["decisions"] == captured["start"]["decisions"]
    assert torch.equal(state["selective_rollouts"]["streak"], captured["start"]["streak"])
    assert captured["during"]["decisions"] > captured["start"]["decisions"]  # step 5 generated


COMPARED = (
    "loss",
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "selective_rollouts/skipped_prompts",
    "selective_rollouts/precision",
    "selective_rollouts/zero_spread",
    "selective_rollouts/exploration_probability",
    "dynamic_sampling/generated_groups",
    "dynamic_sampling/rounds",
)


PHASE = "selective-checkpointed"


@pytest.mark.slow
def test_a_killed_run_with_selective_rollouts_resumes_to_the_decisions_and_logs_of_the_uninterrupted_run(
    tiny_model_path, tmp_path
):
    def run(output_dir, *extra):  # tests/launched.py's run, in <output_dir>/selective-checkpointed
        return run_alone(output_dir, tiny_model_path, [PHASE], *extra)

    reference = run(tmp_path / "reference", "--save_steps", "100")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Checkpoint 3 falls between a generation and its reuse; die while writing checkpoint 6.
    killed = run(tmp_path / "run", "--save_steps", "3", "--kill_during_save_of", "6")
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path / "run", "--save_steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (reference_saved,) = phase_results(tmp_path / "reference", PHASE, num_processes=1)
    (resumed_saved,) = phase_results(tmp_path / "run", PHASE, num_processes=1)

    def logs(saved):
        return {entry["step"]: entry for entry in saved["log_history"] if "loss" in entry}

    expected, got = logs(reference_saved), logs(resumed_saved)
    later = [step for step in expected if step > 3]
    assert any(expected[step].get("selective_rollouts/skipped_prompts", 0) > 0 for step in later)
    for step in later:
        for key in COMPARED:
            if key in expected[step]:
                assert got[step][key] == expected[step][key], (step, key)
    reference_rounds, resumed_rounds = reference_saved["rounds"], resumed_saved["rounds"]
    assert resumed_rounds == reference_rounds[-len(resumed_rounds) :]  # the same prompts decided after the resume


@pytest.fixture(scope="module")
def two_processes(tiny_model_path, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("selective-ddp")
    launch("cpu_ddp.yaml", output_dir, tiny_model_path, ["selective", "selective-disagree"])
    return output_dir


@pytest.mark.slow
def test_two_processes_take_the_same_decisions_generate_as_many_rows_and_train_whole_groups(two_processes):
    ranks = phase_results(two_processes, "selective")
    for rank in ranks:
        assert rank["engine"]["processes"] == 2 and rank["engine"]["distributed_type"].endswith("MULTI_CPU")
    assert ranks[0]["rounds"] == ranks[1]["rounds"]  # the same prompts decided on both, round by round
    assert ranks[0]["stock_rows"] == ranks[1]["stock_rows"]  # every generation call as many rows on each
    logs = [[entry for entry in rank["log_history"] if "loss" in entry] for rank in ranks]
    strip = [[{k: v for k, v in entry.items() if k != "step_time"} for entry in rank_logs] for rank_logs in logs]
    assert strip[0] == strip[1]
    assert sum(entry.get("selective_rollouts/skipped_prompts", 0) for entry in logs[0]) > 0
    for first, second in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        assert len(first["prompts"]) == len(second["prompts"]) == 6  # 3 rows per step, 2 steps per generation
        prompts = first["prompts"] + second["prompts"]
        assert all(len(set(prompts[i : i + G])) == 1 for i in range(0, len(prompts), G))  # whole groups


@pytest.mark.slow
def test_processes_whose_selections_differ_raise_an_error_naming_it_instead_of_training_apart(two_processes):
    for rank in phase_results(two_processes, "selective-disagree"):
        assert rank["error"] is not None and "different prompts" in rank["error"]


def test_a_prompt_held_twice_by_one_generation_batch_moves_its_history_once(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer = make_trainer(
        tmp_path, tiny_model_path, tiny_tokenizer, epochs_dataset(), selective_rollouts=True, max_steps=1
    )
    selective = trainer._selective
    metrics = defaultdict(list)

    def batch(*rounds):
        for prompts, informative in rounds:
            selective.observe(Selection(prompts, [False] * len(prompts)), torch.tensor(informative))
        selective.finish(metrics)
        return selective.streak[:3].tolist()

    assert batch(([0, 0, 1], [False, False, False])) == [1, 1, 0]  # one visit each, without spread
    assert batch(([0, 0], [False, True]), ([1], [False]), ([1], [False])) == [0, 2, 0]  # over rounds too
    assert batch(([0, 2, 0], [True, True, False])) == [0, 2, 0]  # spread in one of its groups: spread
