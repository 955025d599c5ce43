"""Tiny GRPOTrainerExt runs in two processes, for tests/test_distributed.py (DDP) and tests/test_sharded.py.

    accelerate launch --config_file recipes/accelerate_configs/cpu_<engine>.yaml tests/distributed_run.py \
        <output_dir> <model_path> --phases reference,nan-skip,...

Each phase trains a fresh trainer in the same processes (so that one launch pays the start-up once), and each
process saves what the tests check in `<output_dir>/<phase>/rank<k>.pt`:

- `reference`: an uninterrupted run, checkpointing every `SAVE_STEPS`: what the loss saw per micro-batch, the
  gathered rewards, the collective calls made from trl_grpo_ext code, the log history, and the proof that the engine
  shards (a local shard against the full size).
- `crash`: the same run in `<output_dir>/run/`; every process SIGKILLs itself while writing checkpoint `KILL_STEP`
  (after the model, before the optimizer), so it must be the last phase. `resume`: resumes that run.
- `nan-skip`, `nan-stop`: the loss of rank 1 is NaN in step `NAN_STEP`; each process's local weights before and after
  that step, or when training stopped.
- `lora`: a LoRA adapter trained and saved; the full adapter and base tensors before and after.
- `heldout`: the held-out evaluation (tests/helpers.py's prompts and metric) before training, and at the one step of
  a run with learning rate 0 (the weights of the start, sharded by the engine then), with the collectives it made.
- `recipe`: the recipe's `main` (`trl_grpo_ext.recipes.grpo`, which `recipes/grpo.py` runs) on the demo config,
  with held-out evaluation before and after training; it ends accelerate's process group, so it must be the last
  phase.
"""

import argparse
import os
import signal
import sys
import traceback

# `benchmarks` (below) is not installed: it is imported from this checkout, which a script's sys.path lacks.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_grpo_ext.testing import enable_sharded_engines_on_cpu

# Before anything creates accelerate's state: an FSDP or DeepSpeed launch on CPU processes shards for real.
ENGINE = enable_sharded_engines_on_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

import trl_grpo_ext  # noqa: E402
from benchmarks.sharded import engine_proof, local_weights  # noqa: E402
from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt  # noqa: E402
from trl_grpo_ext import trainer as trainer_module  # noqa: E402
from trl_grpo_ext.checkpointing import STAGING_DIR  # noqa: E402
from trl_grpo_ext.guardrails import NonFiniteTrainingError  # noqa: E402

PACKAGE_DIR = os.path.dirname(trl_grpo_ext.__file__)
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce", "gather", "scatter")
LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STEPS = 8
SAVE_STEPS = 3  # checkpoint 3 falls between a generation and its reuse (num_iterations=2)
KILL_STEP = 6
NAN_STEP = 2
NAN_RANK = 1

collective_calls = {"ours": 0, "ours_in_loss": 0, "total": 0}
in_loss = [False]


def caller_is_ours() -> bool:
    """Whether the nearest frame outside torch/accelerate belongs to trl_grpo_ext."""
    for frame in traceback.extract_stack()[:-2][::-1]:
        if any(part in frame.filename for part in LIBRARY_PARTS) or frame.filename == __file__:
            continue
        return frame.filename.startswith(PACKAGE_DIR)
    return False


def count_collectives() -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            collective_calls["total"] += 1
            if caller_is_ours():
                collective_calls["ours"] += 1
                collective_calls["ours_in_loss"] += in_loss[0]
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def reward(completions, **kwargs):
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (collectives under FSDP2 and ZeRO-3: call it on every process)."""
    params = dict(model.named_parameters())
    if any(hasattr(param, "ds_tensor") for param in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: param.detach().clone() for name, param in params.items()}
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in params.items()
    }


class RunTrainer(GRPOTrainerExt):
    """Records what the tests check; `nan_step` makes rank `NAN_RANK`'s loss NaN in that optimizer step."""

    nan_step: int | None = None
    records: dict

    def _compute_loss(self, model, inputs):
        in_loss[0] = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            in_loss[0] = False
        if self.nan_step == self.state.global_step + 1 and self.accelerator.process_index == NAN_RANK:
            loss = loss * float("nan")
        return loss

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.records["rewards"].append(rewards_per_func.sum(dim=1))
        self.records["lengths"].append(torch.tensor([len(ids) for ids in completion_ids_list]))  # this process's
        return rewards_per_func

    def log(self, logs, start_time=None):
        self.records["log_calls"] += "loss" in logs
        return super().log(logs, start_time)


class WeightsAroundStep(TrainerCallback):
    """Keeps this process's local weights at the start and at the end of one optimizer step."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.before, self.after = trainer, step, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            self.before = local_weights(self.trainer.model)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.after = local_weights(self.trainer.model)


def make_trainer(output_dir, model_path, *, lora=False, trainer_kwargs=None, **overrides) -> RunTrainer:
    # Different prompts on each process: the sampler hands each rank its own slice of every batch.
    prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "bcd", "zz", "kite")] * 8
    config = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        max_steps=MAX_STEPS,
        logging_steps=1,  # a resumed run starts a new logging window at its checkpoint
        gradient_accumulation_steps=2,
        num_iterations=2,
        report_to="none",
        # accelerate starts DeepSpeed only for a non-`cpu` state; DS_ACCELERATOR=cpu keeps it on the CPU.
        use_cpu=ENGINE != "deepspeed",
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    config.update(overrides)
    trainer = RunTrainer(
        model=model_path,
        reward_funcs=reward,
        args=GRPOConfigExt(**config),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
        **(trainer_kwargs or {}),
    )
    trainer.records = {"steps": [], "rewards": [], "lengths": [], "log_calls": 0}
    return trainer


def run_train(output_dir, model_path, *, kill_during_save_of=None, resume=False) -> dict:
    found = None
    if resume:  # what a killed run left behind, before resuming cleans up
        staging = os.path.join(output_dir, STAGING_DIR)
        found = {
            "checkpoints": sorted(int(name[11:]) for name in os.listdir(output_dir) if name.startswith("checkpoint-")),
            "staged": sorted(os.listdir(staging)) if os.path.isdir(staging) else [],
        }
    trainer = make_trainer(output_dir, model_path, save_strategy="steps", save_steps=SAVE_STEPS)
    original_loss = trainer_module.policy_objective

    def recording_loss(*args, **kwargs):
        out = original_loss(*args, **kwargs)
        trainer.records["steps"].append(
            {key: getattr(out, key) for key in ("ratio", "log_ratio", "per_token_kl", "mask", "advantages")}
            | {"policy_loss": out.policy_loss, "kl_penalty": out.kl_penalty}
        )
        return out

    trainer_module.policy_objective = recording_loss
    if kill_during_save_of is not None:
        original_save = trainer._save_optimizer_and_scheduler

        def save_then_die(checkpoint_dir):
            if trainer.state.global_step == kill_during_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_save(checkpoint_dir)

        trainer._save_optimizer_and_scheduler = save_then_die
    calls_before = dict(collective_calls)
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    finally:
        trainer_module.policy_objective = original_loss
    return {
        "records": trainer.records,
        "collectives": {key: collective_calls[key] - calls_before[key] for key in collective_calls},
        "log_history": trainer.state.log_history,
        "engine": engine_proof(trainer),
        "found": found,
    }


def run_nan(output_dir, model_path, policy: str) -> dict:
    trainer = make_trainer(output_dir, model_path, max_steps=NAN_STEP + 1, logging_steps=1, nonfinite_policy=policy)
    trainer.nan_step = NAN_STEP
    around = WeightsAroundStep(trainer, NAN_STEP)
    trainer.add_callback(around)
    error = None
    try:
        trainer.train()
    except NonFiniteTrainingError as raised:
        error = str(raised)
    return {
        "error": error,
        "skipped": trainer._nonfinite_guard.skipped,
        "global_step": trainer.state.global_step,
        "log_history": trainer.state.log_history,
        "before": around.before,
        "after": around.after,
        "final": local_weights(trainer.model),
        "engine": engine_proof(trainer),
    }


def run_lora(output_dir, model_path) -> dict:
    trainer = make_trainer(output_dir, model_path, lora=True, max_steps=2, learning_rate=5e-2)
    before = full_weights(trainer.model)
    trainer.train()
    after = full_weights(trainer.model)
    trainer.save_model(os.path.join(output_dir, "adapter"))
    trainer.accelerator.wait_for_everyone()
    return {
        "before": before,
        "after": after,
        "engine": engine_proof(trainer),
        "log_history": trainer.state.log_history,
    }


def run_heldout(output_dir, model_path) -> dict:
    from helpers import HELDOUT_OPTIONS, heldout_dataset, letter_a_metric

    held_out = {"heldout_metrics": [letter_a_metric], "heldout_dataset": heldout_dataset()}
    trainer = make_trainer(
        output_dir,
        model_path,
        trainer_kwargs=held_out,
        max_steps=1,
        learning_rate=0.0,
        heldout_every_steps=1,
        **HELDOUT_OPTIONS,
    )
    calls_before = dict(collective_calls)
    before = trainer.evaluate_heldout(log=False)
    collectives = collective_calls["ours"] - calls_before["ours"]
    trainer.train()
    (during,) = [entry for entry in trainer.state.log_history if any(key.startswith("heldout/") for key in entry)]
    return {"before": before, "during": during, "collectives": collectives, "engine": engine_proof(trainer)}


def run_recipe(output_dir) -> dict:
    """The recipe's `main`, short, with held-out evaluation; the trainer it built is kept for the engine proof."""
    from trl_grpo_ext.recipes import grpo as recipe  # what recipes/grpo.py runs

    built = []

    class KeptTrainer(GRPOTrainerExt):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    trl_grpo_ext.GRPOTrainerExt = KeptTrainer
    tiny = os.path.join(REPO, "recipes", "tiny")
    args = [
        "--config",
        os.path.join(tiny, "config_demo.yaml"),
        "--model_name_or_path",
        os.path.join(tiny, "base_model"),
    ]
    args += ["--dataset_name", os.path.join(tiny, "data"), "--output_dir", output_dir, "--max_steps", "2"]
    args += ["--per_device_train_batch_size", "16", "--logging_steps", "1", "--save_steps", "2", "--eval_samples", "8"]
    args += ["--report_to", "none", "--use_cpu", str(ENGINE != "deepspeed").lower()]
    try:
        held_out = recipe.main(*recipe.parse_args(args))
    finally:
        trl_grpo_ext.GRPOTrainerExt = GRPOTrainerExt
    return {"held_out": held_out, "engine": engine_proof(built[0])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("model_path")
    parser.add_argument("--phases", default="reference")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    count_collectives()
    rank = int(os.environ["RANK"])  # `recipe` ends the process group
    for phase in cli.phases.split(","):
        output_dir = os.path.join(cli.output_dir, phase)
        if phase == "reference":
            result = run_train(output_dir, cli.model_path)
        elif phase in ("crash", "resume"):
            output_dir = os.path.join(cli.output_dir, "run")
            kill = KILL_STEP if phase == "crash" else None
            result = run_train(output_dir, cli.model_path, kill_during_save_of=kill, resume=phase == "resume")
        elif phase in ("nan-skip", "nan-stop"):
            result = run_nan(output_dir, cli.model_path, phase.removeprefix("nan-"))
        elif phase == "lora":
            result = run_lora(output_dir, cli.model_path)
        elif phase == "heldout":
            result = run_heldout(output_dir, cli.model_path)
        elif phase == "recipe":
            result = run_recipe(output_dir)
        else:
            raise ValueError(f"unknown phase {phase!r}")
        results_dir = os.path.join(cli.output_dir, phase)
        os.makedirs(results_dir, exist_ok=True)
        torch.save(result, os.path.join(results_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
