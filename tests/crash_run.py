"""A small GRPOTrainerExt run in its own process, for the crash and resume tests (tests/test_reliability.py).

    python tests/crash_run.py <output_dir> <model_path> [--lora] [--resume] [--max_steps N] [--save_steps N]
        [--kill_during_save_of STEP] [--dynamic_sampling]

Writes `<output_dir>/log_history.json` when training ends. `--kill_during_save_of STEP` makes the process kill
itself (SIGKILL) halfway through writing the checkpoint of that step: after the model, before the optimizer.
`--dynamic_sampling` turns dynamic sampling on, with a reward that is constant for a third of the prompts.
"""

import argparse
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402


def reward(completions, **kwargs):
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


def reward_constant_on_some_prompts(prompts, completions, **kwargs):
    return [
        1.0 if prompt in ("xyz=", "qq=") else value for prompt, value in zip(prompts, reward(completions), strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("model_path")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--num_iterations", type=int, default=2)
    parser.add_argument("--kill_during_save_of", type=int, default=None)
    parser.add_argument("--dynamic_sampling", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(1)

    args = GRPOConfigExt(
        output_dir=cli.output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=5e-2 if cli.lora else 1e-2,
        max_steps=cli.max_steps,
        num_iterations=cli.num_iterations,
        logging_steps=1,
        save_steps=cli.save_steps,
        report_to="none",
        use_cpu=True,
        seed=0,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dynamic_sampling=cli.dynamic_sampling,
    )
    trainer = GRPOTrainerExt(
        model=cli.model_path,
        reward_funcs=reward_constant_on_some_prompts if cli.dynamic_sampling else reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq=", "kite=", "zz="] * 20}),
        processing_class=AutoTokenizer.from_pretrained(cli.model_path),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if cli.lora else None,
    )
    if cli.kill_during_save_of is not None:
        original = trainer._save_optimizer_and_scheduler

        def save_then_die(output_dir):
            if trainer.state.global_step == cli.kill_during_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(output_dir)

        trainer._save_optimizer_and_scheduler = save_then_die
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    with open(os.path.join(cli.output_dir, "log_history.json"), "w") as handle:
        json.dump(trainer.state.log_history, handle)


if __name__ == "__main__":
    main()
