"""The offline demo, from any folder: `trl-grpo-ext demo [--field value ...]`.

A 0.5M-parameter model, partly taught to reverse strings of letters a-j (`"abc=" -> "cba"`), improves by GRPO with
a LoRA adapter and an exact-match reward, on the CPU, with no network. The model, its tokenizer, the data and the
config ship inside the package (`trl_grpo_ext/tools/recipes/tiny/`); the output goes to `./runs/tiny-demo` unless
`--output_dir` says otherwise; a folder that holds an earlier run is kept, and the run goes to the first free
`./runs/tiny-demo-2`, `-3`, ... instead (`--resume_from_checkpoint true` continues the earlier run). Every field
of `trl-grpo-ext grpo` is a flag here too (`--max_steps 50`, `--eval_samples 0`, ...). Without TensorBoard (a plain
`pip install trl-grpo-ext`, without the `recipes` extra) it runs without TensorBoard logs, saying so once, and
without `report.png` when matplotlib is missing too.
"""

from __future__ import annotations

import os
import sys

from . import grpo

__all__ = ["DEMO_DIR", "DEMO_MODEL", "DESCRIPTION", "demo_defaults", "run"]

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")
#: The demo's base model (and tokenizer): a 0.5M-parameter Qwen2 that reverses strings of letters a-j in part.
DEMO_MODEL = os.path.join(DEMO_DIR, "base_model")
DESCRIPTION = "The offline demo: GRPO on a tiny shipped model (CPU, no network, ~2 min) into ./runs/tiny-demo."


def demo_defaults() -> dict:
    """The shipped demo config, with its model and data paths pointing at the copies installed with the package (in
    the file they are relative to the repository root)."""
    import yaml

    with open(os.path.join(DEMO_DIR, "config_demo.yaml")) as handle:
        config = yaml.safe_load(handle)
    config["model_name_or_path"] = DEMO_MODEL
    config["dataset_name"] = os.path.join(DEMO_DIR, "data")
    return config


def run(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the demo with `argv` (default: the command line), whose flags override the demo config; the exit status."""
    return grpo.run(
        argv,
        prog,
        optional_tensorboard=True,  # a plain `pip install trl-grpo-ext` has no TensorBoard: run without it
        new_folder_per_run=True,  # a second demo writes to runs/tiny-demo-2, not over the first one's run
        description=DESCRIPTION,
        usage="%(prog)s [--field value ...]",
        defaults=demo_defaults(),
    )


if __name__ == "__main__":
    sys.exit(run())
