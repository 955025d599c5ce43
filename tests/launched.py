"""Tiny GRPOTrainerExt runs that need processes of their own: two under `accelerate launch`, or one under `python`.

    accelerate launch --config_file recipes/accelerate_configs/cpu_<engine>.yaml tests/launched.py \
        <output_dir> <model_path> --phases reference,nan-skip,...
    python tests/launched.py <output_dir> <model_path> --phases checkpointed --save_steps 3 [--resume] ...

Each phase trains a fresh trainer in the same processes (so that one launch pays the start-up once), in
`<output_dir>/<phase>/` unless said otherwise, and each process saves what the tests check in
`<output_dir>/<phase>/rank<k>.pt` (read by `helpers.phase_results`). Launched by `helpers.launch` and
`helpers.run_alone`.

The distributed run (tests/test_distributed.py under DDP, tests/test_sharded.py under FSDP2 and ZeRO-2/3):

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
- `recipe`: the recipe's `main` (`trl_grpo_ext.tools.recipes.grpo`, which `recipes/grpo.py` runs) on the demo config,
  with held-out evaluation before and after training; it ends accelerate's process group, so it must be the last
  phase.

Dynamic sampling and row skipping (tests/test_extras_distributed.py, DDP, FSDP2 and ZeRO-3):

- `dynamic`: dynamic sampling with groups that span both processes (3 rows per process and step, groups of 4) and a
  reward constant on a third of the prompts: the log history, every batch that trains (this process's rows, decoded),
  and the micro-batches the loss saw.
- `skip-whole`, `skip`: beta=0 and a reward constant on every completion of rank 1 (whose groups are its own), without
  and with `skip_zero_advantage_rows`: rank 1 then leaves every row out; the log histories and forward row counts.
- `disagree`: rank 1's keep/drop decisions differ from rank 0's: the error each process raised (must be last).

Selective rollouts and dynamic sampling's round sizes (tests/test_extras_selective.py,
tests/test_extras_dynamic_sizing.py), over 12 prompts (6 texts, 2 of them with a constant reward), each generation
used twice, beta=0. Each saves the log history, the rows each of TRL's generation calls got (`stock_rows`), the
prompts each round of selective rollouts was decided for (`rounds`), every batch that trains (this process's rows,
decoded, and advantages) and the engine:

- `selective-checkpointed`, `sizing-checkpointed`: one process (`python`), selective rollouts with dynamic sampling,
  or dynamic sampling alone, 12 steps of 16 rows, checkpointed every `--save_steps`; `--kill_during_save_of` and
  `--resume` as for `checkpointed`.
- `selective`: two processes, 3 rows each per step and groups of 4 (a group spans both processes), selective rollouts
  with dynamic sampling.
- `sizing-whole`: two processes, 8 rows each per step (whole groups per process), dynamic sampling alone.
- `sizing-spanning`: the layout of `selective`, dynamic sampling alone.
- `selective-disagree`: `selective` where rank 1 never skips: the error each process raised (must be last).

The launch check (tests/test_guardrails_launch.py):

- `build`: builds the trainer with `use_cpu` set by `--use_cpu` and prints `num_processes=<n>`, then `launch checked`
  once `check_launch` passed (a launch that accelerate runs as independent processes fails while building).

One process (`python`, no launcher):

- `checkpointed`: the crash and resume tests' run (tests/test_checkpointing.py, tests/test_extras_dynamic.py), 8
  steps checkpointed every `--save_steps`, with `--lora` a LoRA adapter, with `--dynamic_sampling` dynamic sampling
  and a reward constant on a third of the prompts. `--kill_during_save_of STEP` makes the process SIGKILL itself while
  writing the checkpoint of that step (after the model, before the optimizer); `--resume` resumes the run in the
  phase's folder. Saves the log history.
- `logger`: two steps (the second off-policy) reporting to the logger `--report_to` (tests/test_diagnostics.py); a
  process of its own because trackio fixes its local store (`TRACKIO_DIR`) when it is first imported (importing TRL's
  GRPO trainer does), and W&B keeps a run per process. The environment chooses each logger's offline store.
- `alerts`: two steps that raise alarms, reporting to `--report_to` (tests/test_extras_alerts.py), in a process of its
  own for the same reasons: completions of one token are all truncated (alarm `truncation`) and a constant reward
  leaves no spread inside any group (alarm `zero_std`). Prints `ALARMS [<the episodes' alarms, sorted>]`.
"""

import argparse
import os
import signal
import sys
import traceback

# `benchmarks` (below) is not installed: it is imported from this checkout, which a script's sys.path lacks.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_engines import enable_sharded_engines_on_cpu  # this script's folder is on sys.path

# Before anything creates accelerate's state: an FSDP or DeepSpeed launch on CPU processes shards for real.
ENGINE = enable_sharded_engines_on_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import helpers  # noqa: E402  (this script's folder is on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import (  # noqa: E402  (this script's folder is on sys.path)
    HELDOUT_OPTIONS,
    constant_reward,
    count_a_reward,
    half_constant_reward,
    heldout_arguments,
    letter_a_metric,
    make_trainer,
    tiny_lora,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

import trl_grpo_ext  # noqa: E402
from benchmarks.sharded import engine_proof, local_weights  # noqa: E402
from trl_grpo_ext import GRPOTrainerExt  # noqa: E402
from trl_grpo_ext import trainer as trainer_module  # noqa: E402
from trl_grpo_ext.checkpointing import STAGING_DIR  # noqa: E402
from trl_grpo_ext.extras import plan as sampling_plan  # noqa: E402
from trl_grpo_ext.extras.selective import SelectiveRollouts  # noqa: E402
from trl_grpo_ext.guardrails import NonFiniteTrainingError  # noqa: E402
from trl_grpo_ext.guardrails.launch import check_launch  # noqa: E402

PACKAGE_DIR = os.path.dirname(trl_grpo_ext.__file__)
HARNESS_FILES = (__file__, helpers.__file__)
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce", "gather", "scatter")
LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STEPS = 8
SAVE_STEPS = 3  # checkpoint 3 falls between a generation and its reuse (num_iterations=2)
KILL_STEP = 6
NAN_STEP = 2
NAN_RANK = 1
RANK = int(os.environ.get("RANK", "0"))
# The phases that count the collectives of torch.distributed (the others leave its functions as they are).
COUNTING_PHASES = {"reference", "crash", "resume", "heldout"}

collective_calls = {"ours": 0, "ours_in_loss": 0, "total": 0}
in_loss = [False]


def caller_is_ours() -> bool:
    """Whether the nearest frame outside torch/accelerate (and this harness) belongs to trl_grpo_ext."""
    for frame in traceback.extract_stack()[:-2][::-1]:
        if any(part in frame.filename for part in LIBRARY_PARTS) or frame.filename in HARNESS_FILES:
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


def reward_constant_on_some_prompts(prompts, completions, **kwargs):
    return [
        1.0 if prompt in ("xyz=", "qq=") else value for prompt, value in zip(prompts, reward(completions), strict=True)
    ]


def reward_constant_on_rank_1(completions, **kwargs):
    """Each process scores its own completions: rank 1's all get the same reward."""
    return [1.0 if RANK == 1 else completion.count("a") + 0.1 * len(completion) for completion in completions]


def tiny_dataset(prompts: list[str]) -> Dataset:
    return Dataset.from_dict({"prompt": prompts})


def die_while_saving(trainer, step: int) -> None:
    """The process SIGKILLs itself while writing the checkpoint of `step`: after the model, before the optimizer."""
    original_save = trainer._save_optimizer_and_scheduler

    def save_then_die(checkpoint_dir):
        if trainer.state.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(checkpoint_dir)

    trainer._save_optimizer_and_scheduler = save_then_die


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


# The two-process runs, over `helpers.tiny_grpo_args`: 2 micro-batches per optimizer step, each generation used twice,
# logged every step (a resumed run starts a new logging window at its checkpoint).
TWO_PROCESSES = dict(
    max_completion_length=6,
    gradient_accumulation_steps=2,
    num_iterations=2,
    # accelerate starts DeepSpeed only for a non-`cpu` state; DS_ACCELERATOR=cpu keeps it on the CPU.
    use_cpu=ENGINE != "deepspeed",
)


def distributed_trainer(output_dir, model_path, *, lora=False, trainer_kwargs=None, **overrides) -> RunTrainer:
    # Different prompts on each process: the sampler hands each rank its own slice of every batch.
    prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "bcd", "zz", "kite")] * 8
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(prompts),
        trainer_cls=RunTrainer,
        reward_funcs=reward,
        peft_config=tiny_lora() if lora else None,
        trainer_kwargs=trainer_kwargs,
        **{**TWO_PROCESSES, "max_steps": MAX_STEPS, **overrides},
    )
    trainer.records = {"steps": [], "rewards": [], "lengths": [], "log_calls": 0}
    return trainer


def count_packed_forwards(trainer: RunTrainer) -> None:
    """Counts, in `records["packed_forwards"]`, the log-prob forwards that ran packed (not TRL's padded forward)."""
    packed = trainer._packed_forward
    trainer.records["packed_forwards"] = 0

    def counted(*args, **kwargs):
        out = packed(*args, **kwargs)
        trainer.records["packed_forwards"] += out is not None
        return out

    trainer._packed_forward = counted


def run_train(output_dir, model_path, *, kill_during_save_of=None, resume=False, **overrides) -> dict:
    found = None
    if resume:  # what a killed run left behind, before resuming cleans up
        staging = os.path.join(output_dir, STAGING_DIR)
        found = {
            "checkpoints": sorted(int(name[11:]) for name in os.listdir(output_dir) if name.startswith("checkpoint-")),
            "staged": sorted(os.listdir(staging)) if os.path.isdir(staging) else [],
        }
    trainer = distributed_trainer(output_dir, model_path, save_strategy="steps", save_steps=SAVE_STEPS, **overrides)
    count_packed_forwards(trainer)
    original_loss = trainer_module.policy_objective

    def recording_loss(*args, **kwargs):
        out = original_loss(*args, **kwargs)  # the trainer's statistics, and their tokens
        advantages = args[3].reshape(out.mask.shape[0], -1).expand(out.mask.shape)
        trainer.records["steps"].append(
            {key: getattr(out, key) for key in ("ratio", "log_ratio", "per_token_kl", "mask")}
            | {"advantages": torch.where(out.mask, advantages, 0.0)}
            | {"policy_loss": out.policy_loss, "kl_penalty": out.kl_penalty}
        )
        return out

    trainer_module.policy_objective = recording_loss
    if kill_during_save_of is not None:
        die_while_saving(trainer, kill_during_save_of)
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
    trainer = distributed_trainer(
        output_dir, model_path, max_steps=NAN_STEP + 1, logging_steps=1, nonfinite_policy=policy
    )
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
    trainer = distributed_trainer(output_dir, model_path, lora=True, max_steps=2, learning_rate=5e-2)
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
    trainer = distributed_trainer(
        output_dir,
        model_path,
        trainer_kwargs=heldout_arguments(letter_a_metric),
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
    from trl_grpo_ext.tools.recipes import grpo as recipe  # what recipes/grpo.py runs

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


class RecordingTrainer(GRPOTrainerExt):
    """Records every batch that trains (this process's rows, decoded), the micro-batches and the training forward's
    rows."""

    records: dict

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            tokenizer = self.processing_class
            self.records["batches"].append(
                {
                    "prompts": tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True),
                    "completions": tokenizer.batch_decode(output["completion_ids"], skip_special_tokens=True),
                    "advantages": output["advantages"].cpu(),
                }
            )
        return output

    def _compute_loss(self, model, inputs):
        self.records["micro_batches"] += 1
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if torch.is_grad_enabled():
            self.records["forward_rows"].append(input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


def run_sampling(output_dir, model_path, reward_funcs, **overrides) -> dict:
    prompts = [f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "kite")] * 8
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(prompts),
        trainer_cls=RecordingTrainer,
        reward_funcs=reward_funcs,
        **{**TWO_PROCESSES, **overrides},
    )
    trainer.records = {"batches": [], "micro_batches": 0, "forward_rows": []}
    error = None
    try:
        trainer.train()
    except RuntimeError as raised:
        error = str(raised)
    engine = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "processes": trainer.accelerator.num_processes,
    }
    return {"log_history": trainer.state.log_history, "error": error, "engine": engine, **trainer.records}


def run_disagreeing(output_dir, model_path, **overrides) -> dict:
    """`run_sampling` where rank 1's keep/drop decisions are the opposite of what its rewards say."""
    original = sampling_plan.informative_groups

    def disagreeing(rewards, num_generations, original=original):
        flags = original(rewards, num_generations)
        return ~flags if RANK == 1 else flags

    sampling_plan.informative_groups = disagreeing
    try:
        return run_sampling(output_dir, model_path, reward_constant_on_some_prompts, **overrides)
    finally:
        sampling_plan.informative_groups = original


# The runs of selective rollouts and of dynamic sampling's round sizes, over `helpers.tiny_grpo_args`.
ROUNDS = dict(max_completion_length=6, num_iterations=2, beta=0.0, use_cpu=ENGINE != "deepspeed")
SELECTIVE = dict(selective_rollouts=True, dynamic_sampling=True, selective_rollouts_exploration=0.3)
# 3 rows per process and step, groups of 4: a group spans both processes.
SPANNING = dict(
    per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=8, dynamic_sampling_max_rounds=6
)
ROUND_PHASES = {
    "selective-checkpointed": dict(
        SELECTIVE,
        per_device_train_batch_size=16,
        max_steps=12,
        selective_rollouts_exploration_schedule=[0.05, 1.0, 0.1],
        selective_rollouts_target_zero_spread=0.1,
    ),
    "sizing-checkpointed": dict(per_device_train_batch_size=16, max_steps=12, dynamic_sampling=True),
    "selective": dict(SELECTIVE, **SPANNING),
    "selective-disagree": dict(SELECTIVE, **SPANNING),
    "sizing-spanning": dict(SPANNING, dynamic_sampling=True),
    "sizing-whole": dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=8,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=6,
    ),
}


def run_rounds(output_dir, model_path, phase: str, cli) -> dict:
    """A `ROUND_PHASES` run, recording the rows of every call of TRL's generation and the prompts of every round
    selective rollouts decided."""
    checkpointed = phase.endswith("-checkpointed")
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(["abc=", "hello=", "xyz=", "qq=", "kite=", "zz="] * 2),
        trainer_cls=RecordingTrainer,
        reward_funcs=half_constant_reward,  # what the tests score the batches with
        **ROUNDS,
        **ROUND_PHASES[phase],
        **(dict(save_strategy="steps", save_steps=cli.save_steps) if checkpointed else {}),
    )
    trainer.records = {"batches": [], "micro_batches": 0, "forward_rows": [], "stock_rows": [], "rounds": []}
    if checkpointed and cli.kill_during_save_of is not None:
        die_while_saving(trainer, cli.kill_during_save_of)
    if phase == "selective-disagree" and RANK == 1:
        judge = trainer._selective._judge

        def never_skip(prompts):
            keep, flat = judge(prompts)
            return [True] * len(keep), flat

        trainer._selective._judge = never_skip
    stock, observe = trl.GRPOTrainer._generate_and_score_completions, SelectiveRollouts.observe

    def counted(self, inputs):
        if self.model.training:
            trainer.records["stock_rows"].append(len(inputs))
        return stock(self, inputs)

    def observed(self, selection, informative):
        trainer.records["rounds"].append({"prompts": list(selection.prompts), "flags": informative.tolist()})
        return observe(self, selection, informative)

    trl.GRPOTrainer._generate_and_score_completions, SelectiveRollouts.observe = counted, observed
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if checkpointed and cli.resume else None)
    except RuntimeError as raised:
        if phase != "selective-disagree":
            raise
        error = str(raised)
    finally:
        trl.GRPOTrainer._generate_and_score_completions, SelectiveRollouts.observe = stock, observe
    engine = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "processes": trainer.accelerator.num_processes,
    }
    return {"log_history": trainer.state.log_history, "error": error, "engine": engine, **trainer.records}


def run_build(output_dir, model_path, use_cpu: bool) -> dict:
    """Builds the trainer in processes that see no GPU; with use_cpu=False accelerate runs each on its own."""
    trainer = make_trainer(output_dir, model_path, None, tiny_dataset(["abc=", "hello="] * 4), use_cpu=use_cpu)
    print(f"num_processes={trainer.accelerator.num_processes}", flush=True)
    check_launch(trainer.accelerator)  # (the trainer's constructor makes this check too)
    print("launch checked", flush=True)
    return {"num_processes": trainer.accelerator.num_processes}


def run_checkpointed(output_dir, model_path, cli) -> dict:
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(["abc=", "hello=", "xyz=", "qq=", "kite=", "zz="] * 20),
        reward_funcs=reward_constant_on_some_prompts if cli.dynamic_sampling else reward,
        peft_config=tiny_lora() if cli.lora else None,
        per_device_train_batch_size=8,
        learning_rate=5e-2 if cli.lora else 1e-2,
        max_steps=8,
        num_iterations=2,
        save_strategy="steps",
        save_steps=cli.save_steps,
        bf16=None,  # the config's default
        dynamic_sampling=cli.dynamic_sampling,
    )
    if cli.kill_during_save_of is not None:
        die_while_saving(trainer, cli.kill_during_save_of)
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    return {"log_history": trainer.state.log_history}


def run_logger(output_dir, model_path, report_to: str) -> dict:
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(["abc=", "hello=", "xyz=", "qq="] * 4),
        reward_funcs=count_a_reward,
        max_steps=2,
        num_iterations=2,
        report_to=[report_to],
        project="grpo-histograms",
        run_name="run-1",
        trackio_space_id=None,  # trackio's local store only (transformers 5.5.4 defaults to a Space)
    )
    trainer.train()
    return {"log_history": trainer.state.log_history}


def run_alerts(output_dir, model_path, report_to: str) -> dict:
    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        tiny_dataset(["abc=", "hello=", "xyz=", "qq="] * 4),
        reward_funcs=constant_reward,
        max_steps=2,
        max_completion_length=1,
        report_to=[report_to],
        project="grpo-alerts",
        run_name="run-1",
        trackio_space_id=None,  # trackio's local store only
    )
    trainer.train()
    alarms = sorted(episode.name for episode in trainer.callback_handler.callbacks[0].episodes)
    print("ALARMS", alarms)
    return {"alarms": alarms, "log_history": trainer.state.log_history}


def run_phase(phase: str, cli) -> dict:
    output_dir = os.path.join(cli.output_dir, phase)
    dynamic = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=6, per_device_train_batch_size=3, beta=0.0)
    if phase == "reference":
        return run_train(output_dir, cli.model_path)
    if phase == "padded":  # `reference` through TRL's padded forward
        return run_train(output_dir, cli.model_path, padding_free=False)
    if phase in ("crash", "resume"):
        output_dir = os.path.join(cli.output_dir, "run")
        kill = KILL_STEP if phase == "crash" else None
        return run_train(output_dir, cli.model_path, kill_during_save_of=kill, resume=phase == "resume")
    if phase in ("nan-skip", "nan-stop"):
        return run_nan(output_dir, cli.model_path, phase.removeprefix("nan-"))
    if phase == "lora":
        return run_lora(output_dir, cli.model_path)
    if phase == "heldout":
        return run_heldout(output_dir, cli.model_path)
    if phase == "recipe":
        return run_recipe(output_dir)
    if phase == "dynamic":
        return run_sampling(output_dir, cli.model_path, reward_constant_on_some_prompts, **dynamic)
    if phase in ("skip-whole", "skip"):
        return run_sampling(
            output_dir,
            cli.model_path,
            reward_constant_on_rank_1,
            beta=0.0,
            loss_type="dapo",
            skip_zero_advantage_rows=phase == "skip",
        )
    if phase == "disagree":
        return run_disagreeing(output_dir, cli.model_path, **dynamic)
    if phase in ROUND_PHASES:
        return run_rounds(output_dir, cli.model_path, phase, cli)
    if phase == "build":
        return run_build(output_dir, cli.model_path, cli.use_cpu == "true")
    if phase == "checkpointed":
        return run_checkpointed(output_dir, cli.model_path, cli)
    if phase == "logger":
        return run_logger(output_dir, cli.model_path, cli.report_to)
    if phase == "alerts":
        return run_alerts(output_dir, cli.model_path, cli.report_to)
    raise ValueError(f"unknown phase {phase!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("model_path")
    parser.add_argument("--phases", default="reference")
    # `build`
    parser.add_argument("--use_cpu", choices=["true", "false"], default="true")
    # `checkpointed` (`--save_steps`, `--kill_during_save_of`, `--resume` also the `*-checkpointed` phases)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--dynamic_sampling", action="store_true")
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--kill_during_save_of", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    # `logger`, `alerts`
    parser.add_argument("--report_to", default=None)
    cli = parser.parse_args()
    phases = cli.phases.split(",")
    torch.set_num_threads(1)
    if COUNTING_PHASES & set(phases):
        count_collectives()
    for phase in phases:
        result = run_phase(phase, cli)
        results_dir = os.path.join(cli.output_dir, phase)
        os.makedirs(results_dir, exist_ok=True)
        torch.save(result, os.path.join(results_dir, f"rank{RANK}.pt"))  # RANK: `recipe` ends the process group
    sys.stdout.flush()


if __name__ == "__main__":
    main()
