"""A tiny GRPOTrainerExt run for `accelerate launch --num_processes N`, used by tests/test_distributed.py.

Each process records what its loss saw (per micro-batch) and the gathered rewards, and counts the collective calls
made from trl_grpo_ext code; rank 0 also saves the log history. Everything lands in `<output_dir>/rank<k>.pt`.

    accelerate launch --cpu --num_processes 2 tests/distributed_run.py <output_dir> <model_path>
"""

import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import trl_grpo_ext  # noqa: E402
from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402
from trl_grpo_ext import trainer as trainer_module  # noqa: E402

PACKAGE_DIR = os.path.dirname(trl_grpo_ext.__file__)
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce", "gather", "scatter")
LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}")

collective_calls = {"ours": 0, "ours_in_loss": 0, "total": 0}
in_loss = [False]


def caller_is_ours() -> bool:
    """Whether the nearest frame outside torch/accelerate belongs to trl_grpo_ext."""
    for frame in traceback.extract_stack()[:-2][::-1]:
        if any(part in frame.filename for part in LIBRARY_PARTS) or frame.filename == __file__:
            continue
        return frame.filename.startswith(PACKAGE_DIR)
    return False


def count_collectives() -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            collective_calls["total"] += 1
            if caller_is_ours():
                collective_calls["ours"] += 1
                collective_calls["ours_in_loss"] += in_loss[0]
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def reward(completions, **kwargs):
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


def main(output_dir: str, model_path: str) -> None:
    torch.set_num_threads(1)
    count_collectives()
    records = {"steps": [], "rewards": [], "log_calls": 0}
    original_loss = trainer_module.grpo_loss

    def recording_loss(*args, **kwargs):
        out = original_loss(*args, **kwargs)
        records["steps"].append(
            {key: getattr(out, key) for key in ("ratio", "log_ratio", "per_token_kl", "mask", "advantages")}
            | {"policy_loss": out.policy_loss, "kl_penalty": out.kl_penalty}
        )
        return out

    trainer_module.grpo_loss = recording_loss

    class RecordingTrainer(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            in_loss[0] = True
            try:
                return super()._compute_loss(model, inputs)
            finally:
                in_loss[0] = False

        def _calculate_rewards(self, *args, **kwargs):
            rewards_per_func = super()._calculate_rewards(*args, **kwargs)
            records["rewards"].append(rewards_per_func.sum(dim=1))
            return rewards_per_func

        def log(self, logs, start_time=None):
            records["log_calls"] += "loss" in logs
            return super().log(logs, start_time)

    # Different prompts on each process: the sampler hands each rank its own slice of every batch.
    prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "bcd", "zz", "kite")] * 8
    args = GRPOConfigExt(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        report_to="none",
        use_cpu=True,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = RecordingTrainer(
        model=model_path,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "records": records,
            "collectives": collective_calls,
            "log_history": trainer.state.log_history,
            "num_processes": trainer.accelerator.num_processes,
        },
        os.path.join(output_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
