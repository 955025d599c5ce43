"""Selective rollouts and dynamic sampling's smaller rounds in their own processes, for
tests/test_sampling_selective.py and tests/test_sampling_dynamic_sizing.py.

    python tests/selective_run.py <output_dir> <model_path> --phase resume [--save_steps N]
        [--kill_during_save_of STEP] [--resume]
    accelerate launch --config_file recipes/accelerate_configs/cpu_ddp.yaml tests/selective_run.py \
        <output_dir> <model_path> --phase spanning,whole

Phases (each trains a fresh trainer and saves, per process, `<output_dir>/<phase>/rank<k>.pt`, and
`<output_dir>/<phase>/log_history.json` from process 0):

- `resume`: selective rollouts and dynamic sampling over several epochs of 12 prompts (2 of 6 texts get a constant
  reward), one process; with `--kill_during_save_of STEP` the process kills itself (SIGKILL) halfway through writing
  that checkpoint, with `--resume` it resumes from the last complete one.
- `resume-dynamic`: `resume` with dynamic sampling alone.
- `spanning`: two processes, 3 rows each per step and groups of 4 (a group spans both processes), selective rollouts
  with dynamic sampling.
- `whole`: two processes, 8 rows each per step (whole groups per process), dynamic sampling alone.
- `spanning-dynamic`: the layout of `spanning`, dynamic sampling alone.
- `disagree`: `spanning` where rank 1 never skips: the error each process raised (must be last).

Saved per process: the log history, the rows each of TRL's generation calls got (`stock_rows`), the prompts each
round was decided for (`rounds`, with selective rollouts), every batch that trains (this process's rows, decoded,
and advantages), and the engine accelerate ran.
"""

import argparse
import json
import os
import signal
import sys

from trl_grpo_ext.testing import enable_sharded_engines_on_cpu

ENGINE = enable_sharded_engines_on_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402
from trl_grpo_ext.sampling.selective import SelectiveRollouts  # noqa: E402

CONSTANT_PROMPTS = ("xyz=", "qq=")
TEXTS = ("abc=", "hello=", "xyz=", "qq=", "kite=", "zz=")
RANK = int(os.environ.get("RANK", "0"))


def reward_constant_on_some_prompts(prompts, completions, **kwargs):
    return [
        1.0 if prompt in CONSTANT_PROMPTS else completion.count("a") + 0.1 * len(completion)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


def record_calls() -> None:
    """Record, in the current trainer's `records`, the rows of every call of TRL's generation and the prompts of
    every round selective rollouts decided."""
    stock = trl.GRPOTrainer._generate_and_score_completions

    def counted(self, inputs):
        if self.model.training:
            self.records["stock_rows"].append(len(inputs))
        return stock(self, inputs)

    trl.GRPOTrainer._generate_and_score_completions = counted
    observe = SelectiveRollouts.observe

    def observed(self, selection, informative):
        self.trainer.records["rounds"].append({"prompts": list(selection.prompts), "flags": informative.tolist()})
        return observe(self, selection, informative)

    SelectiveRollouts.observe = observed


class RecordingTrainer(GRPOTrainerExt):
    records: dict

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            tokenizer = self.processing_class
            self.records["batches"].append(
                {
                    "prompts": tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True),
                    "completions": tokenizer.batch_decode(output["completion_ids"], skip_special_tokens=True),
                    "advantages": output["advantages"].cpu(),
                }
            )
        return output


PHASES = {
    "resume": dict(
        per_device_train_batch_size=16,
        max_steps=12,
        selective_rollouts=True,
        dynamic_sampling=True,
        selective_rollouts_exploration=0.3,
        selective_rollouts_exploration_step=0.1,
        selective_rollouts_target_zero_spread=0.1,
    ),
    "resume-dynamic": dict(per_device_train_batch_size=16, max_steps=12, dynamic_sampling=True),
    "spanning": dict(
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=8,
        selective_rollouts=True,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=6,
        selective_rollouts_exploration=0.3,
    ),
    "spanning-dynamic": dict(
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=8,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=6,
    ),
    "whole": dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=8,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=6,
    ),
}


def train(phase: str, output_dir: str, model_path: str, cli) -> dict:
    config = dict(
        output_dir=output_dir,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        logging_steps=1,
        num_iterations=2,
        beta=0.0,
        report_to="none",
        use_cpu=ENGINE != "deepspeed",
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        disable_tqdm=True,
    )
    config.update(PHASES["spanning" if phase == "disagree" else phase])
    trainer = RecordingTrainer(
        model=model_path,
        reward_funcs=reward_constant_on_some_prompts,
        args=GRPOConfigExt(**config),
        train_dataset=Dataset.from_dict({"prompt": list(TEXTS) * 2}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.records = {"batches": [], "stock_rows": [], "rounds": []}
    if cli.kill_during_save_of is not None:
        original = trainer._save_optimizer_and_scheduler

        def save_then_die(folder):
            if trainer.state.global_step == cli.kill_during_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(folder)

        trainer._save_optimizer_and_scheduler = save_then_die
    if phase == "disagree" and RANK == 1:
        judge = trainer._selective._judge

        def never_skip(prompts):
            keep, flat = judge(prompts)
            return [True] * len(keep), flat

        trainer._selective._judge = never_skip
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if cli.resume else None)
    except RuntimeError as raised:
        if phase != "disagree":
            raise
        error = str(raised)
    engine = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "processes": trainer.accelerator.num_processes,
    }
    return {"log_history": trainer.state.log_history, "engine": engine, "error": error, **trainer.records}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("model_path")
    parser.add_argument("--phase", default="resume", help="comma-separated phases")
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--kill_during_save_of", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    record_calls()
    for phase in cli.phase.split(","):
        output_dir = os.path.join(cli.output_dir, phase)
        result = train(phase, output_dir, cli.model_path, cli)
        os.makedirs(output_dir, exist_ok=True)
        torch.save(result, os.path.join(output_dir, f"rank{RANK}.pt"))
        if RANK == 0:
            with open(os.path.join(output_dir, "log_history.json"), "w") as handle:
                json.dump(result["log_history"], handle)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
