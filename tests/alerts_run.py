"""Two GRPOTrainerExt steps on the tiny model that raise alarms, reporting to one logger, in a process of its own
(tests/test_report_alerts.py).

    python tests/alerts_run.py <output_dir> <model_path> <report_to>

A process of its own because trackio fixes its local store (`TRACKIO_DIR`) when it is first imported, and W&B keeps
one run per process. The environment chooses each logger's offline store. Completions of one token are all truncated
(alarm `truncation`) and the constant reward leaves no spread inside any group (alarm `zero_std`).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import constant_reward, tiny_grpo_args  # noqa: E402  (this script's folder is on sys.path)
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402


def main() -> None:
    output_dir, model_path, report_to = sys.argv[1:4]
    torch.set_num_threads(1)
    args = GRPOConfigExt(
        **tiny_grpo_args(
            output_dir,
            max_steps=2,
            max_completion_length=1,
            report_to=[report_to],
            project="grpo-alerts",
            run_name="run-1",
            trackio_space_id=None,  # trackio's local store only
        )
    )
    trainer = GRPOTrainerExt(
        model=model_path,
        reward_funcs=constant_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="] * 4}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    print("ALARMS", sorted(episode.name for episode in trainer.callback_handler.callbacks[0].episodes))


if __name__ == "__main__":
    main()
