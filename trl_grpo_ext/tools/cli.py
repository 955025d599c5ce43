"""The `trl-grpo-ext` command (also `python -m trl_grpo_ext`): `grpo`, `demo`, `report`, `slurm`, `env`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__

#: command -> (module of `trl_grpo_ext.tools` with a `run(argv, prog)` function, the line `--help` shows)
COMMANDS = {
    "grpo": ("recipes.grpo", "train with GRPO from a YAML config (--config) and flags; every config field is a flag"),
    "demo": (
        "recipes.demo",
        "the offline demo on a tiny shipped model (CPU, no network, ~2 minutes) into ./runs/tiny-demo",
    ),
    "report": (
        "report.command",
        "report.png and a health summary (one verdict per signal) of a GRPO run's folder: RUN_DIR",
    ),
    "slurm": (
        "recipes.slurm",
        "the recipe on N + 1 SLURM nodes: N train, the last serves vLLM (--dry-run prints the commands)",
    ),
    "env": ("env", "the versions of this package, TRL and its dependencies, and the machine, for bug reports"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-grpo-ext",
        description="GRPO recipes of trl_grpo_ext. `trl-grpo-ext <command> --help` lists a command's arguments.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, help_line) in COMMANDS.items():
        # Each command parses its own arguments (and `--help`).
        subparsers.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `trl-grpo-ext <command> [arguments]`; returns the exit status.

    With no command, prints the help (the commands) to stderr and returns 2, argparse's status for a usage error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv[:1])  # the command only: `-h` and unknown commands end here
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    module = importlib.import_module(f".{COMMANDS[args.command][0]}", package=__package__)
    return module.run(argv[1:], prog=f"trl-grpo-ext {args.command}")
