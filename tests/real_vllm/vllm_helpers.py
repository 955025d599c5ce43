"""Helpers of the real-vLLM tests (importable as `vllm_helpers`: pytest puts tests/real_vllm/ on sys.path)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEMO_MODEL = os.path.join(REPO, "trl_grpo_ext", "recipes", "tiny", "base_model")
DEMO_TRAIN = os.path.join(REPO, "trl_grpo_ext", "recipes", "tiny", "data", "train.jsonl")
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def reversal_reward(completions, solution, **kwargs) -> list[float]:
    """1 for the reversed string, plus 0.1 per letter in place: completions of one prompt score differently."""
    return [
        float(completion == answer) + 0.1 * sum(a == b for a, b in zip(completion, answer, strict=False))
        for completion, answer in zip(completions, solution, strict=True)
    ]


def vllm_args(output_dir, **overrides) -> dict:
    """Keyword arguments of a few-step colocate run on the demo model (16 prompts x 4 completions)."""
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=10,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
    )
    args.update(overrides)
    return args


def training_logs(log_history) -> list[dict]:
    return [entry for entry in log_history if "loss" in entry]


def run_script(script: str, *args, unset=(), timeout: int = 900) -> subprocess.CompletedProcess:
    """A script of this folder in its own process (its own engine), with the test environment less `unset`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    for name in unset:
        env.pop(name, None)
    # TRL's colocate mode sets these in this process for the shared engine's process group: a child that inherited
    # them would take itself for a rank of that group and wait on its port.
    for name in DISTRIBUTED_VARIABLES:
        env.pop(name, None)
    command = [sys.executable, os.path.join(HERE, script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def read_jsonl(path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
