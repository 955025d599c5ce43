"""Communication: the collectives that metrics add, `GRPOTrainerExt`'s diagnostics against TRL's own loss metrics.

Two CPU processes (gloo, under `accelerate launch`) train a tiny model for a few steps, once with each trainer and
at two per-device batch sizes. Every `torch.distributed` collective is counted, with the bytes of its input, and
attributed by the first caller outside torch and accelerate: `trl_grpo_ext` (the diagnostics' one gather per log
step), TRL's `_compute_loss` (its metrics, per micro-batch), or anything else (rewards, generation bookkeeping:
the same on both sides).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback

from .common import child_env, format_table

BATCH_SIZES = (8, 32)
STEPS, ACCUMULATION = 4, 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(side: str, batch: int, model_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import trl_grpo_ext
    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    torch.set_num_threads(1)
    package = os.path.dirname(trl_grpo_ext.__file__)
    libraries = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}")
    counts: dict[str, dict[str, int]] = {}

    def category() -> str:
        for frame in traceback.extract_stack()[:-3][::-1]:
            if any(part in frame.filename for part in libraries):
                continue
            if frame.filename.startswith(package):
                return "ext_diagnostics"
            in_trl_loss = frame.name in ("_compute_loss", "global_masked_mean", "masked_seq_mean")
            if frame.filename.endswith(os.path.join("trl", "trainer", "grpo_trainer.py")) and in_trl_loss:
                return "trl_loss_metrics"
            return "other"
        return "other"

    def tensor_bytes(args) -> int:
        return sum(arg.numel() * arg.element_size() for arg in args if isinstance(arg, torch.Tensor))

    for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce", "gather"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            tensors = [args[1]] if _name in ("all_gather_into_tensor", "all_gather") and len(args) > 1 else args[:1]
            entry = counts.setdefault(category(), {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += tensor_bytes(tensors)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    common = dict(
        output_dir=os.path.splitext(out)[0] + "-run",  # beside the result file, inside the caller's work folder
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ACCUMULATION,
        num_generations=4,
        max_completion_length=8,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    if side == "trl":
        trainer_class = GRPOTrainer
        args = GRPOConfig(**common, loss_type="grpo", beta=0.04, use_bias_correction_kl=False)
    else:
        trainer_class = GRPOTrainerExt
        args = GRPOConfigExt(**common)
    trainer = trainer_class(
        model=model_path,
        reward_funcs=lambda completions, **kwargs: [c.count("a") + 0.1 * len(c) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "hij=", "aa=", "gf=", "bbb=", "ce="] * 64}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    counts.clear()  # count training only
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump({"counts": counts, "num_processes": trainer.accelerator.num_processes}, handle)


def run(batch_sizes=BATCH_SIZES, workdir: str | os.PathLike | None = None) -> dict:
    """Launch the two-process runs and return calls and bytes per log step / micro-batch (what `--json` writes).

    Args:
        batch_sizes: per-device batch sizes to compare.
        workdir: folder for the tiny model, the runs' output folders, their counts and temporary files; by default a
            temporary folder that is removed afterwards.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench-comm-") as temporary:
            return run(batch_sizes, temporary)
    from trl_grpo_ext.testing import save_tiny

    workdir = os.fspath(workdir)
    model_path = save_tiny(os.path.join(workdir, "model"))
    temporary_files = os.path.join(workdir, "tmp")
    os.makedirs(temporary_files, exist_ok=True)
    micro_batches = STEPS * ACCUMULATION
    results = {"processes": 2, "log_steps": STEPS, "micro_batches": micro_batches, "runs": []}
    for side in ("ext", "trl"):
        for batch in batch_sizes:
            out = os.path.join(workdir, f"{side}-{batch}.json")
            command = [
                sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()),
                "-m", "benchmarks.comm", "--worker", side, str(batch), model_path, out,
            ]  # fmt: skip
            # TMPDIR: the launcher (torchrun) leaves `torchelastic_*` folders in the temporary folder.
            env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=temporary_files)
            completed = subprocess.run(command, capture_output=True, text=True, env=env)
            if completed.returncode != 0:
                raise RuntimeError(
                    f"communication benchmark ({side}, batch {batch}) failed:\n{completed.stderr[-3000:]}"
                )
            with open(out) as handle:
                counts = json.load(handle)["counts"]
            row = {"side": side, "per_device_batch": batch}
            for name, per in (("ext_diagnostics", STEPS), ("trl_loss_metrics", micro_batches), ("other", STEPS)):
                entry = counts.get(name, {"calls": 0, "bytes": 0})
                row[name] = {"calls": entry["calls"], "bytes": entry["bytes"], "per": per}
            results["runs"].append(row)
    return results


def table(results: dict) -> str:
    rows = []
    for run in results["runs"]:

        def rate(entry):
            return f"{entry['calls'] / entry['per']:g} / {entry['bytes'] / entry['per']:,.0f} B"

        rows.append(
            [
                "GRPOTrainerExt" if run["side"] == "ext" else "trl.GRPOTrainer",
                run["per_device_batch"],
                rate(run["ext_diagnostics"]),
                rate(run["trl_loss_metrics"]),
                f"{run['other']['calls'] / run['other']['per']:g}",
            ]
        )
    headers = [
        "trainer",
        "per-device batch",
        "diagnostics: calls / bytes per log step",
        "loss metrics: calls / bytes per micro-batch",
        "other collectives per step",
    ]
    return (
        f"{results['processes']} CPU processes (gloo), {results['log_steps']} log steps of "
        f"{results['micro_batches'] // results['log_steps']} micro-batches\n" + format_table(headers, rows)
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
