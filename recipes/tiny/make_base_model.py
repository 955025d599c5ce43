"""Build the demo's base model and data: `python recipes/tiny/make_base_model.py` (about a minute on a CPU).

Writes, into the package's demo folder `trl_grpo_ext/tools/recipes/tiny/` (which `recipes/tiny/data` and
`recipes/tiny/base_model` link to) unless `--output` says otherwise:
- `data/train.jsonl`, `data/test.jsonl`: string-reversal prompts (`"abc="`) and solutions (`"cba"`), disjoint;
- `base_model/`: a 0.5M-parameter Qwen3-architecture model and its character tokenizer, taught the task by a
  supervised warm-up that stops once its sampled accuracy on a separate validation set reaches `--target`.

The shipped files were made by this script with its defaults. Shipping them keeps the demo's outcome
independent of how fast the warm-up happens to converge for a given seed.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout's benchmarks/

from benchmarks.reversal import ALPHABET, SEPARATOR, make_splits, sampled_accuracy, warm_up  # noqa: E402
from trl_grpo_ext.testing import build_char_tokenizer, build_tiny_model  # noqa: E402
from trl_grpo_ext.tools.recipes.demo import DEMO_DIR  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=DEMO_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.2, help="sampled accuracy at which the warm-up stops")
    parser.add_argument("--num_train", type=int, default=20000)
    parser.add_argument("--num_test", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)

    train_rows, held_out = make_splits(args.num_train, 2 * args.num_test, seed=args.seed)
    test_rows, validation_rows = held_out[: args.num_test], held_out[args.num_test :]
    os.makedirs(os.path.join(args.output, "data"), exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        with open(os.path.join(args.output, "data", f"{name}.jsonl"), "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)

    tokenizer = build_char_tokenizer(ALPHABET + SEPARATOR)
    model = build_tiny_model(
        tokenizer,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        seed=args.seed,
    )
    result = warm_up(model, tokenizer, train_rows, validation_rows, target_accuracy=args.target, seed=args.seed)
    result["test_accuracy"] = sampled_accuracy(model, tokenizer, test_rows, seed=args.seed)
    result.update(seed=args.seed, target=args.target, parameters=sum(p.numel() for p in model.parameters()))
    model_dir = os.path.join(args.output, "base_model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "warm_up.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
