"""Held-out evaluation during training, independent of the reward (`heldout_metrics`): its checks, its schedule
(every `heldout_every_steps` optimizer steps) and its place in `evaluate()`. A pass samples and scores the held-out
prompts (`heldout_scoring`) with the trainer's model, unwrapped as TRL unwraps it for generation, or with its vLLM
engine after the current weights are synced as TRL syncs them (`sync_vllm_weights`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from trl.trainer.utils import get_callable_name

from ..config import option
from ..metrics import HELDOUT_PREFIX, heldout_metric
from .generation import SamplingSettings
from .heldout_scoring import heldout_records, pool_heldout_records

__all__ = ["HeldoutEvaluator", "prompt_options", "sync_vllm_weights"]

#: The `GRPOConfigExt` fields of the held-out evaluation.
HELDOUT_FIELDS = (
    "heldout_every_steps",
    "heldout_num_generations",
    "heldout_pass_at",
    "heldout_pass_threshold",
    "heldout_batch_size",
)


class _HeldoutSchedule(TrainerCallback):
    """Runs the held-out evaluation every `heldout_every_steps` optimizer steps; keeps its values for an evaluation at
    the same step."""

    def __init__(self, evaluator: HeldoutEvaluator):
        self.evaluator = evaluator

    def on_step_begin(self, args, state, control, **kwargs):
        self.evaluator.step_values = None

    def on_step_end(self, args, state, control, **kwargs):
        every = self.evaluator.options["heldout_every_steps"]
        if every and state.global_step % every == 0:
            self.evaluator.step_values = (state.global_step, self.evaluator.run())

    def on_train_end(self, args, state, control, **kwargs):
        self.evaluator.step_values = None


class HeldoutEvaluator:
    """Held-out evaluation for a `trl.GRPOTrainer`: the `heldout_metrics` and `heldout_dataset` arguments of
    `GRPOTrainerExt`, its `evaluate_heldout()` and the held-out part of its `evaluate()` (`eval_heldout/...`, which
    `metric_for_best_model` may name). With `eval_strategy` and no `eval_dataset`, an evaluation is the held-out pass
    alone (`stands_in_for_eval_dataset`). Built before the trainer, whose model its checks precede, then `attach`ed.

    Args:
        args (`trl.GRPOConfig`): the run's configuration.
        metrics (callable or list of callables, *optional*): the metric functions, named as TRL names reward functions.
        dataset (`datasets.Dataset`, *optional*): the held-out prompts; defaults to `eval_dataset`.
        eval_dataset: the trainer's `eval_dataset` argument.
    """

    def __init__(self, args, metrics=None, dataset=None, eval_dataset=None):
        self.options = {name: option(args, name) for name in HELDOUT_FIELDS}
        self.metrics = _named_metrics(metrics)
        if dataset is None and self.metrics and eval_dataset is not None:
            if not hasattr(eval_dataset, "column_names"):
                raise ValueError(
                    "heldout_metrics: the held-out prompts default to eval_dataset, which must then be one "
                    f"datasets.Dataset (got {type(eval_dataset).__name__}); pass heldout_dataset=..."
                )
            dataset = eval_dataset
        _check_heldout(args, self.options, self.metrics, dataset)
        self.dataset = dataset
        #: No `eval_dataset` but an `eval_strategy`: the held-out prompts are Trainer's eval_dataset (which it
        #: requires), never generated from by TRL.
        self.stands_in_for_eval_dataset = (
            bool(self.metrics) and eval_dataset is None and getattr(args, "eval_strategy", "no") != "no"
        )
        self.step_values: tuple[int, dict[str, float]] | None = None
        self._in_evaluate = False
        self.trainer = None

    def attach(self, trainer) -> None:
        """Evaluate for `trainer` (built with this evaluator's arguments) from now on."""
        self.trainer = trainer
        if self.metrics:
            trainer.add_callback(_HeldoutSchedule(self))

    def run(self, log: bool = True) -> dict[str, float]:
        """`GRPOTrainerExt.evaluate_heldout`: a pass now, on every process; its values, also logged with `log`."""
        if not self.metrics:
            raise ValueError("evaluate_heldout() needs heldout_metrics=[...] given to the trainer.")
        from trl.models import unwrap_model_for_generation

        trainer, options = self.trainer, self.options
        n = options["heldout_num_generations"]
        accelerator = trainer.accelerator
        sharded = trainer.is_fsdp_enabled or (
            trainer.is_deepspeed_enabled and accelerator.state.deepspeed_plugin.zero_stage == 3
        )
        arguments = dict(
            num_generations=n,
            threshold=options["heldout_pass_threshold"],
            batch_size=options["heldout_batch_size"],
            seed=trainer.args.seed,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
            metric_kwargs={"trainer_state": trainer.state},
            prompt_options=prompt_options(trainer),
        )
        settings = SamplingSettings.from_config(trainer.args)
        if trainer.use_vllm:
            sync_vllm_weights(trainer)
            # TRL's server mode (and a tensor-parallel group) pools the prompts of several processes in one request
            pooled = trainer.args.vllm_mode == "server" or trainer.args.vllm_tensor_parallel_size > 1
            records = heldout_records(
                trainer.model,
                trainer.processing_class,
                self.dataset,
                self.metrics,
                settings,
                vllm_generation=trainer.vllm_generation,
                equal_chunks=pooled and accelerator.num_processes > 1,
                **arguments,
            )
        else:
            dist = getattr(trainer, "_dist", None)  # TRL >= 1.16: FSDP1 needs its full parameters summoned
            summon = (
                dist.summon_full_params(trainer.model_wrapped, recurse=False) if dist is not None else nullcontext()
            )
            unwrap_options = {"gather_deepspeed3_params": trainer.args.ds3_gather_for_generation}
            if "gradient_checkpointing_kwargs" in inspect.signature(unwrap_model_for_generation).parameters:
                # It switches gradient checkpointing off for generation and on again after: with the run's own
                # settings (without them transformers re-enables it with use_reentrant=False whatever the run
                # configured).
                unwrap_options["gradient_checkpointing_kwargs"] = trainer.args.gradient_checkpointing_kwargs
            with unwrap_model_for_generation(trainer.model_wrapped, accelerator, **unwrap_options) as model, summon:
                records = heldout_records(
                    model,
                    trainer.processing_class,
                    self.dataset,
                    self.metrics,
                    settings,
                    synced_gpus=sharded and accelerator.num_processes > 1,
                    **arguments,
                )
            if trainer.is_fsdp_enabled:
                _reshard(trainer.model_wrapped)
        dtype = torch.float32 if accelerator.device.type == "mps" else torch.float64
        if accelerator.num_processes > 1:  # the evaluation's only collective
            records = accelerator.gather(records.to(accelerator.device, dtype))
        values = pool_heldout_records(records, list(self.metrics), n, options["heldout_pass_at"] or [n])
        if log:
            # An entry of its own: GRPOTrainer.log would flush the training metrics into it. Logging clears
            # `should_log`, which may still be due for this step's training metrics.
            should_log = trainer.control.should_log
            Trainer.log(trainer, dict(values))
            trainer.control.should_log = should_log
        return values

    def evaluate(self, stock: Callable, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """`Trainer.evaluate` (`stock`), with the held-out metrics among the returned (and logged) metrics."""
        if not self.metrics or self._in_evaluate:
            return stock(eval_dataset, ignore_keys, metric_key_prefix)
        trainer = self.trainer
        if self.step_values is not None and self.step_values[0] == trainer.state.global_step:
            values = self.step_values[1]  # the scheduled pass of this very step
        else:
            values = self.run()
        if self.stands_in_for_eval_dataset and eval_dataset is None:
            metrics = {f"{metric_key_prefix}_{name}": value for name, value in values.items()}
            trainer.control = trainer.callback_handler.on_evaluate(
                trainer.args, trainer.state, trainer.control, metrics
            )
            return metrics
        for name, value in values.items():  # TRL's log adds them, with its `eval_` prefix, to the evaluation's
            trainer._metrics["eval"][name].append(value)
        self._in_evaluate = True  # a dict of evaluation datasets comes back here once per dataset
        try:
            return stock(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._in_evaluate = False


def sync_vllm_weights(trainer) -> None:
    """Push the trainer's weights into its vLLM engine unless pushed at this optimizer step already, on every process
    (collective): a copy of TRL 1.16's check in `GRPOTrainer._generate_single_turn` (`_compat.TRL_COPIES`)."""
    if trainer.state.global_step != trainer._last_loaded_step:
        trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step


def prompt_options(trainer) -> dict:
    """The tools and chat template with which `trainer` renders conversational prompts (`tokenize_prompts`)."""
    return {"tools": getattr(trainer, "tools", None) or None, "chat_template": getattr(trainer, "chat_template", None)}


def _reshard(model) -> None:
    """Shard FSDP2 weights again after a held-out pass: FSDP2 keeps the root module's weights gathered after a forward
    until a backward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing to reshard
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _named_metrics(metrics) -> dict[str, Callable]:
    if metrics is None:
        return {}
    metrics = metrics if isinstance(metrics, (list, tuple)) else [metrics]
    named = {}
    for func in metrics:
        if not callable(func) or isinstance(func, (str, torch.nn.Module)):
            raise ValueError(
                f"heldout_metrics must be functions f(prompts, completions, **columns) -> list[float], got "
                f"{type(func).__name__} {func!r}."
            )
        name = get_callable_name(func)
        if name in named:
            raise ValueError(f"heldout_metrics: two metrics are named {name!r}; give them distinct names.")
        named[name] = func
    return named


def _check_heldout(config, options: dict[str, Any], metrics: dict, dataset) -> None:
    """Refuse, before any model is loaded, held-out settings that cannot run."""
    if not metrics:
        if options["heldout_every_steps"]:
            raise ValueError(
                f"heldout_every_steps={options['heldout_every_steps']} needs heldout_metrics=[...] (functions with "
                "the reward-function signature) given to the trainer."
            )
        best = getattr(config, "metric_for_best_model", None) or ""
        if best.removeprefix("eval_").startswith(HELDOUT_PREFIX):
            raise ValueError(f"metric_for_best_model={best!r} needs heldout_metrics=[...] given to the trainer.")
        return
    if dataset is None:
        raise ValueError("heldout_metrics needs held-out prompts: pass heldout_dataset=... (or eval_dataset=...).")
    if not hasattr(dataset, "column_names") or "prompt" not in dataset.column_names:
        raise ValueError(
            "heldout_dataset must be a datasets.Dataset with a 'prompt' column, got "
            f"{getattr(dataset, 'column_names', type(dataset).__name__)}."
        )
    if len(dataset) == 0:
        raise ValueError("heldout_dataset is empty.")
    n, pass_at = options["heldout_num_generations"], options["heldout_pass_at"] or []
    if any(k > n for k in pass_at):
        raise ValueError(
            f"heldout_pass_at={pass_at} needs heldout_num_generations >= {max(pass_at)} (got {n}): pass@k is "
            "estimated from at least k samples per prompt."
        )
    best = (getattr(config, "metric_for_best_model", None) or "").removeprefix("eval_")
    if best.startswith(HELDOUT_PREFIX):
        logged = [heldout_metric(name, "mean", n) for name in metrics]
        logged += [heldout_metric(name, "pass", k) for name in metrics for k in (pass_at or [n])]
        if best not in logged:
            raise ValueError(
                f"metric_for_best_model={config.metric_for_best_model!r} is not among the held-out metrics this run "
                f"logs ({', '.join(logged)}): with heldout_num_generations={n}, the mean is mean@{n} and pass@k takes "
                f"the k of heldout_pass_at ({pass_at or [n]})."
            )
