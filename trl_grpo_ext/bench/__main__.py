"""`python -m trl_grpo_ext.bench {e2e,kernel,comm,all} [--json PATH]`: benchmarks that print a table and write JSON.

Every comparison runs its sides alternately in one invocation, with pinned CPU threads, and reports medians with
min/max. See each module's docstring for what it measures.
"""

from __future__ import annotations

import argparse

from .common import pin_threads, write_json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_grpo_ext.bench", description=__doc__)
    parser.add_argument("suite", choices=["e2e", "kernel", "comm", "all"])
    parser.add_argument("--json", default=None, help="where to write the results (default: bench-<suite>.json)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 was fastest for small models)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every comparison")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds: checks that it runs")
    parser.add_argument("--e2e-steps", type=int, default=22, help="training steps per end-to-end run")
    parser.add_argument("--e2e-modes", default="full,lora", help="comma-separated: full, lora")
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    results = {}
    tables = []
    if args.suite in ("e2e", "all"):
        from . import e2e

        steps, warmup, batch = (3, 1, 16) if args.quick else (args.e2e_steps, 2, 64)
        results["e2e"] = e2e.run(
            repeats=1 if args.quick else args.repeats,
            steps=steps,
            warmup=warmup,
            batch=batch,
            threads=args.threads,
            modes=tuple(args.e2e_modes.split(",")),
            hidden_size=32 if args.quick else 128,
        )
        tables.append(
            "End-to-end, per training step (time / trl: target <= 1.02 on CPU, <= 1.00 on GPU)\n"
            + e2e.table(results["e2e"])
        )
    for table in tables:
        print(table, end="\n\n")
    write_json(args.json or f"bench-{args.suite}.json", results)


if __name__ == "__main__":
    main()
