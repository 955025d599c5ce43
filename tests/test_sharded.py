"""FSDP2 and DeepSpeed ZeRO-2/3 with two CPU processes (gloo), launched with recipes/accelerate_configs/cpu_*.yaml.

Each engine costs two launches of tests/launched.py: the first runs the NaN, LoRA and crash phases and dies
(SIGKILL) while writing a checkpoint; the second resumes that run, then trains the uninterrupted reference and its
twin through TRL's padded forward, and runs the recipe. Every phase records the engine accelerate ran and the size of
a local shard against the full size.
"""

import json
import os
from dataclasses import dataclass

import pytest
import torch
from helpers import (
    assert_heldout_is_that_of_one_process,
    assert_logged_statistics_are_those_of_both_processes_pooled,
    assert_one_gather_per_log_step,
    assert_packed_is_padded,
    heldout_in_one_process,
    launch,
    phase_results,
)

from trl_grpo_ext.checkpointing import STAGING_DIR

ENGINES = {
    "fsdp2": ("cpu_fsdp2.yaml", "DistributedType.FSDP", None),
    "zero2": ("cpu_zero2.yaml", "DistributedType.DEEPSPEED", 2),
    "zero3": ("cpu_zero3.yaml", "DistributedType.DEEPSPEED", 3),
}
FIRST_LAUNCH = ("nan-skip", "nan-stop", "lora", "crash")  # "crash" kills the processes: last
SECOND_LAUNCH = ("resume", "reference", "padded", "heldout", "recipe")  # "recipe" ends the process group: last
# tests/launched.py's constants
SAVE_STEPS, KILL_STEP, MAX_STEPS, NAN_STEP = 3, 6, 8, 2
COMPARED = ("loss", "grad_norm", "reward", "kl", "clip_ratio/region_mean", "ratio/mean", "entropy")


@dataclass
class EngineRun:
    engine: str
    output_dir: str
    crashed: object  # the first launch's CompletedProcess

    def phase(self, name: str) -> list[dict]:
        return phase_results(self.output_dir, name)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_run(request, tiny_model_path, tmp_path_factory) -> EngineRun:
    engine = request.param
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[dev]' installs it)")
    output_dir = str(tmp_path_factory.mktemp(engine))
    config = ENGINES[engine][0]
    crashed = launch(config, output_dir, tiny_model_path, FIRST_LAUNCH, check=False)
    launch(config, output_dir, tiny_model_path, SECOND_LAUNCH)
    return EngineRun(engine, output_dir, crashed)


def logs_by_step(log_history) -> dict[int, dict]:
    return {entry["step"]: entry for entry in log_history if "loss" in entry}


def complete_checkpoints(run_dir) -> list[int]:
    return sorted(int(name.split("-")[1]) for name in os.listdir(run_dir) if name.startswith("checkpoint-"))


@pytest.mark.slow
def test_the_engine_is_active_and_shards(engine_run):
    _, distributed_type, zero_stage = ENGINES[engine_run.engine]
    for phase in ("nan-skip", "nan-stop", "lora", "resume", "reference", "heldout", "recipe"):
        for rank in engine_run.phase(phase):
            proof = rank["engine"]
            assert proof["distributed_type"] == distributed_type, phase
            assert proof["num_processes"] == 2 and proof.get("zero_stage") == zero_stage, phase
            # Two processes: each holds half of the sharded tensor (FSDP2 and ZeRO-3: a parameter; ZeRO-2: the fp32
            # master weights that its optimizer states shadow).
            assert proof["local"] * 2 == proof["full"], (phase, proof)


@pytest.mark.slow
def test_loss_and_grad_norm_match_a_ddp_run_of_the_same_processes(engine_run, ddp_reference):
    sharded = logs_by_step(engine_run.phase("reference")[0]["log_history"])
    ddp = logs_by_step(ddp_reference[0]["log_history"])
    assert sorted(sharded) == sorted(ddp) == list(range(1, MAX_STEPS + 1))
    assert sum("reward" in entry for entry in ddp.values()) == MAX_STEPS // 2  # num_iterations=2
    for step, expected in ddp.items():
        # The same completions were sampled (rewards are exact; logged by the steps that generate), so the losses
        # are comparable.
        assert sharded[step].get("reward") == expected.get("reward"), step
        # float32, the same values reduced in another order (reduce-scatter vs all-reduce, per-shard norms summed):
        # each reduction differs by a few units in the last place (1e-7 relative), and 8 steps of updates at lr 1e-2
        # carry that into the weights. The largest differences seen on this machine: 1e-7 absolute on losses,
        # 3.5e-7 relative on gradient norms; the bounds leave a factor of 10 or more. A loss is a sum of terms that
        # cancel (on-policy steps: about 1e-7 around 0), where only an absolute bound means anything.
        assert sharded[step]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6), step
        assert sharded[step]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), step


@pytest.mark.slow
def test_padding_free_log_probs_train_as_trl_s_padded_forward(engine_run):
    assert_packed_is_padded(engine_run.phase("reference"), engine_run.phase("padded"))


@pytest.mark.slow
def test_logged_diagnostics_are_those_of_both_processes_pooled(engine_run):
    assert_logged_statistics_are_those_of_both_processes_pooled(engine_run.phase("reference"))


@pytest.mark.slow
def test_diagnostics_add_exactly_one_collective_per_log_step(engine_run):
    assert_one_gather_per_log_step(engine_run.phase("reference"))


def assert_same_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.slow
def test_a_nan_on_one_process_is_skipped_on_every_process(engine_run):
    for rank in engine_run.phase("nan-skip"):
        assert rank["error"] is None and rank["skipped"] == 1 and rank["global_step"] == NAN_STEP + 1
        logs = logs_by_step(rank["log_history"])
        assert [logs[step]["nonfinite/skipped_steps"] for step in sorted(logs)] == [0, 1, 1]
        assert_same_weights(rank["before"], rank["after"])  # the step left this process's weights untouched
        assert all(torch.isfinite(weight).all() for weight in rank["final"].values())
        assert any(not torch.equal(rank["final"][name], rank["after"][name]) for name in rank["final"])  # trained on


@pytest.mark.slow
def test_a_nan_on_one_process_stops_every_process_before_the_update(engine_run):
    for rank in engine_run.phase("nan-stop"):
        assert f"Step {NAN_STEP}: the gradient norm is" in rank["error"]
        assert f"checkpoint-{NAN_STEP - 1}" in rank["error"]
        assert rank["after"] is None  # the step never ended
        assert_same_weights(rank["before"], rank["final"])
    checkpoint = os.path.join(engine_run.output_dir, "nan-stop", f"checkpoint-{NAN_STEP - 1}")
    with open(os.path.join(checkpoint, "trainer_state.json")) as handle:
        assert json.load(handle)["global_step"] == NAN_STEP - 1


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_then_resume_reproduces_the_uninterrupted_run(engine_run):
    assert engine_run.crashed.returncode != 0
    assert "Signal 9 (SIGKILL)" in engine_run.crashed.stderr, engine_run.crashed.stderr[-3000:]
    resumed = engine_run.phase("resume")
    # What the killed run left: the checkpoint before, and the half-written one out of resume's way.
    assert resumed[0]["found"] == {"checkpoints": [SAVE_STEPS], "staged": [f"checkpoint-{KILL_STEP}"]}
    reference = logs_by_step(engine_run.phase("reference")[0]["log_history"])
    for rank in resumed:
        logs = logs_by_step(rank["log_history"])
        compared = [step for step in reference if step > SAVE_STEPS]
        assert compared == list(range(SAVE_STEPS + 1, MAX_STEPS + 1))
        for step in compared:
            for key in COMPARED:
                assert logs[step].get(key) == reference[step].get(key), (step, key)
    run_dir = os.path.join(engine_run.output_dir, "run")
    assert complete_checkpoints(run_dir) == [SAVE_STEPS, KILL_STEP, MAX_STEPS]
    assert not os.path.exists(os.path.join(run_dir, STAGING_DIR))


@pytest.mark.slow
def test_lora_adapters_train_and_save(engine_run):
    from safetensors.torch import load_file

    ranks = engine_run.phase("lora")
    for rank in ranks:
        before, after = rank["before"], rank["after"]
        lora = [name for name in before if ".lora_" in name]
        assert lora and all(before[name].shape == after[name].shape for name in before)
        assert all(torch.equal(before[name], after[name]) for name in before if name not in lora)  # base frozen
        assert all(not torch.equal(before[name], after[name]) for name in lora if ".lora_B." in name)
        assert_same_weights(after, ranks[0]["after"])  # one model, whoever gathered it
    saved = load_file(os.path.join(engine_run.output_dir, "lora", "adapter", "adapter_model.safetensors"))
    # PEFT saves the adapter without its name ("default"), whole: the tensors trained, gathered from the shards.
    after = ranks[0]["after"]
    trained = {name.replace(".default", ""): tensor for name, tensor in after.items() if ".lora_" in name}
    assert saved.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.slow
def test_held_out_evaluation_on_sharded_weights_gives_the_numbers_of_one_process(
    engine_run, tiny_model_path, tmp_path
):
    # `during`: at the run's one step, the weights sharded by the engine (learning rate 0: those of the start).
    assert_heldout_is_that_of_one_process(
        engine_run.phase("heldout"), heldout_in_one_process(tiny_model_path, tmp_path)
    )


@pytest.mark.slow
def test_the_recipe_evaluates_held_out_prompts(engine_run):
    results = [rank["held_out"] for rank in engine_run.phase("recipe")]
    assert results[0] == results[1]  # every process sampled its share of the prompts; all got the pooled result
    names = {"heldout/exact_match/mean@1", "heldout/exact_match/pass@1"}
    assert set(results[0]["before"]) == set(results[0]["after"]) == names
    assert all(0.0 <= value <= 1.0 for value in results[0]["before"].values())
    with open(os.path.join(engine_run.output_dir, "recipe", "README.md")) as handle:
        assert "held-out exact_match/mean@1 (after)" in handle.read()
