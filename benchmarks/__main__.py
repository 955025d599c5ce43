"""`python -m benchmarks {e2e,kernel,comm,forward,learning,truncation,truncation-cost,health,all} [--json PATH]`:
benchmarks that print tables and write JSON.

Every comparison runs its sides alternately in one invocation, with pinned CPU threads, and reports medians with
min/max. See each module's docstring for what it measures. `learning` (held-out exact match against training time
on the demo task, several seeds per side; tens of minutes on one thread) is not part of `all`, nor is `truncation`
(vLLM's importance-sampling ratio under truncated sampling, on a real engine: run it from the vLLM environment,
`.venv-vllm/bin/python -m benchmarks truncation`; a few minutes), nor is `truncation-cost` (that match's cost at
Qwen's vocabulary against TRL's log-prob forward; about 10 minutes on one thread), nor is `health` (the peers' scenario
corpus judged by `report`'s rules and by the peers that are installed: a scenario x tool table, seconds).

`demo` runs the README's main command, `make demo` (the demo recipe), and records its wall time, held-out scores and
alarms (about 2 minutes; not part of `all`).

`python -m benchmarks gpu [--out DIR] ...`: the prepared check on a GPU (see `gpu.py`; its own options).

`python -m benchmarks tables [--check]`: the documents' marked tables rewritten from `benchmarks/results/*.json` (see
`tables.py`).
"""

from __future__ import annotations

import argparse
import sys

from .common import environment, pin_threads, write_json
from .truncation import DEFAULT_SETTINGS as DEFAULT_TRUNCATION_SETTINGS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        from .gpu import main as gpu_main

        sys.exit(gpu_main(argv[1:]))
    if argv[:1] == ["tables"]:
        from .tables import main as tables_main

        sys.exit(tables_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    suites = ["e2e", "kernel", "comm", "forward", "learning", "truncation", "truncation-cost", "health", "demo", "all"]
    suites += ["gpu", "tables"]
    parser.add_argument("suite", choices=suites)
    parser.add_argument("--json", default=None, help="where to write the results (default: bench-<suite>.json)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 was fastest for small models)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each end-to-end comparison")
    parser.add_argument("--kernel-repeats", type=int, default=30, help="interleaved repeats of each kernel timing")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds: checks that it runs")
    parser.add_argument("--forward-steps", type=int, default=3, help="timed steps per side (forward)")
    parser.add_argument("--forward-groups", type=int, default=2, help="groups of 8 completions per micro-batch")
    parser.add_argument(
        "--attention",
        default="sdpa",
        choices=["sdpa", "eager", "flash_attention_2", "flash-emulated"],
        help="forward: the attention implementation (flash-emulated: flash-attention's path on a CPU, exact kernels)",
    )
    parser.add_argument("--e2e-steps", type=int, default=16, help="training steps per end-to-end run")
    parser.add_argument("--e2e-modes", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--learning-steps", type=int, default=400, help="training steps per learning run (the demo's)")
    parser.add_argument("--learning-seeds", type=int, default=3, help="seeds per side of the learning benchmark")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations (learning)")
    parser.add_argument("--eval-samples", type=int, default=300, help="held-out prompts per evaluation (learning)")
    parser.add_argument(
        "--learning-sides",
        default="trl,ext,ext_dynamic_full,ext_dynamic,ext_selective_dynamic",
        help="comma-separated sides of the learning runs on the whole training set (empty: none)",
    )
    parser.add_argument(
        "--epoch-sides",
        default="trl,ext,ext_dynamic,ext_selective,ext_selective_dynamic",
        help="comma-separated sides of the multi-epoch learning runs (empty: none)",
    )
    parser.add_argument(
        "--epoch-prompts", type=int, default=1000, help="training prompts of the multi-epoch learning runs"
    )
    parser.add_argument(
        "--task",
        default="demo",
        choices=["demo", "spread"],
        help="learning: the demo's data, or the spread task (benchmarks/spread.py: easy, learnable, out-of-reach)",
    )
    parser.add_argument("--skip-steps", type=int, default=100, help="steps of each skipping step-time run (0: none)")
    parser.add_argument(
        "--truncation-settings",
        default=DEFAULT_TRUNCATION_SETTINGS,
        help="sampling settings of the truncation benchmark, ';' between them, ',' inside one (top_p, top_k, min_p)",
    )
    parser.add_argument("--truncation-sides", default="trl,ext", help="comma-separated: trl, ext (truncation)")
    parser.add_argument("--truncation-steps", type=int, default=8, help="training steps per setting (truncation)")
    parser.add_argument(
        "--truncation-mode", default="sequence_mask", help="vllm_importance_sampling_mode (truncation; TRL's default)"
    )
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    results = {"environment": environment(), "command": " ".join(["python -m benchmarks", *argv])}
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
        title = "End-to-end, per training step (targets: time / trl <= 1.02 on CPU, <= 1.00 on GPU; memory <= 1.00)"
        tables.append(title + "\n" + e2e.table(results["e2e"]))

    if args.suite in ("kernel", "all"):
        import torch

        from . import kernel

        results["kernel"] = kernel.run(
            shapes=((8, 64),) if args.quick else ((64, 1024), (64, 4096)),
            dtypes=(torch.float32,) if args.quick else (torch.float32, torch.bfloat16),
            repeats=3 if args.quick else args.kernel_repeats,
            warmup=1 if args.quick else 3,
        )
        title = "Loss kernel, forward + backward (targets at 64x4096 fp32: >= 4x seed000, extra memory <= 2 buffers)"
        tables.append(title + "\n" + kernel.table(results["kernel"]))

    if args.suite in ("comm", "all"):
        from . import comm

        results["comm"] = comm.run(batch_sizes=(8,) if args.quick else comm.BATCH_SIZES)
        tables.append("Collectives added by metrics\n" + comm.table(results["comm"]))

    if args.suite in ("forward", "all"):
        from . import forward

        results["forward"] = forward.run(
            steps=1 if args.quick else args.forward_steps,
            groups=args.forward_groups,
            quick=args.quick,
            attn_implementation=args.attention,
        )
        shape = results["forward"]["shape"]
        title = (
            f"Log-prob forwards of a step (reference + policy with backward), {shape['rows']} rows of up to "
            f"{shape['width']} tokens (goals: time / trl <= 0.5, memory / trl <= 0.6)"
        )
        tables.append(title + "\n" + forward.table(results["forward"]))

    if args.suite == "learning":
        from . import learning

        results["learning"] = learning.run(
            seeds=tuple(range(1 if args.quick else args.learning_seeds)),
            steps=4 if args.quick else args.learning_steps,
            eval_every=2 if args.quick else args.eval_every,
            eval_samples=16 if args.quick else args.eval_samples,
            threads=args.threads,
            sides=tuple(side for side in args.learning_sides.split(",") if side),
            skip_steps=2 if args.quick else args.skip_steps,
            epoch_sides=tuple(side for side in args.epoch_sides.split(",") if side),
            epoch_prompts=32 if args.quick else args.epoch_prompts,
            task=args.task,
        )
        goals = (
            "goals: ext_selective_dynamic reaches stock TRL's final exact match in <= 0.6 of stock's training time, "
            "ext in <= 1.02"
        )
        if results["learning"]["runs"]:
            title = (
                f"Held-out exact match against training time on the {args.task} task, the whole training set (CPU "
                f"seconds of one thread; {goals})"
            )
            tables.append(title + "\n" + learning.table(results["learning"]))
        if "epochs" in results["learning"]:
            prompts = results["learning"]["config"]["epoch_prompts"]
            title = f"The same on the first {prompts} training prompts (multi-epoch; {goals})"
            tables.append(title + "\n" + learning.table(results["learning"]["epochs"]))
            title = (
                "Groups without reward spread over the multi-epoch runs, and how well one visit of a prompt predicts "
                "the next (mean over the seeds)"
            )
            tables.append(title + "\n" + learning.flatness_table(results["learning"]["epochs"]))
        if len(results["learning"]["skip_step_times"]) == 2:
            title = (
                f"Step time with skip_zero_advantage_rows against without (beta=0, the {args.task} task; CPU seconds, "
                "mean)"
            )
            tables.append(title + "\n" + learning.skip_table(results["learning"]["skip_step_times"]))

    if args.suite == "truncation":
        from . import truncation

        results["truncation"] = truncation.run(
            settings=truncation.parse_settings(args.truncation_settings),
            sides=tuple(side for side in args.truncation_sides.split(",") if side),
            steps=2 if args.quick else args.truncation_steps,
            mode=args.truncation_mode,
        )
        title = (
            "vLLM's importance-sampling ratio with the correction on, per sampling setting (demo model, real engine; "
            "median over the steps, min-max)"
        )
        tables.append(title + "\n" + truncation.table(results["truncation"]))

    if args.suite == "truncation-cost":
        from . import truncation

        results["truncation_cost"] = truncation.run_cost(repeats=1 if args.quick else 3, quick=args.quick)
        cost = results["truncation_cost"]
        title = (
            f"match_sampler_truncation's cost at a {cost['model']['vocab_size']:,}-token vocabulary against TRL's "
            f"log-prob forward ({cost['forward_s']['median']:.2f} s), top_p={cost['top_p']}"
        )
        tables.append(title + "\n" + truncation.cost_table(cost))

    if args.suite == "health":
        from . import health_scenarios

        results["health"] = health_scenarios.run()
        title = (
            "The peers' scenarios as TRL log histories: what each tool flags (its kinds; @ the first step where it "
            "gives one; - nothing)"
        )
        tables.append(title + "\n" + health_scenarios.table(results["health"]))

    if args.suite == "demo":
        from . import demo

        results["demo"] = demo.run(quick=args.quick)
        tables.append("The demo recipe, as `make demo` runs it\n" + demo.table(results["demo"]))

    for table in tables:
        print(table, end="\n\n")
    path = args.json or f"bench-{args.suite}.json"
    write_json(path, results)
    print(f"Results written to {path}")


if __name__ == "__main__":
    main()
