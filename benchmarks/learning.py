"""Learning against training time on a task: held-out exact match as training goes, per side and seed.

Every side trains the shipped demo (`trl_grpo_ext/tools/recipes/tiny`: the warmed-up 0.5M-parameter model, a LoRA
adapter, 16 prompts x 8 completions per step, `num_iterations=2`, the demo config's sampling and learning rate) for the
same number of steps, each run in its own process, one after the other (sides rotating from seed to seed). Every
`eval_every` steps a callback samples one completion for each of the first `eval_samples` test prompts (with a fixed
seed, the training RNG restored afterwards) and scores exact match; the clocks stop while it does, so the times are
training time only. Two clocks: the process's CPU time (one thread: the wall time of the same run on an idle core,
whatever else the machine runs) and the wall time. Reported per side, over the seeds: the final held-out exact
match, the training time, the time at which each seed first reached the target (stock TRL's mean final exact match),
the median step time, and the logged zero-spread fraction, dynamic-sampling rounds and share of rows skipped.

Sides: stock `trl.GRPOTrainer` with DeepSeekMath's GRPO objective (`loss_type="grpo"`, `beta=0.04`,
`use_bias_correction_kl=False`), `GRPOTrainerExt` with its defaults (the same objective), with `dynamic_sampling`
(extra rounds sized to what a batch lacks; `ext_dynamic_full`: every extra round a whole generation batch, as before
that sizing), with `selective_rollouts`, with both, and with `beta=0` plus `skip_zero_advantage_rows`. Then `beta=0`
without and with skipping trains shorter runs without evaluation (`skip_steps`), timed per step in two parts: TRL's
generation and scoring, and the rest (the training forward and backward, which skipping shortens, and the optimizer):
the step time of skipping at the measured zero-spread fraction.

`ext_padded` (`GRPOTrainerExt` with TRL's padded log-prob forward: `padding_free=False`, `shared_prompt_forward=False`)
separates what the package's forward saves from what the sampling options save.

Two tasks (`task`): the demo's shipped data, and the spread task (`spread.py`: reversal of 1-9 letters, whose prompts
are easy, learnable or out of reach for the demo model, the way a math set's are for a given model), built in memory.
Every run records, per group generated in training, its step, its prompt and whether its rewards were all equal
(with the reward function wrapped, under the reward's own name): `spread.flatness_statistics` makes of them the
zero-spread share over training and the probability that a prompt flat at one visit is flat at the next.

Two data sides: the whole shipped training set (20,000 prompts: 400 steps visit each prompt once at most, so
selective rollouts only see the prompts that dynamic sampling's stream and TRL's sampler both drew), and the
multi-epoch side (`epoch_prompts`, 1,000 prompts: each is visited about 3 times by TRL's sampler in 400 steps; the
spread task's runs were measured on 500: about 6 visits). Every run also counts the completions generated (every
call of TRL's generation, extra rounds included) and those trained.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from .common import format_table, pin_threads
from .spread import flatness_statistics, make_spread_splits

#: The tasks a learning run trains on: the shipped demo data, or the spread task (`spread.py`), built in memory.
TASKS = {
    "demo": "the demo's shipped data: reversal of 3-6 letters (`trl_grpo_ext/tools/recipes/tiny/data`)",
    "spread": "reversal of 1-9 letters: easy, learnable and out-of-reach prompts for the demo model (`spread.py`)",
}
#: Rows of the spread task's splits (a run trains on the first `train_prompts` of the training split).
SPREAD_TRAIN, SPREAD_TEST = 5000, 1000

SIDES = {
    "trl": "stock trl.GRPOTrainer(loss_type='grpo', beta=0.04, use_bias_correction_kl=False)",
    "ext": "GRPOTrainerExt, GRPOConfigExt defaults (beta=0.04)",
    "ext_padded": "GRPOTrainerExt, padding_free=False, shared_prompt_forward=False (TRL's padded forward)",
    "ext_dynamic_full": "GRPOTrainerExt, dynamic_sampling=True, every extra round a whole generation batch",
    "ext_dynamic": "GRPOTrainerExt, dynamic_sampling=True",
    "ext_selective": "GRPOTrainerExt, selective_rollouts=True",
    "ext_selective_dynamic": "GRPOTrainerExt, selective_rollouts=True, dynamic_sampling=True",
    "ext_beta0_skip": "GRPOTrainerExt, beta=0, skip_zero_advantage_rows=True",
    "ext_beta0": "GRPOTrainerExt, beta=0",
}
LEARNING_SIDES = ("trl", "ext", "ext_dynamic_full", "ext_dynamic", "ext_selective_dynamic")
EPOCH_SIDES = ("trl", "ext", "ext_dynamic", "ext_selective", "ext_selective_dynamic")
OPTIONS = {
    "trl": {},
    "ext": {},
    "ext_padded": {"padding_free": False, "shared_prompt_forward": False},
    # A margin of a whole generation batch's groups (16): every extra round is a whole generation batch.
    "ext_dynamic_full": {"dynamic_sampling": True, "dynamic_sampling_round_margin": 16.0},
    "ext_dynamic": {"dynamic_sampling": True},
    "ext_selective": {"selective_rollouts": True},
    "ext_selective_dynamic": {"selective_rollouts": True, "dynamic_sampling": True},
    "ext_beta0": {"beta": 0.0},
    "ext_beta0_skip": {"beta": 0.0, "skip_zero_advantage_rows": True},
}
LOGGED = (
    "frac_reward_zero_std",
    "dynamic_sampling/frac_reward_zero_std_generated",
    "dynamic_sampling/rounds",
    "skipped_rows/fraction",
    "selective_rollouts/skipped_prompts",
    "selective_rollouts/precision",
    "selective_rollouts/zero_spread",
    "selective_rollouts/exploration_probability",
)


def train_and_evaluate(
    side: str,
    seed: int,
    steps: int,
    eval_every: int,
    eval_samples: int,
    threads: int,
    train_prompts: int | None = None,
    task: str = "demo",
) -> dict:
    """One run of `side` on `task` (a key of `TASKS`): held-out exact match every `eval_every` steps against training
    seconds, step times, the completions generated and trained, and the flatness of its groups
    (`spread.flatness_statistics`); on the first `train_prompts` training prompts (default: all of them)."""
    import math
    from dataclasses import fields

    from datasets import Dataset, DatasetDict
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
    from trl_grpo_ext.extras.generation import SamplingSettings
    from trl_grpo_ext.tools.recipes.data import load_recipe_dataset
    from trl_grpo_ext.tools.recipes.demo import demo_defaults
    from trl_grpo_ext.tools.recipes.rewards import exact_match

    from .reversal import sampled_reward_means

    pin_threads(threads)
    demo = demo_defaults()
    names = {field.name for field in fields(GRPOConfig) if field.init}
    config = {key: value for key, value in demo.items() if key in names}
    config.update(
        output_dir=tempfile.mkdtemp(prefix="bench-learning-"),
        max_steps=steps,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=min(10, steps),
    )
    if side == "trl":
        trainer_class = GRPOTrainer
        args = GRPOConfig(**config, loss_type="grpo", use_bias_correction_kl=False)  # beta, epsilon: the demo's
    else:
        trainer_class, args = GRPOTrainerExt, GRPOConfigExt(**{**config, **OPTIONS[side]})
    if task == "spread":
        train_rows, test_rows = make_spread_splits(SPREAD_TRAIN, SPREAD_TEST)
        dataset = DatasetDict({"train": Dataset.from_list(train_rows), "test": Dataset.from_list(test_rows)})
    else:
        dataset = load_recipe_dataset(demo["dataset_name"])
    train_set = dataset["train"] if train_prompts is None else dataset["train"].select(range(train_prompts))
    eval_rows = dataset["test"].select(range(eval_samples)).to_list() if eval_samples else []
    model_path = demo["model_name_or_path"]
    lora = LoraConfig(
        r=demo["lora_r"],
        lora_alpha=demo["lora_alpha"],
        lora_dropout=demo["lora_dropout"],
        target_modules=demo["lora_target_modules"],
    )
    curve: list[tuple[int, float, float, float]] = []  # (step, training CPU s, training wall s, exact match)
    step_times: list[float] = []  # CPU seconds
    generation_times: list[float] = []  # CPU seconds of each step spent in TRL's generation and scoring

    class Clock(TrainerCallback):
        """Training time only: held-out evaluations stop the clocks."""

        cpu = wall = 0.0

        def start(self) -> None:
            self.cpu_started, self.wall_started = time.process_time(), time.perf_counter()

        def stop(self) -> None:
            self.cpu += time.process_time() - self.cpu_started
            self.wall += time.perf_counter() - self.wall_started

        def evaluate(self, step: int, model) -> None:
            if not eval_samples:
                return
            score = sampled_reward_means(
                model,
                trainer.processing_class,
                eval_rows,
                [exact_match],
                SamplingSettings.from_config(args),
                seed=1234,  # the same held-out sample at every point and for every side
            )["exact_match"]
            curve.append((step, self.cpu, self.wall, score))

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.evaluate(0, model)
            self.start()

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_started = time.process_time()
            self.generating = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_times.append(time.process_time() - self.step_started)
            generation_times.append(self.generating)
            if eval_samples and (state.global_step % eval_every == 0 or state.global_step == steps):
                self.stop()
                self.evaluate(state.global_step, model)
                self.start()

        def on_train_end(self, args, state, control, **kwargs):
            if not eval_samples:
                self.stop()

    clock = Clock()
    visits: list[tuple[int, str, float]] = []  # per group generated in training: (step, prompt, flat reward or NaN)

    def recorded_exact_match(prompts, completions, **kwargs):  # exact_match, every group's flatness recorded
        rewards = exact_match(completions=completions, **kwargs)
        if trainer.model.training:
            size = args.num_generations
            for start in range(0, len(rewards), size):
                group = rewards[start : start + size]
                flat = group[0] if len(set(group)) == 1 else math.nan
                visits.append((trainer.state.global_step, prompts[start], flat))
        return rewards

    recorded_exact_match.__name__ = "exact_match"  # the logged reward's name, as without the recording
    completions = {"generated": 0, "trained": 0}
    stock_generation = GRPOTrainer._generate_and_score_completions

    def counted_generation(self, inputs):  # TRL's own: every round of every side (this process runs one trainer)
        if self.model.training:
            completions["generated"] += len(inputs)
        return stock_generation(self, inputs)

    GRPOTrainer._generate_and_score_completions = counted_generation  # before the trainer binds it
    trainer = trainer_class(
        model=model_path,
        reward_funcs=recorded_exact_match,
        args=args,
        train_dataset=train_set,
        processing_class=AutoTokenizer.from_pretrained(model_path, padding_side="left"),
        peft_config=lora,
        callbacks=[clock],
    )
    generate = trainer._generate_and_score_completions

    def timed_generation(inputs):  # generation, rewards, old and reference log-probs (with dynamic sampling: rounds)
        started = time.process_time()
        try:
            return generate(inputs)
        finally:
            clock.generating += time.process_time() - started
            if trainer.model.training:
                completions["trained"] += len(inputs)

    trainer._generate_and_score_completions = timed_generation

    try:
        trainer.train()
    finally:
        shutil.rmtree(config["output_dir"], ignore_errors=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    logged = {
        name: statistics.mean(entry[name] for entry in logs if name in entry)
        for name in LOGGED
        if any(name in entry for entry in logs)
    }
    return {
        "side": side,
        "seed": seed,
        "curve": curve,
        "training_cpu_s": clock.cpu,
        "training_wall_s": clock.wall,
        "step_times": step_times,
        "generation_times": generation_times,
        "logged": logged,
        "generated_completions": completions["generated"],
        "trained_completions": completions["trained"],
        "train_prompts": len(train_set),
        "task": task,
        "flatness": flatness_statistics(visits, steps),
    }


def _worker(queue, *arguments) -> None:
    queue.put(train_and_evaluate(*arguments))


def _run_one(
    context,
    side: str,
    seed: int,
    steps: int,
    eval_every: int,
    eval_samples: int,
    threads: int,
    prompts=None,
    task: str = "demo",
) -> dict:
    queue = context.Queue()
    arguments = (queue, side, seed, steps, eval_every, eval_samples, threads, prompts, task)
    process = context.Process(target=_worker, args=arguments)
    process.start()
    result = queue.get()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the benchmark process of {side} (seed {seed}) failed ({process.exitcode})")
    return result


def _rotations(sides: tuple[str, ...], index: int) -> tuple[str, ...]:
    """`sides` rotated by `index` places: no side always first (the machine's speed drifts)."""
    shift = index % len(sides) if sides else 0
    return sides[shift:] + sides[:shift]


def _learning_runs(
    context, seeds, sides, steps, eval_every, eval_samples, threads, prompts=None, task="demo"
) -> list[dict]:
    runs = []
    for index, seed in enumerate(seeds):
        for side in _rotations(sides, index):
            result = _run_one(context, side, seed, steps, eval_every, eval_samples, threads, prompts, task)
            runs.append(result)
            step, cpu, wall, score = result["curve"][-1]
            where = f"{result['train_prompts']} prompts"
            print(
                f"  {side} seed {seed} ({where}): exact match {score:.3f} after {step} steps, {cpu:.0f} CPU s "
                f"({wall:.0f} s), {result['generated_completions']} completions generated",
                flush=True,
            )
    return runs


def run(
    seeds: tuple[int, ...] = (0, 1, 2),
    steps: int = 400,
    eval_every: int = 25,
    eval_samples: int = 300,
    threads: int = 1,
    sides: tuple[str, ...] = LEARNING_SIDES,
    skip_steps: int = 60,
    epoch_sides: tuple[str, ...] = (),
    epoch_prompts: int = 1000,
    task: str = "demo",
) -> dict:
    """Every side for every seed, one process at a time, then the multi-epoch sides (`epoch_sides` on the first
    `epoch_prompts` training prompts), then `skip_step_times`, all on `task` (a key of `TASKS`); what `--json`
    writes."""
    import multiprocessing

    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; expected one of {sorted(TASKS)}.")
    context = multiprocessing.get_context("spawn")
    runs = _learning_runs(context, seeds, sides, steps, eval_every, eval_samples, threads, task=task)
    epoch_runs = []
    if epoch_sides and epoch_prompts:
        epoch_runs = _learning_runs(
            context, seeds, epoch_sides, steps, eval_every, eval_samples, threads, prompts=epoch_prompts, task=task
        )
    skip = []
    if skip_steps:
        for index, seed in enumerate(seeds):
            for side in _rotations(("ext_beta0", "ext_beta0_skip"), index):
                skip.append(_run_one(context, side, seed, skip_steps, skip_steps, 0, threads, task=task))
    config = dict(
        task=task,
        seeds=list(seeds),
        steps=steps,
        eval_every=eval_every,
        eval_samples=eval_samples,
        threads=threads,
        skip_steps=skip_steps,
        epoch_prompts=epoch_prompts if epoch_runs else None,
    )
    results = {
        "config": config,
        "sides": {side: SIDES[side] for side in (*sides, *epoch_sides, "ext_beta0")},
        "runs": runs,
        "skip_runs": skip,
        **(summary(runs, sides) if runs else {}),
        "skip_step_times": skip_summary(skip),
    }
    if epoch_runs:
        results["epoch_runs"] = epoch_runs
        results["epochs"] = summary(epoch_runs, epoch_sides)
    return results


def _time_to(curve, target: float) -> float | None:
    """Training CPU seconds at the first evaluation whose exact match reaches `target` (None if none does)."""
    return next((cpu for _, cpu, _, score in curve if score >= target), None)


def _logged(side_runs: list[dict]) -> dict[str, float]:
    return {
        name: statistics.mean(run["logged"][name] for run in side_runs)
        for name in LOGGED
        if all(name in run["logged"] for run in side_runs)
    }


def summary(runs: list[dict], sides) -> dict:
    """Per side: final exact match, training time, time to the target, step time, logged fractions."""
    by_side = {side: [run for run in runs if run["side"] == side] for side in sides}
    reference = by_side.get("trl") or by_side[sides[0]]
    target = statistics.mean(run["curve"][-1][3] for run in reference)
    reference_time = statistics.mean(run["training_cpu_s"] for run in reference)
    reference_generated = [run["generated_completions"] for run in reference if "generated_completions" in run]
    rows = {}
    for side, side_runs in by_side.items():
        reached = [_time_to(run["curve"], target) for run in side_runs]
        times = [seconds for seconds in reached if seconds is not None]
        generated = [run["generated_completions"] for run in side_runs if "generated_completions" in run]
        trained = [run["trained_completions"] for run in side_runs if "trained_completions" in run]
        trl_time = statistics.mean(run["training_cpu_s"] for run in side_runs) / reference_time
        rows[side] = {
            "training_cpu_vs_trl": trl_time,
            "generated_completions": generated,
            "generated_vs_trl": (
                statistics.mean(generated) / statistics.mean(reference_generated)
                if generated and reference_generated
                else None
            ),
            "generated_per_trained": sum(generated) / sum(trained) if generated and trained else None,
            "final_exact_match": [run["curve"][-1][3] for run in side_runs],
            "training_cpu_s": [run["training_cpu_s"] for run in side_runs],
            "training_wall_s": [run["training_wall_s"] for run in side_runs],
            "time_to_target_cpu_s": reached,
            "time_to_target_vs_trl_training": statistics.mean(times) / reference_time if times else None,
            "step_time_median_cpu_s": statistics.median(t for run in side_runs for t in run["step_times"]),
            "logged": _logged(side_runs),
            "flatness": _flatness(side_runs),
        }
    return {"target_exact_match": target, "trl_training_cpu_s": reference_time, "summary": rows}


def _flatness(side_runs: list[dict]) -> dict:
    """The seeds' mean of each number of `spread.flatness_statistics` (runs from before it was recorded: none)."""
    records = [run["flatness"] for run in side_runs if "flatness" in run]
    if not records:
        return {}

    def mean(values):
        values = [value for value in values if value is not None]
        return statistics.mean(values) if values else None

    means = {key: mean(record[key] for record in records) for key in records[0] if key != "zero_spread_by_part"}
    parts = zip(*(record["zero_spread_by_part"] for record in records), strict=True)
    return {**means, "zero_spread_by_part": [mean(part) for part in parts]}


def flatness_table(results: dict) -> str:
    """Per side: the share of generated groups without reward spread over training, and how predictable it was."""
    headers = [
        "side",
        "groups",
        "zero-spread (all wrong, all right)",
        "zero-spread by quarter of training",
        "flat after flat",
        "flat after spread",
        "revisited",
    ]

    def number(value) -> str:
        return f"{value:.2f}" if value is not None else "-"

    rows = []
    for side, row in results["summary"].items():
        flat = row.get("flatness")
        if not flat:
            continue
        rows.append(
            [
                side,
                f"{flat['groups']:.0f}",
                f"{number(flat['zero_spread'])} ({number(flat['all_wrong'])}, {number(flat['all_right'])})",
                ", ".join(number(value) for value in flat["zero_spread_by_part"]),
                number(flat["flat_after_flat"]),
                number(flat["flat_after_spread"]),
                number(flat["revisited"]),
            ]
        )
    return format_table(headers, rows)


def skip_summary(runs: list[dict]) -> dict:
    """Mean step time (CPU s) of `beta=0` without and with skipping, split into TRL's generation and scoring and the
    rest (the training forward and backward, the optimizer), and what skipping left out."""
    rows = {}
    for side in ("ext_beta0", "ext_beta0_skip"):
        side_runs = [run for run in runs if run["side"] == side]
        if side_runs:
            steps = [t for run in side_runs for t in run["step_times"]]
            generation = [t for run in side_runs for t in run["generation_times"]]
            rows[side] = {
                "step_time_mean_cpu_s": statistics.mean(steps),
                "generation_mean_cpu_s": statistics.mean(generation),
                "rest_mean_cpu_s": statistics.mean(steps) - statistics.mean(generation),
                "logged": _logged(side_runs),
            }
    return rows


def _zero_std(logged: dict) -> str:
    """The zero-spread fraction of what was generated (with dynamic sampling, of every round; then that of the
    batches that trained in parentheses)."""
    generated = logged.get("dynamic_sampling/frac_reward_zero_std_generated")
    trained = logged.get("frac_reward_zero_std")
    if generated is not None:
        return f"{generated:.2f} ({trained:.2f})"
    return f"{trained:.2f}" if trained is not None else "-"


def table(results: dict) -> str:
    def spread(values, digits):
        return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"

    headers = [
        "side",
        "final exact match",
        "training CPU s (/ trl)",
        f"CPU s to {results['target_exact_match']:.3f} (seeds)",
        "/ trl training",
        "step CPU s",
        "completions generated (/ trl)",
        "generated / trained",
        "zero-std generated (trained)",
        "rounds",
        "skipped",
    ]
    rows = []
    for side, row in results["summary"].items():
        reached = [seconds for seconds in row["time_to_target_cpu_s"] if seconds is not None]
        ratio = row["time_to_target_vs_trl_training"]
        logged = row["logged"]
        generated = row.get("generated_completions") or []
        against = row.get("generated_vs_trl")
        per_trained = row.get("generated_per_trained")
        training = spread(row["training_cpu_s"], 0)
        if "training_cpu_vs_trl" in row:
            training += f" ({row['training_cpu_vs_trl']:.2f})"
        rows.append(
            [
                side,
                spread(row["final_exact_match"], 3),
                training,
                (spread(reached, 0) if reached else "-") + f" ({len(reached)}/{len(row['time_to_target_cpu_s'])})",
                f"{ratio:.2f}" if ratio is not None else "-",
                f"{row['step_time_median_cpu_s']:.3f}",
                (f"{statistics.mean(generated):.0f}" if generated else "-")
                + (f" ({against:.2f})" if against is not None else ""),
                f"{per_trained:.2f}" if per_trained is not None else "-",
                _zero_std(logged),
                _value(logged, "dynamic_sampling/rounds"),
                _skipped(logged),
            ]
        )
    return format_table(headers, rows)


def curve_table(runs: list[dict], sides, every: int) -> str:
    """Per side: held-out exact match and training CPU seconds at every `every` steps (the evaluations at those
    steps), mean of the seeds."""
    headers, rows = ["side", "exact match", "CPU s"], []
    for side in sides:
        side_runs = [run for run in runs if run["side"] == side]
        if not side_runs:
            continue
        steps = [step for step, *_ in side_runs[0]["curve"] if step % every == 0]
        at = [[point for point in run["curve"] if point[0] in steps] for run in side_runs]
        scores = [statistics.mean(points[i][3] for points in at) for i in range(len(steps))]
        seconds = [statistics.mean(points[i][1] for points in at) for i in range(len(steps))]
        rows.append(
            [side, " / ".join(f"{score:.3f}" for score in scores), " / ".join(f"{cpu:.0f}" for cpu in seconds)]
        )
    return format_table(headers, rows)


def time_split_table(runs: list[dict], sides) -> str:
    """Per side: training CPU seconds (against the first side's), and their part in TRL's generation and scoring (the
    old and reference log-probs included) against the rest (the training forward and backward, the optimizer), mean
    of the seeds."""
    totals = {}
    for side in sides:
        side_runs = [run for run in runs if run["side"] == side]
        if side_runs:
            training = statistics.mean(run["training_cpu_s"] for run in side_runs)
            generation = statistics.mean(sum(run["generation_times"]) for run in side_runs)
            totals[side] = (training, generation)
    first = next(iter(totals.values()))[0]
    rows = [
        [side, f"{training:.0f} ({training / first:.2f})", f"{generation:.1f}", f"{training - generation:.1f}"]
        for side, (training, generation) in totals.items()
    ]
    headers = ["side", f"training CPU s (/ {next(iter(totals))})", "generation and scoring", "the rest"]
    return format_table(headers, rows)


def rounds_table(results: dict) -> str:
    """Per side: completions generated, generated per trained, extra generation rounds per generation batch and
    training CPU seconds (mean [min, max] of the seeds)."""
    rows = []
    for side, row in results["summary"].items():
        seconds = row["training_cpu_s"]
        rows.append(
            [
                side,
                f"{statistics.mean(row['generated_completions']):.0f}",
                f"{row['generated_per_trained']:.2f}",
                _value(row["logged"], "dynamic_sampling/rounds"),
                f"{statistics.mean(seconds):.0f} [{min(seconds):.0f}, {max(seconds):.0f}]",
            ]
        )
    headers = ["side", "completions generated", "generated / trained", "rounds per generation batch", "training CPU s"]
    return format_table(headers, rows)


def _skipped(logged: dict) -> str:
    """Rows skipped (`skip_zero_advantage_rows`) and prompts skipped per generation batch (`selective_rollouts`)."""
    parts = []
    if "skipped_rows/fraction" in logged:
        parts.append(f"{logged['skipped_rows/fraction']:.2f} of rows")
    if "selective_rollouts/skipped_prompts" in logged:
        text = f"{logged['selective_rollouts/skipped_prompts']:.1f} prompts"
        if "selective_rollouts/precision" in logged:
            text += f" (precision {logged['selective_rollouts/precision']:.2f})"
        parts.append(text)
    return ", ".join(parts) or "-"


def skip_table(skip: dict) -> str:
    """`beta=0` without and with `skip_zero_advantage_rows`: mean step time and its two parts."""
    without = skip["ext_beta0"]
    rows = []

    def against(row: dict, key: str) -> str:
        return f"{row[key]:.3f} ({row[key] / without[key]:.2f})"

    for name, row in (("without skipping", without), ("skip_zero_advantage_rows", skip["ext_beta0_skip"])):
        rows.append(
            [
                name,
                against(row, "step_time_mean_cpu_s"),
                f"{row['generation_mean_cpu_s']:.3f}",
                against(row, "rest_mean_cpu_s"),
                _value(row["logged"], "frac_reward_zero_std"),
                _value(row["logged"], "skipped_rows/fraction"),
            ]
        )
    headers = ["beta=0", "step CPU s (/ without)", "generation", "training (/ without)", "zero-std", "skipped"]
    return format_table(headers, rows)


def _value(logged: dict, name: str) -> str:
    return f"{logged[name]:.2f}" if name in logged else "-"


if __name__ == "__main__":  # a quick look: python -m benchmarks.learning
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quick = run(seeds=(0,), steps=12, eval_every=6, eval_samples=32, skip_steps=6, epoch_sides=EPOCH_SIDES)
    print(table(quick) + "\n\n" + table(quick["epochs"]) + "\n\n" + skip_table(quick["skip_step_times"]))
