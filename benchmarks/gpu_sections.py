"""The sections of `python -m benchmarks gpu` that train (see `gpu.py`; `kernels` is in `gpu_kernels.py`).

Every section takes a `Context`, the seconds it may plan for, and a dict `result` that it fills as it goes (and
returns): `checks` (name -> bool: correctness; a false one fails the run), `targets` (name -> `{"value", "limit",
"met"}`: performance goals, reported but not failing), `skipped` (part -> reason) and what it measured. Whatever
it filled before raising or running out of time is kept; `ctx.save()` writes it out between parts.
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import statistics
import subprocess
import time
import traceback

import torch

from .gpu_setup import STOCK_EQUIVALENT, Context, free_memory, loss_logs, make_trainer

__all__ = [
    "section_e2e",
    "section_environment",
    "section_equivalence",
    "section_nonfinite",
    "section_sharded",
    "section_syncs",
]


# --- 1. environment ---------------------------------------------------------------------------------------------

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "numpy",
    "pandas",
    "pyarrow",
    "dill",
    "multiprocess",
    "fsspec",
    "flash_attn",
)


def section_environment(ctx: Context, allotted: float, result: dict) -> dict:
    """Versions (and where each package was imported from), the device, its memory."""
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    import trl_grpo_ext.trainer  # noqa: F401 - the package and its trl import must load

    locations = {}
    for name in ("trl", "transformers", "peft", "datasets", "trl_grpo_ext"):
        locations[name] = os.path.dirname(importlib.import_module(name).__file__)
    from .gpu_packing import flash_kernels

    result.update(
        {
            "python": platform.python_version(),
            "packages": packages,
            "imported_from": locations,
            "flash_attention_2": flash_kernels(ctx.cuda),
            "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "cpu_count": os.cpu_count(),
            "device": ctx.device,
            "sizes": ctx.sizes.label,
            "checks": {"trl_is_1.16": (packages["trl"] or "").startswith("1.16.")},
            "targets": {},
            "skipped": {},
        }
    )
    if ctx.cuda:
        properties = torch.cuda.get_device_properties(0)
        result["gpu"] = {
            "name": properties.name,
            "total_memory_bytes": properties.total_memory,
            "multiprocessors": properties.multi_processor_count,
            "capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            result["gpu"]["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as error:
            result["gpu"]["nvidia_smi"] = f"not available: {error}"
    else:
        result["skipped"]["gpu"] = "no CUDA device"
    return result


# --- 2. equivalence with stock TRL ----------------------------------------------------------------------------

EQUIVALENCE_STEPS = 8
COMPARED = ("loss", "grad_norm", "kl")
REPORTED = ("reward", "entropy", "clip_ratio/region_mean", "completions/mean_length")
SAMPLED = ("reward", "completions/mean_length")  # logged by the steps that generate: equal iff the same completions
# A step passes when |ext - stock| <= atol + rtol * |stock| for each compared metric. float32 (CPU): rounding of the
# same formula in another order. bf16 autocast: the loss's gradient reaches the weights through bf16 matrix
# products, so one differently rounded element (2**-8 relative) can move later steps; rtol 2e-2 allows about five
# such roundings, and the floors cover values that are 0 up to rounding (an on-policy step's loss is -mean(A) = 0).
TOLERANCES = {
    "fp32": {"loss": (1e-5, 1e-6), "grad_norm": (1e-5, 1e-6), "kl": (1e-5, 1e-6)},
    "bf16": {"loss": (2e-2, 1e-3), "grad_norm": (2e-2, 0.0), "kl": (2e-2, 1e-4)},
}


def _compare(stock: list[dict], ours: list[dict], precision: str) -> dict:
    """Per step and metric: both values and whether they are within `TOLERANCES[precision]`.

    The runs are compared while they train on the same completions. A step that generates logs the rewards of the
    completions it sampled (a hash of their text); once those differ, the runs learn from different data and later
    steps say nothing about the loss. Both runs must log every step, and at least the first generation's steps
    (two, with num_iterations=2) must be compared.
    """
    steps, max_excess = [], {key: 0.0 for key in COMPARED}
    complete = len(stock) == len(ours) == EQUIVALENCE_STEPS
    within, diverged_at = True, None
    for step, (expected, got) in enumerate(zip(stock, ours, strict=False), start=1):
        if diverged_at is None and any(expected.get(key) != got.get(key) for key in SAMPLED):
            diverged_at = step
        row = {"step": step, "compared": diverged_at is None}
        for key in COMPARED:
            rtol, atol = TOLERANCES[precision][key]
            a, b = got.get(key), expected.get(key)
            finite = a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
            ok = finite and abs(a - b) <= atol + rtol * abs(b)
            if finite and row["compared"]:
                max_excess[key] = max(max_excess[key], abs(a - b) / (atol + rtol * abs(b)))
            if row["compared"]:
                within = within and ok
            row[key] = {"stock": b, "ext": a, "within": ok}
        for key in REPORTED:
            row[key] = {"stock": expected.get(key), "ext": got.get(key)}
        steps.append(row)
    compared = sum(row["compared"] for row in steps)
    return {
        "steps": steps,
        "logged_steps": {"stock": len(stock), "ext": len(ours)},
        "steps_compared": compared,
        # the first step whose sampled completions differ (None: the same at every step)
        "samples_diverged_at_step": diverged_at,
        "within_tolerance": complete and within and compared >= 2,
        # |difference| / allowed difference, worst compared step: <= 1 passes
        "worst_fraction_of_tolerance": max_excess,
    }


def section_equivalence(ctx: Context, allotted: float, result: dict) -> dict:
    """`GRPOTrainerExt` against stock TRL: 8 steps, num_iterations=2, gradient accumulation 2, full and LoRA."""
    precision = "bf16" if ctx.cuda else "fp32"
    begin = time.monotonic()
    result.update(
        {
            "precision": "bf16 autocast, float32 master weights" if ctx.cuda else "float32",
            "tolerance": {key: {"rtol": r, "atol": a} for key, (r, a) in TOLERANCES[precision].items()},
            "config": {
                "steps": EQUIVALENCE_STEPS,
                "num_iterations": 2,
                "gradient_accumulation_steps": 2,
                "per_device_train_batch_size": ctx.sizes.batch,
                "num_generations": ctx.sizes.num_generations,
                "max_completion_length": ctx.sizes.completion_length,
                "learning_rates": ctx.sizes.learning_rates,
                "lora": "r=16, alpha=32, all-linear",
                **STOCK_EQUIVALENT,
            },
            "modes": {},
            "errors": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    run_seconds = []

    def train(side: str, mode: str, tag: str) -> list[dict]:
        start = time.monotonic()
        ctx.log(f"equivalence: {mode}, {'stock trl' if side == 'trl' else 'GRPOTrainerExt'} {tag}")
        trainer = make_trainer(
            ctx,
            side,
            os.path.join(ctx.workdir, f"equivalence-{mode}-{side}{tag}"),
            lora=mode == "lora",
            max_steps=EQUIVALENCE_STEPS,
            num_iterations=2,
            gradient_accumulation_steps=2,
            # The objective against stock TRL's at a tolerance of 1e-5 over 8 steps: TRL's padded forward on both
            # sides, since packing changes the log-probs by rounding, which training compounds (its own equality
            # with the padded forward: tests/test_forward.py).
            **({} if side == "trl" else {"padding_free": False}),
        )
        trainer.train()
        logs = loss_logs(trainer)
        del trainer
        free_memory()
        run_seconds.append(time.monotonic() - start)
        ctx.estimates["train_step_s"] = statistics.median(run_seconds) / EQUIVALENCE_STEPS
        return logs

    for mode in ("full", "lora"):
        spent = time.monotonic() - begin
        if run_seconds and spent + 2 * max(run_seconds) > allotted:
            result["skipped"][mode] = f"time budget: {allotted - spent:.0f} s left of {allotted:.0f} s"
            continue
        try:
            stock, ours = train("trl", mode, ""), train("ext", mode, "")
        except Exception:  # noqa: BLE001 - recorded; the other mode still runs
            result["errors"][mode] = traceback.format_exc()
            result["checks"][f"{mode}_within_tolerance"] = False
            free_memory()
            continue
        result["modes"][mode] = _compare(stock, ours, precision)
        result["checks"][f"{mode}_within_tolerance"] = result["modes"][mode]["within_tolerance"]
        ctx.log(f"equivalence: {mode} within tolerance: {result['modes'][mode]['within_tolerance']}")
        ctx.save()
    # The noise floor: stock TRL against itself, same seed (GPU kernels need not be deterministic).
    spent = time.monotonic() - begin
    if ctx.cuda and "full" in result["modes"] and spent + max(run_seconds) <= allotted:
        again = train("trl", "full", "(again)")
        stock = [{key: step[key]["stock"] for key in COMPARED + REPORTED} for step in result["modes"]["full"]["steps"]]
        result["stock_against_itself_full"] = _compare(stock, again, precision)
    elif ctx.cuda:
        result["skipped"]["stock_against_itself_full"] = "time budget"
    else:
        result["skipped"]["stock_against_itself_full"] = "float32 on a CPU is deterministic"
    result["seconds_per_run"] = run_seconds
    return result


# --- 3. host synchronisations ----------------------------------------------------------------------------------

SYNC_STEPS, SYNC_ACCUMULATION = 3, 2


def section_syncs(ctx: Context, allotted: float, result: dict) -> dict:
    """Synchronisations per micro-batch and per log step, by owner, `GRPOTrainerExt` and stock TRL."""
    from .syncs import SyncCounter

    result.update(
        {
            "config": {
                "optimizer_steps": SYNC_STEPS,
                "gradient_accumulation_steps": SYNC_ACCUMULATION,
                "logging_steps": 1,
                "mode": "full",
            },
            "runs": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    for side in ("ext", "trl"):
        ctx.log(f"syncs: {'GRPOTrainerExt' if side == 'ext' else 'stock trl'}")
        trainer = make_trainer(
            ctx,
            side,
            os.path.join(ctx.workdir, f"syncs-{side}"),
            lora=False,
            max_steps=SYNC_STEPS,
            gradient_accumulation_steps=SYNC_ACCUMULATION,
            max_completion_length=min(32, ctx.sizes.completion_length),
        )
        with SyncCounter(ctx.device) as counter:
            trainer.train()
        micro_batches = trainer.state.global_step * SYNC_ACCUMULATION
        log_steps = len(loss_logs(trainer))
        run = counter.as_dict()
        run.update(micro_batches=micro_batches, log_steps=log_steps, optimizer_steps=trainer.state.global_step)
        for owner in ("trl_grpo_ext", "trl"):
            run[f"{owner}_per_micro_batch"] = {
                phase: counter.total(owner, phase) / micro_batches for phase in ("loss", "micro_batch")
            }
            run[f"{owner}_per_log_step"] = {
                phase: counter.total(owner, phase) / log_steps for phase in ("log", "generation", "optimizer_step")
            }
        result["runs"][side] = run
        del trainer
        free_memory()
        ctx.save()
    ours = result["runs"]["ext"]
    # The packed forward's designed read of each chunk's row spans, and its asynchronous upload of the layout
    # (`forward.layout`), are counted apart; so is its self-check, once per run.
    sites = {(entry["phase"], entry["site"]): entry["count"] for entry in ours["trl_grpo_ext_sites"]}
    chunk_reads = sum(n for (_, site), n in sites.items() if site.endswith(" row_spans"))
    uploads = sum(n for (_, site), n in sites.items() if site.endswith(" upload"))
    once = sum(n for (_, site), n in sites.items() if site.startswith("logprobs.py"))
    other = {
        phase: sum(
            n
            for (where, site), n in sites.items()
            if where == phase and not site.endswith((" row_spans", " upload")) and not site.startswith("logprobs.py")
        )
        for phase in ("loss", "micro_batch", "generation")
    }
    result["packed_forward"] = {"chunk_reads": chunk_reads, "uploads": uploads, "self_check_events": once}
    # The loss and the diagnostics' accumulation (per micro-batch) and the reward statistics (per generation).
    result["checks"]["ext_loss_and_diagnostics_no_sync_per_micro_batch"] = not any(other.values())
    # In the loss, each packed chunk reads its spans once and uploads its layout once (generation adds the rewards'
    # uploads and the self-check).
    loss_reads = sum(n for (where, site), n in sites.items() if where == "loss" and site.endswith(" row_spans"))
    loss_uploads = sum(n for (where, site), n in sites.items() if where == "loss" and site.endswith(" upload"))
    result["checks"]["ext_packed_forward_one_sync_per_chunk"] = loss_reads == loss_uploads > 0
    if ctx.cuda:
        per_log = ours["trl_grpo_ext_per_log_step"]["log"]
        result["targets"]["ext_syncs_per_log_step"] = {"value": per_log, "limit": 1, "met": per_log <= 1}
    else:
        result["skipped"]["ext_syncs_per_log_step"] = (
            "on a CPU the log step's reads of host copies count too; measured on CUDA only"
        )
    return result


# --- 5. non-finite guard --------------------------------------------------------------------------------------


def section_nonfinite(ctx: Context, allotted: float, result: dict) -> dict:
    """A NaN loss at step 2 of 3 (full fine-tuning): that update is skipped and counted, the weights stay finite.
    On CUDA also fp16 with a gradient scaler: an overflow is left to the scaler, a NaN loss is skipped and counted."""
    from transformers import TrainerCallback

    from trl_grpo_ext import GRPOTrainerExt

    class NanAtStepTwo(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * math.nan if self.state.global_step + 1 == 2 else loss

    snapshots = []

    class Recorder(TrainerCallback):
        def snapshot(self, model):
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.snapshot(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.snapshot(model)

    ctx.log("nonfinite: NaN loss at step 2 of 3")
    trainer = make_trainer(
        ctx,
        "ext",
        os.path.join(ctx.workdir, "nonfinite"),
        lora=False,
        trainer_class=NanAtStepTwo,
        callbacks=[Recorder()],
        max_steps=3,
        max_completion_length=min(16, ctx.sizes.completion_length),
    )
    trainer.train()
    logs = loss_logs(trainer)
    del trainer
    free_memory()

    def same(a, b):
        return all(torch.equal(a[name], b[name]) for name in a)

    before, step1, step2, step3 = snapshots[:4]
    result.update(
        {
            "skipped_steps_logged": [entry.get("nonfinite/skipped_steps") for entry in logs],
            "grad_norm": [entry.get("grad_norm") for entry in logs],
            "checks": {
                "nan_step_left_the_weights_unchanged": same(step1, step2),
                "other_steps_updated_the_weights": not same(before, step1) and not same(step2, step3),
                "weights_finite": all(torch.isfinite(p).all().item() for p in step3.values()),
                "skip_counted": [entry.get("nonfinite/skipped_steps") for entry in logs] == [0, 1, 1],
            },
            "targets": {},
            "skipped": {},
        }
    )
    snapshots.clear()
    free_memory()
    ctx.save()
    if not ctx.cuda:
        result["skipped"]["fp16"] = "fp16 with a gradient scaler needs CUDA (the CPU tests use a CPU GradScaler)"
        return result

    # fp16 with accelerate's CUDA gradient scaler: a loss-scale overflow from a finite loss (step 2) is the scaler's
    # to skip and must not count; a NaN loss (step 3) is a non-finite step and must.
    class OverflowThenNan(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            step = self.state.global_step + 1
            return loss * 1e36 if step == 2 else loss * math.nan if step == 3 else loss

    ctx.log("nonfinite: fp16 with a gradient scaler, overflow at step 2, NaN loss at step 3 of 4")
    trainer = make_trainer(
        ctx,
        "ext",
        os.path.join(ctx.workdir, "nonfinite-fp16"),
        lora=False,
        trainer_class=OverflowThenNan,
        callbacks=[Recorder()],
        max_steps=4,
        max_completion_length=min(16, ctx.sizes.completion_length),
        bf16=False,
        fp16=True,
    )
    has_scaler = trainer.accelerator.scaler is not None
    trainer.train()
    logs = loss_logs(trainer)
    scale = trainer.accelerator.scaler.get_scale() if has_scaler else None
    del trainer
    free_memory()
    before, step1, step2, step3, step4 = snapshots[:5]
    skipped = [entry.get("nonfinite/skipped_steps") for entry in logs]
    result["fp16"] = {"skipped_steps_logged": skipped, "final_loss_scale": scale}
    result["checks"].update(
        {
            "fp16_gradient_scaler_in_use": has_scaler,
            "fp16_overflow_and_nan_steps_left_the_weights_unchanged": same(step1, step2) and same(step2, step3),
            "fp16_other_steps_updated_the_weights": not same(before, step1) and not same(step3, step4),
            "fp16_weights_finite": all(torch.isfinite(p).all().item() for p in step4.values()),
            "fp16_only_the_nan_step_counted": skipped == [0, 0, 1, 1],
        }
    )
    snapshots.clear()
    free_memory()
    return result


# --- 6. end to end --------------------------------------------------------------------------------------------

E2E_STARTUP_S = {"cuda": 40.0, "cpu": 20.0}  # two processes importing torch and TRL and building a trainer


def section_e2e(ctx: Context, allotted: float, result: dict) -> dict:
    """Step time and peak memory, `GRPOTrainerExt` against stock TRL, interleaved step by step (`e2e.py`)."""
    from . import e2e

    model_path, tokenizer_path = ctx.model()
    sides = ("trl", "ext")
    modes = ("full", "lora") if ctx.cuda else ("full",)
    step_s = ctx.estimates.get("train_step_s", 2.0 if ctx.cuda else 0.3)
    startup = E2E_STARTUP_S[ctx.device]
    fewest, most = ctx.sizes.e2e_steps
    steps = int((allotted / len(modes) - startup) / (len(sides) * step_s * 1.5))
    steps = max(fewest, min(most, steps))
    overrides = {"bf16": ctx.cuda, "max_completion_length": ctx.sizes.completion_length}
    result.update(
        {
            "config": {
                "steps": steps,
                "warmup": ctx.sizes.e2e_warmup,
                "per_device_train_batch_size": ctx.sizes.e2e_batch,
                "num_generations": 8,
                **overrides,
                "sides": {side: e2e.SIDES[side] for side in sides},
            },
            "modes": {},
            "errors": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    begin = time.monotonic()
    for mode in modes:
        spent = time.monotonic() - begin
        if result["modes"] and spent + (spent / len(result["modes"])) > allotted:
            result["skipped"][mode] = f"time budget: {allotted - spent:.0f} s left of {allotted:.0f} s"
            continue
        ctx.log(f"e2e: {mode}, {steps} interleaved steps per side")
        try:
            run = e2e.run(
                repeats=1,
                steps=steps,
                warmup=ctx.sizes.e2e_warmup,
                batch=ctx.sizes.e2e_batch,
                threads=1,
                modes=(mode,),
                sides=sides,
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                config_overrides=overrides,
            )
        except Exception:  # noqa: BLE001 - recorded; the other mode still runs
            result["errors"][mode] = traceback.format_exc()
            result["checks"][f"{mode}_ran"] = False
            continue
        mode_result = run["modes"][mode]
        result["modes"][mode] = mode_result
        ratios = mode_result["ratios"]["ext/trl"]
        for name, value in (
            ("step_time_median", ratios["step_time"]["median"]),
            ("total_time", ratios["total_time"]),
            ("peak_memory", ratios["peak_memory"]["median"]),
        ):
            result["targets"][f"{mode}_{name}_ext_over_trl"] = {"value": value, "limit": 1.0, "met": value <= 1.0}
        ctx.log(
            f"e2e: {mode}: ext/trl step time {ratios['step_time']['median']:.3f}, "
            f"total {ratios['total_time']:.3f}, memory {ratios['peak_memory']['median']:.3f}"
        )
        result["table"] = e2e.table(result)
        ctx.save()
    return result


# --- 7. sharded engines (only with --sections sharded) ---------------------------------------------------------


def section_sharded(ctx: Context, allotted: float, result: dict) -> dict:
    """FSDP2 (and ZeRO-2/3 where deepspeed is installed) through `benchmarks.sharded.run_sharded_checks`: the engine is
    active, losses finite, a NaN step skipped without touching the weights; one process per GPU."""
    from .sharded import run_sharded_checks

    ctx.log("sharded: one launch per engine")
    checks = run_sharded_checks(os.path.join(ctx.workdir, "sharded"))
    result["engines"] = {name: value for name, value in checks.items() if name != "ok"}
    result["checks"] = {
        f"{name}_ok": value["status"] == "ok"
        for name, value in checks.items()
        if name != "ok" and value["status"] != "skipped"
    }
    result["skipped"] = {
        name: "; ".join(value["problems"])
        for name, value in checks.items()
        if name != "ok" and value["status"] == "skipped"
    }
    result["targets"] = {}
    return result
