"""The GRPO recipe script (open-r1 style): `python recipes/grpo.py --config <config.yaml> [--field value ...]`.

    python recipes/grpo.py --config recipes/tiny/config_demo.yaml
    accelerate launch --config_file recipes/accelerate_configs/ddp.yaml recipes/grpo.py --config <config.yaml>

The recipe itself ships in the package, as `trl_grpo_ext.recipes.grpo`, behind `trl-grpo-ext grpo`; this file is its
entry point in a clone of the repository.
"""

import sys

from trl_grpo_ext.recipes.grpo import run

if __name__ == "__main__":
    sys.exit(run())
