# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-grpo-ext",
#     "torch",
#     "datasets",
#     "transformers",
# ]
#
# [tool.uv.sources]
# trl-grpo-ext = { path = "..", editable = true }
# ///
"""The smallest complete GRPO run with trl_grpo_ext: a tiny local model learns to answer 'aaa' and stop.

    python recipes/quickstart.py [--steps 20] [--output_dir runs/quickstart]

Runs on a laptop CPU in well under a minute, with no network: the model and tokenizer are built locally.
Copy it as a starting point; `recipes/grpo.py` is the full recipe script. The inline metadata above (PEP 723) lists
what it imports, for `uv run recipes/quickstart.py`; `[tool.uv.sources]` takes this package from the clone the
script is in; `uv run $(python3 tools/torch_build.py uv-run) recipes/quickstart.py` takes torch's CPU build where no
NVIDIA driver is found.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402
from trl_grpo_ext.testing import save_tiny  # noqa: E402

ANSWER = "aaa"


def letter_a_reward(completions: list[str], **kwargs) -> list[float]:
    """One point per letter 'a' up to three, one point off per other character: 'aaa' scores best, so the
    answers get short and end well within max_completion_length."""
    rewards = []
    for completion in completions:
        points = min(completion.count("a"), len(ANSWER))
        rewards.append(points - (len(completion) - points))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output_dir", default="runs/quickstart")
    cli = parser.parse_args()
    torch.set_num_threads(1)  # fastest for a model this small

    # A small alphabet: the untrained model ends a completion (samples its end-of-sequence token) within a few tokens
    # often enough, where with 50 tokens most completions would be cut at max_completion_length before it learns to.
    model_path = save_tiny(os.path.join(cli.output_dir, "base_model"), alphabet="abcd=", hidden_size=64)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_dict({"prompt": ["ab=", "cd=", "ba=", "dc="] * 64})

    args = GRPOConfigExt(
        output_dir=cli.output_dir,
        max_steps=cli.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions
        num_generations=8,
        max_completion_length=16,  # 'aaa' and the end-of-sequence token, with room for the untrained model's answers
        learning_rate=3e-3,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        activation_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainerExt(
        model=model_path,
        reward_funcs=letter_a_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print(f"mean reward per logging window: {' -> '.join(f'{r:.2f}' for r in rewards)}")


if __name__ == "__main__":
    main()
