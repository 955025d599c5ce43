"""The offline demo from any folder, `trl-grpo-ext demo [--field value ...]`: GRPO on a tiny model shipped in the
package (`tiny/`), CPU, no network, into the first free `./runs/tiny-demo`, `-2`, ... (docs/recipes.md)."""

from __future__ import annotations

import os
import sys

from . import grpo

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")
#: The demo's base model (and tokenizer): a 0.5M-parameter Qwen2 that reverses strings of letters a-j in part.
DEMO_MODEL = os.path.join(DEMO_DIR, "base_model")
DESCRIPTION = "The offline demo: GRPO on a tiny shipped model (CPU, no network, ~2 min) into ./runs/tiny-demo."


def demo_defaults() -> dict:
    """The shipped demo config, its model and data paths those installed with the package."""
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
