"""`GRPOTrainerExt`: TRL's `GRPOTrainer` whose loss is `trl_grpo_ext.grpo_loss`.

Generation, rewards, advantages, reference log-probs, PEFT and distributed training are TRL's, unchanged. TRL options
that the loss does not implement are refused at construction instead of being silently ignored. Each override
wires one module in and otherwise defers to TRL:

- `_compute_loss`: the loss (`loss.py`, `fused.py`) and the per-micro-batch diagnostics sums (`diagnostics.py`);
- `_calculate_rewards`: the per-group reward spread; `log`: the one gather of the diagnostics per log step;
- `_get_grad_norm`: the non-finite guard (`guardrails.py`);
- `_save_checkpoint`, `_load_optimizer_and_scheduler`: crash-safe checkpoints and exact resume (`checkpointing.py`);
- `create_model_card`: the model card and `report.png` (`model_card.py`, `report.py`).
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_callable_name, get_config_model_id, is_async_callable

from ._compat import options_missing_from_trl, seed_before_model_init
from .checkpointing import STAGING_DIR, load_grpo_state, publish_checkpoint, save_grpo_state
from .config import GRPOConfigExt, invalid_hyperparameters
from .diagnostics import DiagnosticsAccumulator
from .guardrails import AnomalyMonitor, GuardedAsyncReward, GuardedReward, NonFiniteGuard, NonFiniteTrainingError
from .loggers import write_histograms
from .loss import grpo_loss
from .model_card import CARD_CONFIG_FIELDS, build_model_card, final_metrics

logger = logging.get_logger(__name__)

__all__ = ["GRPOTrainerExt", "unsupported_options"]

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


def unsupported_options(args: GRPOConfig) -> list[str]:
    """The TRL 1.16 options set in `args` that `GRPOTrainerExt`'s loss does not implement, each with its fix.

    Args:
        args (`trl.GRPOConfig`): the training configuration.

    Returns:
        `list[str]`: one message per unsupported option; empty when the configuration is supported.
    """
    problems = []
    if args.loss_type != "grpo":
        problems.append(
            f"loss_type={args.loss_type!r}: only 'grpo' (per-sequence length normalisation) is implemented; "
            "set loss_type='grpo'."
        )
    if args.importance_sampling_level != "token":
        problems.append(
            f"importance_sampling_level={args.importance_sampling_level!r}: the objective uses token-level ratios; "
            "set importance_sampling_level='token'."
        )
    if args.top_entropy_quantile != 1.0:
        problems.append(
            f"top_entropy_quantile={args.top_entropy_quantile}: entropy-based token masking is not part of the "
            "objective; set top_entropy_quantile=1.0."
        )
    if args.off_policy_mask_threshold is not None:
        problems.append(
            f"off_policy_mask_threshold={args.off_policy_mask_threshold}: off-policy sequence masking is not part of "
            "the objective; set off_policy_mask_threshold=None."
        )
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        problems.append(
            f"entropy_coef={args.entropy_coef}, use_adaptive_entropy={args.use_adaptive_entropy}: an entropy bonus is "
            "not part of the objective; set entropy_coef=0.0 and use_adaptive_entropy=False."
        )
    if args.delta is not None:
        problems.append(
            f"delta={args.delta}: two-sided clipping of the ratio is not part of the objective; set delta=None."
        )
    if args.use_bias_correction_kl and args.beta != 0.0:
        problems.append(
            "use_bias_correction_kl=True: the objective's KL estimator exp(d) - d - 1 is not multiplied by the "
            "importance ratio; set use_bias_correction_kl=False."
        )
    if args.use_vllm and args.vllm_importance_sampling_correction:
        problems.append(
            "use_vllm=True with vllm_importance_sampling_correction=True: the vLLM/trainer importance-sampling "
            "correction is not part of the objective; set vllm_importance_sampling_correction=False."
        )
    if args.scale_rewards not in ("group", "none"):
        problems.append(
            f"scale_rewards={args.scale_rewards!r}: advantages are normalised inside each group; set "
            "scale_rewards='group' (or 'none' to only centre them)."
        )
    if args.multi_objective_aggregation != "sum_then_normalize":
        problems.append(
            f"multi_objective_aggregation={args.multi_objective_aggregation!r}: advantages are computed from the "
            "weighted sum of the rewards, per group; set multi_objective_aggregation='sum_then_normalize'."
        )
    return problems


class GRPOTrainerExt(GRPOTrainer):
    """[`trl.GRPOTrainer`] that trains with [`grpo_loss`]: the documents' GRPO objective.

    Takes the same arguments as `trl.GRPOTrainer`. `args` defaults to a [`GRPOConfigExt`]; a plain `trl.GRPOConfig`
    is accepted if it only sets options this trainer implements (`loss_type="grpo"`, no entropy bonus, ...).
    With `peft_config=LoraConfig(...)` only the adapter is trained, and the reference log-probs come from the same
    model with its adapters disabled.

    Besides TRL's metrics it logs the diagnostics of `diagnostics.py` (ratio distribution, per-group reward spread,
    loss split), keeps non-finite updates off the weights, warns about anomalies, names failing reward functions,
    writes crash-safe checkpoints that resume exactly, and writes a model card with a training report.

    Raises:
        ValueError: at construction, listing every TRL option set in `args` that this loss does not implement, with
            the value to use instead; also for invalid `epsilon`/`epsilon_high`/`beta`, an empty training set, or
            one without a `prompt` column.
    """

    _tag_names = ["trl", "grpo", "trl_grpo_ext"]

    #: Extra rows for the model card's metrics table (e.g. held-out accuracy measured by a recipe).
    card_metrics: dict[str, float] | None = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfigExt(f"{model_name.split('/')[-1]}-GRPO")
        problems = unsupported_options(args)
        if problems:
            raise ValueError(
                f"{type(self).__name__} computes the GRPO loss of trl_grpo_ext.grpo_loss and cannot honour these "
                "options:\n- " + "\n- ".join(problems)
            )
        problems = invalid_hyperparameters(args) + options_missing_from_trl(args)
        if problems:
            raise ValueError(" ".join(problems))
        _check_train_dataset(kwargs.get("train_dataset"), kwargs.get("environment_factory"))
        seed_before_model_init(args)
        super().__init__(model, _guard_reward_funcs(reward_funcs), args=args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                f"{type(self).__name__} does not add the Mixture-of-Experts load-balancing loss "
                f"(router_aux_loss_coef={self.router_aux_loss_coef}); set router_aux_loss_coef=0.0."
            )

        def option(name):  # a plain trl.GRPOConfig has none of the extra fields: GRPOConfigExt's defaults then
            return getattr(args, name, GRPOConfigExt.__dataclass_fields__[name].default)

        self._diagnostics = {
            mode: DiagnosticsAccumulator(
                ratio_stats=option("log_diagnostics"),
                quantiles=getattr(args, "ratio_quantiles", None),
                histograms=option("log_histograms"),
            )
            for mode in ("train", "eval")
        }
        self._loss_implementation = option("loss_implementation")
        self._nonfinite_guard = NonFiniteGuard(option("nonfinite_policy"), option("max_nonfinite_skips"))
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
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logps, entropies = self._policy_logps_and_entropies(model, inputs)
        out = grpo_loss(
            logps,
            inputs.get("old_per_token_logps"),
            inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            inputs["advantages"],
            mask,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            implementation=self._loss_implementation,
        )
        mode = "train" if self.model.training else "eval"
        self._diagnostics[mode].add_loss_step(out, entropies)
        # TRL sets `loss_is_scaled_for_ga`: the trainer, not Trainer, divides by the accumulation steps.
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return out.loss / normalizer

    def _policy_logps_and_entropies(self, model, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs `(N, T)` (with gradient) and entropies `(N, T)` of the completion tokens."""
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        return logps, entropies

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm of the step about to be taken, and the non-finite guard's decision on it."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self._nonfinite_guard.policy == "off" or grad_norm is None:
            return grad_norm
        # The norm is global (gradients are already reduced across processes): every process decides alike.
        decision = self._nonfinite_guard.decide(math.isfinite(float(grad_norm)))
        if decision == "step":
            return grad_norm
        # Optimizers leave parameters without a gradient untouched: no update, no momentum, no weight decay.
        model.zero_grad(set_to_none=True)
        step = self.state.global_step + 1
        if decision == "skip" and not self.is_deepspeed_enabled:
            logger.warning(
                f"Step {step}: the gradient norm is {grad_norm}; the update is skipped "
                f"({self._nonfinite_guard.skipped} skipped so far, nonfinite_policy='skip')."
            )
            return grad_norm
        self._save_checkpoint(self.model_wrapped, trial=None)
        checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        raise NonFiniteTrainingError(
            f"Step {step}: the gradient norm is {grad_norm} (a NaN or infinite loss or gradient"
            + (f", {self._nonfinite_guard.consecutive} steps in a row" if self._nonfinite_guard.consecutive else "")
            + f"). Training stopped before the update reached the weights; the last good state is in {checkpoint}. "
            "Lower the learning rate, check the rewards and inputs for NaN, or set nonfinite_policy='skip'."
        )

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

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into a staging folder and give it its final name only once it is complete."""
        final_run_dir = self._get_output_dir(trial=trial)
        staging_run_dir = os.path.join(final_run_dir, STAGING_DIR)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging_run_dir, ignore_errors=True)  # left over by a process killed while saving
        self.accelerator.wait_for_everyone()
        # Trainer writes `<run dir>/checkpoint-<step>`; pointing the run dir at the staging folder for the
        # duration of the save is the narrowest way to redirect it without rewriting Trainer's save logic.
        self._get_output_dir = lambda trial=None: staging_run_dir
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        staged = os.path.join(staging_run_dir, folder)
        os.makedirs(staged, exist_ok=True)
        save_grpo_state(staged, self.accelerator.process_index, self._step, self._buffered_inputs)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = os.path.join(final_run_dir, folder)
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

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state = load_grpo_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
        if state is not None:
            # Resume TRL's generation schedule where the checkpoint left it, with the completions it had buffered.
            self._step = state["step"]
            self._buffered_inputs = state["buffered_inputs"]


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
