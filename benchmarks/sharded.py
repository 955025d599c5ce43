"""`GRPOTrainerExt` under FSDP2 and DeepSpeed ZeRO-2/3 on the GPUs of one machine: a check for the GPU script.

`run_sharded_checks(out_dir)` launches, for each engine, `accelerate launch` with the recipe's GPU config
(`recipes/accelerate_configs/{fsdp2,zero2,zero3}.yaml`: bf16 mixed precision, NCCL) and one process per GPU, on this
module's worker. The worker trains the tiny model a few steps, then again with the loss of the last process made NaN
in one step, and reports what it saw. The CPU tests (`tests/test_sharded.py`: two gloo processes, float32) cover the
trainer's logic under the same engines; this adds what only GPUs have: CUDA and NCCL, FSDP2's bf16
`MixedPrecisionPolicy`, DeepSpeed's bf16 optimizer with its overflow check. With one GPU each engine runs one
process, whose "shard" is the whole tensor; with N GPUs the local shard must be 1/N.

Without CUDA it runs the CPU configs (`cpu_*.yaml`, two processes, float32) instead: the same checks, as a smoke test.
DeepSpeed is checked only where it is installed (`pip install deepspeed`; it installs without compiling anything).
From the root of a checkout:

    python -c "from benchmarks.sharded import run_sharded_checks; print(run_sharded_checks('sharded-out'))"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time

import torch

from .common import CHECKOUT, child_env, cpu_engines

__all__ = ["ENGINES", "engine_proof", "local_weights", "run_sharded_checks"]

ENGINES = ("fsdp2", "zero2", "zero3")
CONFIGS = os.path.join(CHECKOUT, "recipes")
NAN_STEP = 2


def local_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This process's part of every parameter (FSDP2 shard, ZeRO-3 partition, or whole tensor), on the CPU."""
    from torch.distributed.tensor import DTensor

    weights = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local()
        elif hasattr(param, "ds_tensor"):
            local = param.ds_tensor
        else:
            local = param
        weights[name] = local.detach().float().cpu().clone()
    return weights


def engine_proof(trainer) -> dict:
    """The engine accelerate runs, and the size of one sharded thing on this process against its full size.

    FSDP2 and ZeRO-3: a trainable parameter; ZeRO-1/2 (whole weights on every process): the fp32 master weights, which
    the optimizer states shadow; otherwise the whole parameter.
    """
    from torch.distributed.tensor import DTensor

    accelerator = trainer.accelerator
    proof = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    if trainer.is_deepspeed_enabled:
        engine = trainer.model_wrapped
        proof["zero_stage"] = engine.zero_optimization_stage()
        if proof["zero_stage"] == 3:
            proof.update(sharded=f"parameter {name}", local=param.ds_tensor.numel(), full=param.ds_numel)
        else:
            partitions = engine.optimizer.single_partition_of_fp32_groups
            trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            proof.update(sharded="fp32 master weights", local=sum(t.numel() for t in partitions), full=trainable)
    elif isinstance(param, DTensor):
        proof.update(sharded=f"parameter {name}", local=param.to_local().numel(), full=param.numel())
    else:
        proof.update(sharded=f"parameter {name}", local=param.numel(), full=param.numel())
    return proof


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _verdict(engine: str, report: dict) -> list[str]:
    """What went wrong in a worker's report (empty: the engine passed)."""
    problems = []
    proof = report["engine"]
    expected = "DistributedType.FSDP" if engine == "fsdp2" else "DistributedType.DEEPSPEED"
    if proof["distributed_type"] != expected:
        problems.append(f"accelerate ran {proof['distributed_type']}, not {expected}")
    if proof.get("zero_stage", None) != {"zero2": 2, "zero3": 3}.get(engine):
        problems.append(f"ZeRO stage {proof.get('zero_stage')}")
    if proof["local"] * proof["num_processes"] != proof["full"]:
        problems.append(f"local shard {proof['local']} of {proof['full']} with {proof['num_processes']} processes")
    if not all(math.isfinite(value) for value in report["losses"] + report["grad_norms"]):
        problems.append(f"non-finite loss or gradient norm in a clean run: {report['losses']}, {report['grad_norms']}")
    nan = report["nan_skip"]
    if nan["error"] or nan["skipped"] != 1:
        problems.append(f"the NaN step was not skipped once: {nan['skipped']} skipped, error {nan['error']}")
    if not nan["weights_unchanged"] or not nan["final_finite"]:
        problems.append("the NaN step changed the weights" if nan["final_finite"] else "non-finite weights")
    return problems


def run_sharded_checks(out_dir: str, engines: tuple[str, ...] = ENGINES) -> dict:
    """Check FSDP2, ZeRO-2 and ZeRO-3 on this machine's GPUs (or CPU processes without CUDA); one launch per engine.

    Args:
        out_dir: where the tiny model, each engine's run and `sharded.json` go.
        engines: a subset of `ENGINES`.

    Returns:
        `dict`: per engine, `status` (`"ok"`, `"failed"` or `"skipped"`), `problems`, `seconds`, and the worker's
        report (engine proof, per-step losses and gradient norms, the NaN run's outcome); `"ok"` overall.

    Raises:
        ValueError: for an engine not in `ENGINES`.
        FileNotFoundError: when the recipes' accelerate configs are not beside `benchmarks/` (run from a checkout).
    """
    from trl_grpo_ext.testing import save_tiny

    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"Unknown engines {sorted(unknown)}; choose from {ENGINES}.")
    os.makedirs(out_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    configs = os.path.join(CONFIGS, "accelerate_configs")
    if not os.path.isdir(configs):
        raise FileNotFoundError(f"{configs} not found: run the sharded checks from a checkout of the repository.")
    model_path = save_tiny(os.path.join(out_dir, "tiny_model"))
    results: dict = {}
    for engine in engines:
        if engine.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            results[engine] = {"status": "skipped", "problems": ["deepspeed is not installed"]}
            continue
        config = os.path.join(configs, f"{engine}.yaml" if cuda else f"cpu_{engine}.yaml")
        num_processes = max(1, torch.cuda.device_count()) if cuda else 2
        run_dir = os.path.join(out_dir, engine)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        command += ["--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
        command += ["-m", "benchmarks.sharded", "--worker", engine, run_dir, model_path]
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
        seconds = round(time.perf_counter() - start, 1)
        report_path = os.path.join(run_dir, "report.json")
        if result.returncode != 0 or not os.path.isfile(report_path):
            problem = f"exit status {result.returncode}: {result.stderr[-2000:]}"
            results[engine] = {"status": "failed", "problems": [problem], "seconds": seconds}
            continue
        with open(report_path) as handle:
            report = json.load(handle)
        problems = _verdict(engine, report)
        results[engine] = {"status": "failed" if problems else "ok", "problems": problems, "seconds": seconds}
        results[engine]["report"] = report
    results["ok"] = all(results[engine]["status"] != "failed" for engine in engines)
    with open(os.path.join(out_dir, "sharded.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    return results


def _count_a_reward(completions, **kwargs) -> list[float]:
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


def _worker(engine: str, run_dir: str, model_path: str) -> None:
    """One process of an engine's launch: a clean run, then one whose last process has a NaN loss in `NAN_STEP`."""
    on_cpu = cpu_engines().enable_sharded_engines_on_cpu() is not None  # without CUDA: the CPU smoke test
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
    from trl_grpo_ext.guardrails import NonFiniteTrainingError

    class NanAtStep(GRPOTrainerExt):
        nan_step: int | None = None

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            last = self.accelerator.process_index == self.accelerator.num_processes - 1
            return loss * float("nan") if last and self.nan_step == self.state.global_step + 1 else loss

    class AroundStep(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.before, self.after = trainer, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == NAN_STEP - 1:
                self.before = local_weights(self.trainer.model)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == NAN_STEP:
                self.after = local_weights(self.trainer.model)

    def trainer(name: str, max_steps: int) -> NanAtStep:
        config = GRPOConfigExt(
            output_dir=os.path.join(run_dir, name),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            learning_rate=1e-2,
            max_steps=max_steps,
            logging_steps=1,
            report_to="none",
            use_cpu=on_cpu and not engine.startswith("zero"),
            bf16=not on_cpu,
            seed=0,
            save_strategy="no",
            disable_tqdm=True,
        )
        prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "bcd", "zz", "kite")] * 8
        return NanAtStep(
            model=model_path,
            reward_funcs=_count_a_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(model_path),
        )

    clean = trainer("clean", max_steps=4)
    clean.train()
    logs = [entry for entry in clean.state.log_history if "loss" in entry]
    report = {
        "engine": engine_proof(clean),
        "losses": [float(entry["loss"]) for entry in logs],
        "grad_norms": [float(entry["grad_norm"]) for entry in logs],
    }
    nan = trainer("nan_skip", max_steps=NAN_STEP + 1)
    nan.nan_step = NAN_STEP
    around = AroundStep(nan)
    nan.add_callback(around)
    error = None
    try:
        nan.train()
    except NonFiniteTrainingError as raised:
        error = str(raised)
    final = local_weights(nan.model)
    unchanged = around.after is not None and all(torch.equal(around.before[k], around.after[k]) for k in final)
    report["nan_skip"] = {
        "error": error,
        "skipped": nan._nonfinite_guard.skipped,
        "weights_unchanged": unchanged,
        "final_finite": all(bool(torch.isfinite(weight).all()) for weight in final.values()),
    }
    # Every process judges its own weights; the report holds the verdict of all of them.
    flags = torch.tensor([float(unchanged), float(report["nan_skip"]["final_finite"])], device=nan.accelerator.device)
    flags = nan.accelerator.reduce(flags, reduction="sum") if nan.accelerator.num_processes > 1 else flags
    report["nan_skip"]["weights_unchanged"] = bool(flags[0] == nan.accelerator.num_processes)
    report["nan_skip"]["final_finite"] = bool(flags[1] == nan.accelerator.num_processes)
    if nan.accelerator.is_main_process:
        with open(os.path.join(run_dir, "report.json"), "w") as handle:
            json.dump(report, handle, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__)
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "RUN_DIR", "MODEL_PATH"), required=True)
    args = parser.parse_args(argv)
    _worker(*args.worker)


if __name__ == "__main__":
    main()
