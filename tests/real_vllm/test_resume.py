"""Kill and resume with vLLM generating: the resumed run samples and trains exactly as the killed one did."""

import os
import signal

import pytest
from vllm_helpers import read_jsonl, run_script

# Present at every step; those of TRL's sampler and the package's mismatch are logged at the steps that generate.
EVERY_STEP = ("loss", "grad_norm", "kl", "entropy", "ratio/mean", "clip_ratio/region_mean")
GENERATING = (
    "reward",
    "completions/mean_length",
    "sampling/sampling_logp_difference/mean",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio_raw/mean",
    "sampling/sampler_k3_kl",
)


def step_logs(path) -> dict[int, dict]:
    return {entry["step"]: entry for entry in read_jsonl(path) if "loss" in entry}


def complete_checkpoints(output_dir) -> list[int]:
    names = [name for name in os.listdir(output_dir) if name.startswith("checkpoint-")]
    return sorted(int(name.split("-")[1]) for name in names if name.split("-")[1].isdigit())


@pytest.mark.slow
def test_a_run_killed_while_checkpointing_resumes_with_the_same_samples_and_updates(tmp_path):
    output_dir = tmp_path / "run"
    killed = run_script("resume_run.py", output_dir, "--kill_during_save_of", 6)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    before = step_logs(output_dir / "logs.jsonl")
    assert sorted(before) == [1, 2, 3, 4, 5, 6]
    assert complete_checkpoints(output_dir) == [3]  # the half-written checkpoint-6 is out of resume's way

    resumed = run_script("resume_run.py", output_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    after = step_logs(output_dir / "logs.jsonl")  # the killed run's entries, then the resumed run's
    entries = [entry for entry in read_jsonl(output_dir / "logs.jsonl") if "loss" in entry]
    resumed_steps = [entry["step"] for entry in entries[len(before) :]]
    assert resumed_steps == [4, 5, 6]  # from checkpoint-3: step 4 trains on the batch generated before the kill
    assert all(key in before[step] for step in (4, 5, 6) for key in EVERY_STEP)
    assert all(key in before[5] for key in GENERATING)  # step 5 generated again after the resume
    for step in (4, 5, 6):
        assert after[step].keys() == before[step].keys(), step
        for key, value in before[step].items():
            if "time" not in key and "per_second" not in key:
                assert after[step][key] == value, (step, key)
    assert complete_checkpoints(output_dir) == [3, 6]
