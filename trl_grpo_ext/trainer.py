"""`GRPOTrainerExt`: TRL's `GRPOTrainer` whose loss is this package's.

Generation, rewards, advantages, reference log-probs, PEFT and distributed training are TRL's, unchanged. Every TRL
option of the loss is honoured as stock TRL honours it. Each override wires one module in and otherwise defers to
TRL:

- `_compute_loss`: the loss (`grpo_loss` of `loss.py` and `fused.py` for the documents' objective, otherwise
  `objectives.py` with the inputs `variants.py` takes from TRL's options) and the per-micro-batch diagnostics sums
  (`diagnostics.py`);
- `_calculate_rewards`: the per-group reward spread; `_generate_and_score_completions`: the sampler/trainer mismatch
  behind vLLM's importance-sampling correction; `log`: the one gather of the diagnostics per log step;
- `training_step`, `_get_grad_norm`: the non-finite guard (`guardrails/nonfinite.py`), with the state at the start of
  each step kept by a callback (`_StepStartCallback`) for the checkpoint of a stopped step;
- `_save_checkpoint`, `_get_output_dir`, `_push_from_checkpoint`, `_load_optimizer_and_scheduler`: crash-safe
  checkpoints that are uploaded once complete, and exact resume (`checkpointing.py`);
- `create_model_card`: the model card and `report.png` (`model_card.py`, `report.py`).
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_callable_name, get_config_model_id, is_async_callable

from ._compat import options_missing_from_trl, seed_before_model_init
from .checkpointing import STAGING_DIR, StepStart, load_grpo_state, publish_checkpoint, save_grpo_state
from .config import GRPOConfigExt
from .diagnostics import DiagnosticsAccumulator
from .guardrails import AnomalyMonitor, GuardedAsyncReward, GuardedReward, NonFiniteGuard, NonFiniteTrainingError
from .guardrails.nonfinite import report_step_skipped
from .loggers import write_histograms
from .loss import grpo_loss, hyperparameter_problems
from .model_card import CARD_CONFIG_FIELDS, build_model_card, final_metrics
from .objectives import policy_objective
from .variants import (
    aggregation_denominator,
    clip_metrics_of,
    entropy_bonus,
    is_window_aggregation,
    policy_weights,
    uses_grpo_loss,
)

logger = logging.get_logger(__name__)

__all__ = ["GRPOTrainerExt"]

# Extra model inputs that TRL's batches may carry (vision-language models); forwarded untouched.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class GRPOTrainerExt(GRPOTrainer):
    """[`trl.GRPOTrainer`] whose loss is this package's: the documents' GRPO objective by default, every TRL option
    honoured.

    Takes the same arguments as `trl.GRPOTrainer`. `args` defaults to a [`GRPOConfigExt`] (the documents' objective,
    computed by the fused [`grpo_loss`]); with a plain `trl.GRPOConfig`, or any TRL option set (every `loss_type`,
    sequence-level importance sampling, `delta`, entropy masking and bonus, off-policy masking, the KL bias
    correction, vLLM's importance-sampling correction, the Mixture-of-Experts router loss, batch reward scaling,
    normalise-then-sum), it trains step for step like stock TRL, with `objectives.policy_objective`.
    With `peft_config=LoraConfig(...)` only the adapter is trained, and the reference log-probs come from the same
    model with its adapters disabled.

    Besides TRL's metrics it logs the diagnostics of `diagnostics.py` (ratio distribution, per-group reward spread,
    loss split), keeps non-finite updates off the weights, warns about anomalies, names failing reward functions,
    writes crash-safe checkpoints that resume exactly, and writes a model card with a training report.

    Raises:
        ValueError: at construction, for invalid `epsilon`/`epsilon_high`/`beta`, an empty training set, or one
            without a `prompt` column.
    """

    _tag_names = ["trl", "grpo", "trl_grpo_ext"]

    #: Extra rows for the model card's metrics table (e.g. held-out accuracy measured by a recipe).
    card_metrics: dict[str, float] | None = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfigExt(f"{model_name.split('/')[-1]}-GRPO")
        problems = hyperparameter_problems(args.epsilon, args.epsilon_high, args.beta) + options_missing_from_trl(args)
        if problems:
            raise ValueError(" ".join(problems))
        _check_train_dataset(kwargs.get("train_dataset"), kwargs.get("environment_factory"))
        seed_before_model_init(args)
        super().__init__(model, _guard_reward_funcs(reward_funcs), args=args, **kwargs)

        def option(name):  # a plain trl.GRPOConfig has none of the extra fields: GRPOConfigExt's defaults then
            return getattr(args, name, GRPOConfigExt.__dataclass_fields__[name].default)

        self._uses_grpo_loss = uses_grpo_loss(args)
        loss_terms = ("policy", "kl_penalty")
        loss_terms += ("entropy_bonus",) if self._entropy_bonus_enabled else ()
        loss_terms += ("router",) if self.aux_loss_enabled else ()
        extra_metrics = ("policy_loss",) if self._entropy_bonus_enabled else ()  # TRL logs it with a bonus only
        extra_metrics += ("aux_loss",) if self.aux_loss_enabled else ()
        extra_metrics += ("vespo/phi_seq_mean",) if self.loss_type == "vespo" else ()
        self._diagnostics = {
            mode: DiagnosticsAccumulator(
                ratio_stats=option("log_diagnostics"),
                quantiles=getattr(args, "ratio_quantiles", None),
                histograms=option("log_histograms"),
                clip_metrics=clip_metrics_of(self.loss_type),
                loss_terms=loss_terms,
                extra_metrics=extra_metrics,
                sampler_mismatch=self.use_vllm and self.vllm_importance_sampling_correction,
            )
            for mode in ("train", "eval")
        }
        self._loss_implementation = option("loss_implementation")
        self._nonfinite_guard = NonFiniteGuard(option("nonfinite_policy"), option("max_nonfinite_skips"))
        self._step_start: StepStart | None = None
        self._saving_into_staging = False
        if self._nonfinite_guard.policy != "off":
            self.add_callback(_StepStartCallback(self))
        if option("warn_on_anomalies"):
            self.add_callback(
                AnomalyMonitor(
                    zero_std_fraction=option("warn_zero_std_fraction"),
                    clip_fraction=option("warn_clip_fraction"),
                    ratio_p95=option("warn_ratio_p95"),
                    ratio_max=option("warn_ratio_max"),
                    kl_jump=option("warn_kl_jump"),
                    patience=option("warn_patience"),
                )
            )

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logps, entropies, aux_loss = self._policy_logps_and_entropies(model, inputs)
        ref_logps = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        # TRL sets `loss_is_scaled_for_ga`: the trainer, not Trainer, divides by the accumulation steps.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        extras = {}
        entropy_mask = None
        if self._uses_grpo_loss:
            out = grpo_loss(
                logps,
                inputs.get("old_per_token_logps"),
                ref_logps,
                inputs["advantages"],
                mask,
                epsilon=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                beta=self.beta,
                implementation=self._loss_implementation,
            )
        else:
            token_weights, entropy_mask, sequence_weights = policy_weights(self, inputs, logps, entropies, mask)
            out = policy_objective(
                logps,
                inputs.get("old_per_token_logps"),
                ref_logps,
                inputs["advantages"],
                mask,
                loss_type=self.loss_type,
                importance_sampling_level=self.importance_sampling_level,
                epsilon=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                delta=self.args.delta,
                beta=self.beta,
                use_bias_correction_kl=self.args.use_bias_correction_kl,
                sapo_temperature_pos=self.args.sapo_temperature_pos,
                sapo_temperature_neg=self.args.sapo_temperature_neg,
                sequence_weights=sequence_weights,
                token_weights=token_weights,
                denominator=aggregation_denominator(self, inputs, logps.size(0), mode),
            )
            if sequence_weights is not None:
                extras["vespo/phi_seq_mean"] = (sequence_weights.sum(), sequence_weights.numel())
        # Window-level aggregations already divide by the window's tokens; the others are per micro-batch.
        unscaled = accumulation if is_window_aggregation(self.loss_type) else 1.0
        loss = out.loss * unscaled / accumulation
        # Each term in the units of the logged `loss`, so that they add up to it.
        terms = {"policy": out.policy_loss * unscaled, "kl_penalty": out.kl_penalty * unscaled}
        if self._entropy_bonus_enabled:
            extras["policy_loss"] = (out.loss.detach(), 1)  # as TRL logs it: the loss before the bonus
            coef, mean_entropy = entropy_bonus(self, entropies, mask, entropy_mask, mode)
            loss = loss - coef * mean_entropy / accumulation
            terms["entropy_bonus"] = -coef * mean_entropy.detach()
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            terms["router"] = self.router_aux_loss_coef * aux_loss.detach()
            extras["aux_loss"] = (aux_loss, 1)
        self._diagnostics[mode].add_loss_step(out, entropies, loss_terms=terms, extras=extras)
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._nonfinite_guard.record_loss(loss)  # the loss that went into backward, judged at the optimizer step
        return loss

    def _policy_logps_and_entropies(self, model, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Per-token log-probs `(N, T)` (with gradient) and entropies `(N, T)` of the completion tokens, and the
        Mixture-of-Experts router loss (0-dim, `None` unless `aux_loss_enabled`)."""
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm of the step about to be taken, and the non-finite guard's verdict on it."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        guard = self._nonfinite_guard
        losses_finite = guard.pop_losses_finite()
        if guard.policy == "off" or grad_norm is None:
            return grad_norm

        def any_loss_nonfinite() -> bool:  # one collective, reached by every process alike (see `judge`)
            flag = torch.ones((), device=self.accelerator.device) if losses_finite is None else losses_finite.float()
            return bool(self.accelerator.reduce(1.0 - flag, reduction="sum").item() > 0)

        deepspeed = self.is_deepspeed_enabled
        # The norm is global (gradients are already reduced across processes): every process decides alike.
        verdict = guard.judge(
            math.isfinite(float(grad_norm)),
            loss_scaled=self.accelerator.scaler is not None or (deepspeed and self.args.fp16),
            engine_stepped=deepspeed,
            engine_skipped=deepspeed and self.accelerator.optimizer_step_was_skipped,
            any_loss_nonfinite=any_loss_nonfinite,
        )
        own_skip_flag = not deepspeed and self.accelerator.scaler is None
        if own_skip_flag:
            report_step_skipped(self.optimizer, verdict.action == "skip")
        if verdict.action in ("step", "overflow"):
            return grad_norm
        step = self.state.global_step + 1
        if verdict.action == "skip":
            if own_skip_flag:
                # Optimizers leave parameters without a gradient untouched: no update, no momentum, no weight decay.
                model.zero_grad(set_to_none=True)
            # Otherwise the engine already skipped it, or the gradient scaler will: its gradients are non-finite.
            logger.warning(
                f"Step {step}: the gradient norm is {float(grad_norm)}; the update is skipped "
                f"({guard.skipped} skipped so far, nonfinite_policy='skip')."
            )
            return grad_norm
        if not deepspeed:  # the engine drops the gradients itself (and its `zero_grad` takes no `set_to_none`)
            model.zero_grad(set_to_none=True)
        self._stop_on_nonfinite_step(step, float(grad_norm), applied=verdict.applied)  # FSDP2: a DTensor

    def _stop_on_nonfinite_step(self, step: int, grad_norm: float, applied: bool) -> None:
        """Raise `NonFiniteTrainingError`, naming a checkpoint of the state before this step (written if missing)."""
        run_dir = self._get_output_dir(trial=None)
        cause = f"Step {step}: the gradient norm is {grad_norm} (a NaN or infinite loss or gradient"
        if self._nonfinite_guard.consecutive:
            cause += f", {self._nonfinite_guard.consecutive} steps in a row"
        if applied:
            last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
            raise NonFiniteTrainingError(
                f"{cause}). The DeepSpeed engine applied this update inside backward without skipping it, so the "
                f"weights in memory are no longer good; resume from the last checkpoint ({last or 'none was saved'}). "
                'Turn the engine\'s overflow check on (bf16: "check_grad_overflow": true) so that such steps are '
                "skipped, lower the learning rate, or check the rewards and inputs for NaN."
            )
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not os.path.isdir(checkpoint):  # an existing one holds this very state already, and is never rewritten
            if self._step_start is not None:
                self._step = self._step_start.step
                self._buffered_inputs = self._step_start.buffered_inputs
                self._step_start.restore_rng()
            self._save_checkpoint(self.model_wrapped, trial=None)
        raise NonFiniteTrainingError(
            f"{cause}). Training stopped before the update reached the weights; the last good state is in "
            f"{checkpoint}. Lower the learning rate, check the rewards and inputs for NaN, or set "
            "nonfinite_policy='skip'."
        )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if "importance_sampling_ratio" in output and "sampling_per_token_logps" in output:
            mode = "train" if self.model.training else "eval"
            self._diagnostics[mode].add_sampler_mismatch(*self._sampler_mismatch(output))
        return output

    def _sampler_mismatch(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw sampler/trainer log ratios behind vLLM's importance-sampling correction, the entries that count,
        and those outside its bounds (truncated or masked), as `DiagnosticsAccumulator.add_sampler_mismatch` takes
        them."""
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        difference = torch.where(mask, output["old_per_token_logps"] - output["sampling_per_token_logps"], 0.0)
        difference = torch.nan_to_num(difference, nan=0.0)  # tokens the sampler could not score: no correction
        if self.vllm_importance_sampling_mode.startswith("sequence"):
            difference, units = difference.sum(dim=-1, keepdim=True), torch.ones_like(mask[:, :1])
        else:
            units = mask
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        ratio = torch.exp(difference)
        outside = torch.zeros_like(units)
        if low is not None:
            outside = outside | (ratio < low)
        if high is not None:
            outside = outside | (ratio > high)
        return difference, units, outside

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        # The total reward TRL builds its advantages from; rows that no function scored stay NaN.
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, rewards)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        self._diagnostics[mode].add_rewards(rewards, num_generations)
        return rewards_per_func

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        accumulator = self._diagnostics[mode]
        packed = accumulator.pack()
        # The diagnostics' only collective: every process's sums since the last log, in one gather.
        gathered = self.accelerator.gather(packed[None]) if packed is not None else None
        summary = accumulator.summarize(gathered)
        if self.beta == 0.0:
            summary.per_step.pop("kl", None)
        for name, values in summary.per_step.items():
            self._metrics[mode][name].extend(values)
        for name, value in summary.scalars.items():
            self._metrics[mode][name].append(value)
        if mode == "train" and self._nonfinite_guard.policy != "off" and "loss" in logs:
            self._metrics[mode]["nonfinite/skipped_steps"].append(self._nonfinite_guard.skipped)
        super().log(logs, start_time)
        if summary.histograms and self.accelerator.is_main_process:
            write_histograms(self.callback_handler, summary.histograms, mode, self.state.global_step)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        """Write `README.md` (a Hub model card) and `report.png` (training curves) into `args.output_dir`.

        Called by `Trainer.push_to_hub` and at every checkpoint, like TRL's own card, which it replaces: front matter
        with `library_name`, `base_model` (when it is a Hub id), tags (`trl`, `grpo`, `trl_grpo_ext`, and `lora` for
        adapters); the objective; the training configuration; the final metrics; the report image; usage.
        """
        if not self.is_world_process_zero():
            return
        from peft import PeftModel

        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model_id = get_config_model_id(self.model.config)
        base_model = model_id if model_id and not os.path.isdir(model_id) else None
        is_adapter = isinstance(self.accelerator.unwrap_model(self.model), PeftModel)
        report = None
        try:
            from .report import plot_training_report

            report = plot_training_report(
                self.state.log_history,
                os.path.join(output_dir, "report.png"),
                title=model_name,
                clip_range=(self.epsilon_low, self.epsilon_high),
            )
        except ImportError:
            logger.warning("matplotlib is not installed: no report.png (pip install 'trl-grpo-ext[recipes]').")
        lora = None
        if is_adapter:
            peft_config = self.accelerator.unwrap_model(self.model).peft_config["default"]
            lora = {
                "r": getattr(peft_config, "r", None),
                "alpha": getattr(peft_config, "lora_alpha", None),
                "target_modules": sorted(peft_config.target_modules)
                if isinstance(peft_config.target_modules, (set, list))
                else peft_config.target_modules,
            }
        card = build_model_card(
            model_name=model_name or os.path.basename(os.path.normpath(output_dir)),
            base_model=base_model,
            is_adapter=is_adapter,
            config={key: getattr(self.args, key, None) for key in CARD_CONFIG_FIELDS},
            metrics=final_metrics(self.state.log_history),
            extra_metrics=self.card_metrics,
            tags=[tags] if isinstance(tags, str) else tags,
            dataset_name=dataset_name,
            hub_model_id=self.hub_model_id,
            report_image="report.png" if report else None,
            lora=lora,
        )
        with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)

    def _get_output_dir(self, trial) -> str:
        """Trainer's run folder; while a checkpoint is being written, its staging folder inside it."""
        run_dir = super()._get_output_dir(trial=trial)
        return os.path.join(run_dir, STAGING_DIR) if self._saving_into_staging else run_dir

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Trainer asks for the upload from inside its save, i.e. of the staging folder, which is renamed right after;
        # `_save_checkpoint` asks again with the published folder once it is complete.
        if not self._saving_into_staging:
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into a staging folder, give it its final name once complete, then upload it."""
        final_run_dir = self._get_output_dir(trial=trial)
        staging_run_dir = os.path.join(final_run_dir, STAGING_DIR)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging_run_dir, ignore_errors=True)  # left over by a process killed while saving
        self.accelerator.wait_for_everyone()
        # Trainer's and TRL's save code write to `<self._get_output_dir()>/checkpoint-<step>`: the staging folder.
        self._saving_into_staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_into_staging = False
        staged = os.path.join(staging_run_dir, folder)
        os.makedirs(staged, exist_ok=True)
        save_grpo_state(staged, self.accelerator.process_index, self._step, self._buffered_inputs)
        self.accelerator.wait_for_everyone()
        final = os.path.join(final_run_dir, folder)
        if self.args.should_save:
            publish_checkpoint(staged, final)
            shutil.rmtree(staging_run_dir, ignore_errors=True)
            if self.state.best_model_checkpoint and STAGING_DIR in self.state.best_model_checkpoint:
                self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(
                    os.path.join(STAGING_DIR, ""), ""
                )
            rotate_checkpoints(
                output_dir=final_run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state = load_grpo_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
        if state is not None:
            # Resume TRL's generation schedule where the checkpoint left it, with the completions it had buffered.
            self._step = state["step"]
            self._buffered_inputs = state["buffered_inputs"]


class _StepStartCallback(TrainerCallback):
    """Keeps, at the start of every optimizer step, what a checkpoint of the state before that step needs."""

    def __init__(self, trainer: GRPOTrainerExt):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._step_start = StepStart(self.trainer._step, self.trainer._buffered_inputs)


def _check_train_dataset(train_dataset, environment_factory) -> None:
    """Refuse, before any model is loaded, a training set that cannot produce a batch."""
    from datasets import Dataset

    if not isinstance(train_dataset, Dataset):
        return  # an IterableDataset cannot be checked without reading it; None is TRL's to judge
    if len(train_dataset) == 0:
        raise ValueError("`train_dataset` is empty: GRPO needs at least one prompt.")
    if environment_factory is None and "prompt" not in train_dataset.column_names:
        raise ValueError(
            f"`train_dataset` has no 'prompt' column (its columns are {train_dataset.column_names}); rename the "
            "column holding the prompts to 'prompt'."
        )


def _guard_reward_funcs(reward_funcs):
    """Wrap callable reward functions so that their errors name the function and the failing completion."""
    if reward_funcs is None:
        return None
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    guarded = []
    for func in funcs:
        if isinstance(func, (str, torch.nn.Module)) or not callable(func) or isinstance(func, GuardedReward):
            guarded.append(func)
        elif is_async_callable(func):
            guarded.append(GuardedAsyncReward(func, get_callable_name(func)))
        else:
            guarded.append(GuardedReward(func, get_callable_name(func)))
    return guarded
