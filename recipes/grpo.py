# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "trl-grpo-ext[recipes,math]",
#     "trackio",
# ]
#
# [tool.uv.sources]
# trl-grpo-ext = { path = "..", editable = true }
# ///
"""The GRPO recipe script (open-r1 style): `python recipes/grpo.py --config <config.yaml> [--field value ...]`.

    python recipes/grpo.py --config recipes/tiny/config_demo.yaml
    accelerate launch --config_file recipes/accelerate_configs/ddp.yaml recipes/grpo.py --config <config.yaml>

The recipe itself ships in the package, as `trl_grpo_ext.tools.recipes.grpo`, behind `trl-grpo-ext grpo`; this file
is its entry point in a clone of the repository. The inline metadata above (PEP 723) names what it needs, so that
`uv run recipes/grpo.py --config ...` installs it on its own: this package with the `recipes` extra (TensorBoard,
matplotlib) and the `math` extra (TRL's math-verify rewards), and trackio for `report_to: trackio`. `[tool.uv.sources]`
takes this package from the clone the script is in (the folder above it), since it is not on PyPI yet. A header
cannot choose torch's build per machine: `uv run $(python3 tools/torch_build.py uv-run) recipes/grpo.py ...` takes the
CPU build where no NVIDIA driver is found (docs/compatibility.md, "Installing PyTorch").
"""

import sys

from trl_grpo_ext.tools.recipes.grpo import run

if __name__ == "__main__":
    sys.exit(run())
