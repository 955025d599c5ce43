"""Two GRPOTrainerExt steps on the tiny model, reporting to one logger, in a process of their own (test_diagnostics).

    python tests/logger_run.py <output_dir> <model_path> <report_to>

A separate process because trackio fixes its local store (`TRACKIO_DIR`) when it is first imported (importing TRL's
GRPO trainer does), and W&B keeps a run per process. The environment chooses each logger's offline store.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import count_a_reward, tiny_grpo_args  # noqa: E402  (this script's folder is on sys.path)
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402


def main() -> None:
    output_dir, model_path, report_to = sys.argv[1:4]
    torch.set_num_threads(1)
    args = GRPOConfigExt(
        **tiny_grpo_args(
            output_dir,
            max_steps=2,
            num_iterations=2,
            report_to=[report_to],
            project="grpo-histograms",
            run_name="run-1",
            trackio_space_id=None,  # trackio's local store only (transformers 5.5.4 defaults to a Space)
        )
    )
    trainer = GRPOTrainerExt(
        model=model_path,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="] * 4}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()


if __name__ == "__main__":
    main()
