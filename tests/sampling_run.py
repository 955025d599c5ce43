"""Dynamic sampling and row skipping in two processes, for tests/test_sampling_distributed.py.

    accelerate launch --config_file recipes/accelerate_configs/cpu_<engine>.yaml tests/sampling_run.py \
        <output_dir> <model_path> --phases dynamic,skip-whole,skip,disagree

Each phase trains a fresh trainer in the same processes and saves, per process, `<output_dir>/<phase>/rank<k>.pt`:

- `dynamic`: dynamic sampling with groups that span both processes (3 rows per process and step, groups of 4) and a
  reward constant on a third of the prompts: the log history, every batch that trains (this process's rows, decoded),
  and the micro-batches the loss saw.
- `skip-whole`, `skip`: beta=0 and a reward constant on every completion of rank 1 (whose groups are its own), without
  and with `skip_zero_advantage_rows`: rank 1 then leaves every row out; the log histories and forward row counts.
- `disagree`: rank 1's keep/drop decisions differ from rank 0's: the error each process raised (must be last).
"""

import argparse
import os
import sys

from trl_grpo_ext.testing import enable_sharded_engines_on_cpu

ENGINE = enable_sharded_engines_on_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402
from trl_grpo_ext.sampling import dynamic as sampling_module  # noqa: E402

CONSTANT_PROMPTS = ("xyz=", "qq=")
RANK = int(os.environ.get("RANK", "0"))


def reward_constant_on_some_prompts(prompts, completions, **kwargs):
    return [
        1.0 if prompt in CONSTANT_PROMPTS else completion.count("a") + 0.1 * len(completion)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


def reward_constant_on_rank_1(completions, **kwargs):
    """Each process scores its own completions: rank 1's all get the same reward."""
    return [1.0 if RANK == 1 else completion.count("a") + 0.1 * len(completion) for completion in completions]


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

    def _compute_loss(self, model, inputs):
        self.records["micro_batches"] += 1
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if torch.is_grad_enabled():
            self.records["forward_rows"].append(input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


def train(output_dir, model_path, reward, **overrides) -> dict:
    prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "kite")] * 8
    config = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        gradient_accumulation_steps=2,
        num_iterations=2,
        report_to="none",
        use_cpu=ENGINE != "deepspeed",
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    config.update(overrides)
    trainer = RecordingTrainer(
        model=model_path,
        reward_funcs=reward,
        args=GRPOConfigExt(**config),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.records = {"batches": [], "micro_batches": 0, "forward_rows": []}
    error = None
    try:
        trainer.train()
    except RuntimeError as raised:
        error = str(raised)
    engine = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "processes": trainer.accelerator.num_processes,
    }
    return {"log_history": trainer.state.log_history, "error": error, "engine": engine, **trainer.records}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("model_path")
    parser.add_argument("--phases", default="dynamic")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    for phase in cli.phases.split(","):
        output_dir = os.path.join(cli.output_dir, phase)
        dynamic = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=6, per_device_train_batch_size=3, beta=0.0)
        if phase == "dynamic":
            result = train(output_dir, cli.model_path, reward_constant_on_some_prompts, **dynamic)
        elif phase in ("skip-whole", "skip"):
            result = train(
                output_dir,
                cli.model_path,
                reward_constant_on_rank_1,
                beta=0.0,
                loss_type="dapo",
                skip_zero_advantage_rows=phase == "skip",
            )
        elif phase == "disagree":
            original = sampling_module.informative_groups

            def disagreeing(rewards, num_generations, original=original):
                flags = original(rewards, num_generations)
                return ~flags if RANK == 1 else flags

            sampling_module.informative_groups = disagreeing
            try:
                result = train(output_dir, cli.model_path, reward_constant_on_some_prompts, **dynamic)
            finally:
                sampling_module.informative_groups = original
        else:
            raise ValueError(f"unknown phase {phase!r}")
        os.makedirs(output_dir, exist_ok=True)
        torch.save(result, os.path.join(output_dir, f"rank{RANK}.pt"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
