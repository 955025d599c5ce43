"""Crash safety: kill -9 at random moments and during a checkpoint write, then resume exactly."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from helpers import count_a_reward, harness_command, launched_env, phase_results, run_alone, tiny_grpo_args

from trl_grpo_ext.checkpointing import (
    STAGING_DIR,
    Checkpoints,
    load_grpo_state,
    publish_checkpoint,
    save_grpo_state,
)

COMPARED = ("loss", "grad_norm", "reward", "kl", "clip_ratio/region_mean", "ratio/mean", "entropy")
# Random kill moments per mode; raise it to run more trials: KILL_TRIALS=20 pytest tests/test_checkpointing.py
KILL_TRIALS = int(os.environ.get("KILL_TRIALS", "3"))
PHASE = "checkpointed"  # tests/launched.py's run, in <output_dir>/checkpointed


def options(lora, *extra):
    return [*(["--lora"] if lora else []), *extra]


def run(output_dir, model_path, lora, *extra):
    return run_alone(output_dir, model_path, [PHASE], *options(lora, *extra))


def training_logs(output_dir):
    (saved,) = phase_results(output_dir, PHASE, num_processes=1)
    return {entry["step"]: entry for entry in saved["log_history"] if "loss" in entry}


def complete_checkpoints(output_dir):
    return sorted(
        int(name.split("-")[1])
        for name in os.listdir(output_dir)
        if name.startswith("checkpoint-") and name.split("-")[1].isdigit()
    )


@pytest.fixture(scope="module")
def references(tiny_model_path, tmp_path_factory):
    """Uninterrupted runs (full and LoRA) with the same seed."""
    logs = {}
    for lora in (False, True):
        output_dir = tmp_path_factory.mktemp("reference")
        result = run(output_dir, tiny_model_path, lora, "--save_steps", "100")
        assert result.returncode == 0, result.stderr[-3000:]
        logs[lora] = training_logs(output_dir)
    return logs


def assert_same_from(resumed, reference, first_step):
    steps = [step for step in reference if step > first_step]
    assert steps, "nothing left to compare"
    for step in steps:
        for key in COMPARED:
            if key in reference[step]:
                assert resumed[step][key] == reference[step][key], (step, key)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("seed", range(KILL_TRIALS))
def test_kill_at_a_random_moment_then_resume_reproduces_the_uninterrupted_run(
    seed, lora, references, tiny_model_path, tmp_path
):
    output_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, *harness_command(output_dir, tiny_model_path, [PHASE], *options(lora, "--save_steps", "2"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=launched_env(),
    )
    deadline = time.time() + 120
    while not (output_dir / PHASE / "checkpoint-2").is_dir():
        assert process.poll() is None and time.time() < deadline, "no first checkpoint"
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, 1.0))  # anywhere in the remaining steps, saves included
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed_from = complete_checkpoints(output_dir / PHASE)[-1]

    result = run(output_dir, tiny_model_path, lora, "--save_steps", "2", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_from(training_logs(output_dir), references[lora], resumed_from)


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_leaves_no_checkpoint_to_trip_on(references, tiny_model_path, tmp_path):
    output_dir = tmp_path / "run"
    # Save every 3 steps (checkpoint 3 falls between a generation and its reuse); die while writing checkpoint 6.
    killed = run(output_dir, tiny_model_path, False, "--save_steps", "3", "--kill_during_save_of", "6")
    assert killed.returncode == -signal.SIGKILL
    assert complete_checkpoints(output_dir / PHASE) == [3]
    assert (output_dir / PHASE / STAGING_DIR / "checkpoint-6").is_dir()  # the half-written one, out of resume's way

    result = run(output_dir, tiny_model_path, False, "--save_steps", "3", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_from(training_logs(output_dir), references[False], 3)
    assert complete_checkpoints(output_dir / PHASE) == [3, 6, 8]  # 8: Trainer's save at the end of training
    assert not (output_dir / PHASE / STAGING_DIR).exists()


def test_publish_replaces_an_older_checkpoint_of_the_same_name(tmp_path):
    final = tmp_path / "checkpoint-2"
    final.mkdir()
    (final / "old.txt").write_text("old")
    staged = tmp_path / STAGING_DIR / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "new.txt").write_text("new")
    publish_checkpoint(str(staged), str(final))
    assert sorted(os.listdir(final)) == ["new.txt"] and not staged.exists()
    assert sorted(os.listdir(tmp_path)) == [STAGING_DIR, "checkpoint-2"]


def test_grpo_state_round_trip(tmp_path):
    buffered = [{"completion_ids": torch.arange(6).view(2, 3), "advantages": torch.tensor([0.5, -0.5]), "n": 3}]
    save_grpo_state(str(tmp_path), 1, step=5, buffered_inputs=buffered)
    assert load_grpo_state(str(tmp_path), 0, "cpu") is None
    state = load_grpo_state(str(tmp_path), 1, "cpu")
    assert state["step"] == 5 and state["buffered_inputs"][0]["n"] == 3
    assert torch.equal(state["buffered_inputs"][0]["completion_ids"], buffered[0]["completion_ids"])


class DelayedHub:
    """Stands in for the Hub API: uploads run in the background after a delay, as over a slow network."""

    def __init__(self):
        self.uploads = []  # (path_in_repo, folder_path, files present when the upload read the folder)
        self.pool = ThreadPoolExecutor(max_workers=1)

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, folder_path, path_in_repo=None, run_as_future=False, **kwargs):
        def upload():
            time.sleep(0.3)
            files = None
            if os.path.isdir(folder_path):
                files = sorted(name for name in os.listdir(folder_path))
            self.uploads.append((path_in_repo, folder_path, files))

        future = self.pool.submit(upload)
        return future if run_as_future else future.result()


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_checkpoint_uploads_send_the_published_complete_folder(
    strategy, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    import transformers.trainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    hub = DelayedHub()
    if hasattr(transformers.trainer, "hf_api"):
        monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    else:  # transformers before the shared HfApi client called huggingface_hub's functions directly
        monkeypatch.setattr(transformers.trainer, "create_repo", hub.create_repo)
        monkeypatch.setattr(transformers.trainer, "upload_folder", hub.upload_folder)
    args = GRPOConfigExt(
        **tiny_grpo_args(
            tmp_path,
            save_strategy="steps",
            save_steps=2,
            push_to_hub=True,
            hub_model_id="someone/tiny-grpo",
            hub_strategy=strategy,
            hub_always_push=True,
        )
    )
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    hub.pool.shutdown(wait=True)
    checkpoint_uploads = [upload for upload in hub.uploads if upload[0] is not None]
    expected_names = ["last-checkpoint"] * 2 if strategy == "checkpoint" else ["checkpoint-2", "checkpoint-4"]
    assert [upload[0] for upload in checkpoint_uploads] == expected_names
    for (_, folder, files), step in zip(checkpoint_uploads, (2, 4), strict=True):
        assert folder == os.path.join(str(tmp_path), f"checkpoint-{step}")
        assert files is not None, f"{folder} was gone when the upload read it"
        for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "grpo_state_rank0.pt"):
            assert name in files
    assert not any(STAGING_DIR in folder for _, folder, _ in hub.uploads)


def test_the_best_checkpoint_is_recorded_under_its_final_name_and_survives_a_resume(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    def trainer(max_steps):
        config = tiny_grpo_args(
            tmp_path,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            save_total_limit=1,
            load_best_model_at_end=True,
            metric_for_best_model="eval_reward",
            per_device_eval_batch_size=4,
        )
        return GRPOTrainerExt(
            tiny_model_path,
            count_a_reward,
            GRPOConfigExt(**config),
            prompt_dataset,
            prompt_dataset.select(range(4)),
            processing_class=tiny_tokenizer,
        )

    first = trainer(4)
    first.train()
    for name in os.listdir(tmp_path):
        state_file = os.path.join(tmp_path, name, "trainer_state.json")
        if name.startswith("checkpoint-") and os.path.isfile(state_file):
            with open(state_file) as handle:
                best = json.load(handle)["best_model_checkpoint"]
            assert STAGING_DIR not in best and os.path.isdir(best), (name, best)
    best = first.state.best_model_checkpoint
    resumed = trainer(6)
    resumed.train(resume_from_checkpoint=True)
    # Rotation kept the best checkpoint because the resumed run knew where it was.
    assert resumed.state.best_model_checkpoint is not None and os.path.isdir(resumed.state.best_model_checkpoint)
    if best != os.path.join(str(tmp_path), "checkpoint-4"):
        assert os.path.isdir(best)


def process_on_a_node(run_dir, process_index, should_save, barrier):
    """The trainer of one of four processes, for `Checkpoints.staged_save`: its node's file system is `run_dir`."""
    buffered = [{"completion_ids": torch.full((2, 3), process_index), "advantages": torch.tensor([0.5, -0.5])}]
    accelerator = SimpleNamespace(
        process_index=process_index, is_local_main_process=process_index % 2 == 0, wait_for_everyone=barrier.wait
    )
    return SimpleNamespace(
        _get_output_dir=lambda trial: str(run_dir),
        state=SimpleNamespace(global_step=4, best_model_checkpoint=None),
        args=SimpleNamespace(should_save=should_save, save_total_limit=None, push_to_hub=False),
        accelerator=accelerator,
        _step=8,
        _buffered_inputs=buffered,
    )


def test_a_node_without_the_main_node_s_file_system_keeps_its_processes_states_in_its_checkpoint(tmp_path):
    """Two nodes of two processes, no shared storage: the main node publishes its checkpoint; the other node's
    processes put their buffered generations into the checkpoint folder of their node, not left in its staging
    folder, where a resume would not find them."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    barrier = threading.Barrier(4, timeout=60)

    def save(rank):
        trainer = process_on_a_node(nodes[rank // 2], rank, rank == 0, barrier)
        with Checkpoints(trainer).staged_save(trial=None):
            pass  # Trainer's own files: written by the saving process only

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save, range(4)))
    assert sorted(os.listdir(nodes[0] / "checkpoint-4")) == ["grpo_state_rank0.pt", "grpo_state_rank1.pt"]
    assert sorted(os.listdir(nodes[1])) == ["checkpoint-4"]  # no staging folder left behind
    for rank in (2, 3):
        state = load_grpo_state(str(nodes[1] / "checkpoint-4"), rank, "cpu")
        assert state["step"] == 8
        assert torch.equal(state["buffered_inputs"][0]["completion_ids"], torch.full((2, 3), rank))
