"""A `GRPOTrainerExt` run generating with vLLM's CPU engine (colocate), for tests/real_vllm/test_resume.py.

    python tests/real_vllm/resume_run.py <output_dir> [--resume] [--kill_during_save_of STEP]

Appends each log entry to `<output_dir>/logs.jsonl` as it is logged, so that a killed run leaves its logs behind.
`--kill_during_save_of STEP` makes the process kill itself (SIGKILL) halfway through writing the checkpoint of that
step: after the model, before the optimizer. Each batch of completions trains two steps (`num_iterations=2`), and a
checkpoint every 3 steps falls between a generation and its second use.
"""

import argparse
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from transformers import TrainerCallback  # noqa: E402
from vllm_helpers import DEMO_MODEL, DEMO_TRAIN, reversal_reward, vllm_args  # noqa: E402


class StreamLogs(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(self.path, "a") as handle:
            handle.write(json.dumps({**logs, "step": state.global_step}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill_during_save_of", type=int, default=None)
    cli = parser.parse_args()

    import torch
    from cpu_engines import enable_vllm_on_cpu
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    enable_vllm_on_cpu()
    torch.set_num_threads(1)
    args = GRPOConfigExt(
        **vllm_args(cli.output_dir, max_steps=6, num_iterations=2, save_strategy="steps", save_steps=3)
    )
    trainer = GRPOTrainerExt(
        model=DEMO_MODEL,
        reward_funcs=reversal_reward,
        args=args,
        train_dataset=load_dataset("json", data_files=DEMO_TRAIN, split="train").select(range(256)),
        processing_class=AutoTokenizer.from_pretrained(DEMO_MODEL),
        callbacks=[StreamLogs(os.path.join(cli.output_dir, "logs.jsonl"))],
    )
    if cli.kill_during_save_of is not None:
        original = trainer._save_optimizer_and_scheduler

        def save_then_die(output_dir):
            if trainer.state.global_step == cli.kill_during_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(output_dir)

        trainer._save_optimizer_and_scheduler = save_then_die
    trainer.train(resume_from_checkpoint=True if cli.resume else None)


if __name__ == "__main__":
    main()
