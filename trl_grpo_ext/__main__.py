"""`python -m trl_grpo_ext <command>`: the `trl-grpo-ext` command."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
