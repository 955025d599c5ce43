"""`GRPOTrainerExt`: TRL's `GRPOTrainer` whose loss is this package's.

Generation, rewards, advantages, reference log-probs, PEFT and distributed training are TRL's, unchanged. This
module wires the loss and the diagnostics in; each other concern is mixed in from its own module:

- `_compute_loss`: the objective's inputs from TRL's state (`objective_inputs.gather_objective_inputs`, one
  dataclass in final units), the loss (`ops.policy_objective`), the extra terms (TRL's entropy bonus, the router
  loss) and the per-micro-batch diagnostics sums (`diagnostics`);
- `_calculate_rewards`: the per-group reward spread and length/reward correlation;
  `_generate_and_score_completions`: the sampler/trainer mismatch with vLLM, with or without its importance-sampling
  correction; `log`: the one gather of the diagnostics per log step;
- `HeldoutEvaluationMixin` (`heldout.py`): `evaluate`, `evaluate_heldout` and the `heldout_metrics`,
  `heldout_dataset` arguments;
- `NonFiniteGuardMixin` (`guardrails/nonfinite.py`): `training_step`, `_get_grad_norm`;
- `CheckpointingMixin` (`checkpointing.py`): `_save_checkpoint`, `_get_output_dir`, `_push_from_checkpoint`,
  `_load_optimizer_and_scheduler`;
- `ModelCardMixin` (`model_card.py`): `create_model_card`;
- `DynamicSamplingMixin` (`dynamic_sampling.py`): with `dynamic_sampling`, `_generate_and_score_completions`
  replaces the groups without reward spread by informative groups of fresh prompts;
- `EntropyBonusMixin` (`objective_inputs.py`): TRL's entropy bonus and its adaptive controller;
- `ZeroAdvantageRowSkipping` (`skipping.py`): with `skip_zero_advantage_rows`, `_compute_loss` trains only the rows
  that can move the loss, with the whole micro-batch's denominators.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_callable_name, get_config_model_id, is_async_callable

from ._compat import FORWARD_KEYS, options_missing_from_trl, seed_before_model_init
from .card_config import user_lora_settings
from .checkpointing import CheckpointingMixin
from .config import GRPOConfigExt
from .diagnostics import DiagnosticsAccumulator
from .diagnostics.loggers import write_histograms
from .diagnostics.mismatch import sampler_mismatch, trainer_logps, truncation_warning
from .dynamic_sampling import DynamicSamplingMixin
from .guardrails import AnomalyMonitor, GuardedAsyncReward, GuardedReward, NonFiniteGuardMixin
from .heldout import HeldoutEvaluationMixin
from .launch import check_launch
from .model_card import ModelCardMixin
from .objective_inputs import EntropyBonusMixin, fused_kernel_problems, gather_objective_inputs
from .ops import LOSS_TYPES, hyperparameter_problems, policy_objective
from .skipping import ZeroAdvantageRowSkipping, skipping_problems

logger = logging.get_logger(__name__)

__all__ = ["GRPOTrainerExt"]

_TRL_PARAMETERS = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]  # without `self`


class GRPOTrainerExt(
    HeldoutEvaluationMixin,
    ModelCardMixin,
    DynamicSamplingMixin,
    NonFiniteGuardMixin,
    CheckpointingMixin,
    EntropyBonusMixin,
    GRPOTrainer,
):
    """[`trl.GRPOTrainer`] whose loss is this package's: the documents' GRPO objective by default, every TRL option
    honoured.

    Takes the same arguments as `trl.GRPOTrainer`, by position or by name. `args` defaults to a [`GRPOConfigExt`]
    (the documents' objective); with a plain `trl.GRPOConfig`, or any TRL option set (every `loss_type`,
    sequence-level importance sampling, `delta`, entropy masking and bonus, off-policy masking, the KL bias
    correction, vLLM's importance-sampling correction, the Mixture-of-Experts router loss, batch reward scaling,
    normalise-then-sum), it trains step for step like stock TRL. With `peft_config=LoraConfig(...)` only the adapter
    is trained, and the reference log-probs come from the same model with its adapters disabled.

    Besides TRL's metrics it logs the diagnostics (ratio distribution, per-group reward spread, loss split, the
    sampler/trainer mismatch with vLLM), keeps non-finite updates off the weights, warns about anomalies, names
    failing reward functions, writes crash-safe checkpoints that resume exactly, and writes a model card with a
    training report. With `heldout_metrics=[...]` (and `heldout_dataset`, or `eval_dataset`) it evaluates held-out
    prompts with k sampled completions each, independently of the reward (`heldout.HeldoutEvaluationMixin`). Opt-in
    (`GRPOConfigExt`): `dynamic_sampling` replaces the groups without reward spread by informative ones generated for
    fresh prompts, and `skip_zero_advantage_rows` leaves the rows that cannot move the loss out of the training
    forward, exactly.

    Raises:
        ValueError: at construction, for invalid `epsilon`/`epsilon_high`/`beta`, a `loss_implementation` that
            cannot compute the configured objective, an option the installed TRL lacks, an empty training set, or
            one without a `prompt` column.
    """

    _tag_names = ["trl", "grpo", "trl_grpo_ext"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional, **kwargs):
        if len(positional) > len(_TRL_PARAMETERS) - 3:
            raise TypeError(f"GRPOTrainerExt takes at most {len(_TRL_PARAMETERS)} arguments besides `self`.")
        for name, value in zip(_TRL_PARAMETERS[3:], positional, strict=False):
            if name in kwargs:
                raise TypeError(f"GRPOTrainerExt got multiple values for argument {name!r}.")
            kwargs[name] = value
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfigExt(f"{model_name.split('/')[-1]}-GRPO")
        problems = hyperparameter_problems(args.epsilon, args.epsilon_high, args.beta, args.delta)
        problems += options_missing_from_trl(args)
        if problems:
            raise ValueError(" ".join(problems))
        _check_train_dataset(kwargs.get("train_dataset"), kwargs.get("environment_factory"))
        seed_before_model_init(args)
        # For the model card, before PEFT expands `target_modules="all-linear"` in the config it is given.
        self._user_lora_settings = user_lora_settings(kwargs.get("peft_config"))
        super().__init__(model, _guard_reward_funcs(reward_funcs), args=args, **kwargs)
        check_launch(self.accelerator)  # processes that a launcher started but accelerate runs apart

        def option(name):  # a plain trl.GRPOConfig has none of the extra fields: GRPOConfigExt's defaults then
            return getattr(args, name, GRPOConfigExt.__dataclass_fields__[name].default)

        self._loss_type = LOSS_TYPES[self.loss_type]
        self._loss_implementation = option("loss_implementation")
        if self._loss_implementation in ("fused", "compiled") and fused_kernel_problems(args):
            raise ValueError(  # GRPOConfigExt checks this too; here for configs changed after construction
                f"loss_implementation={self._loss_implementation!r} cannot compute this objective: the fused kernel "
                + "; ".join(fused_kernel_problems(args))
                + ". Use 'auto' (the kernel wherever it applies) or 'reference'."
            )
        loss_terms = ("policy", "kl_penalty")
        loss_terms += ("entropy_bonus",) if self._entropy_bonus_enabled else ()
        loss_terms += ("router",) if self.aux_loss_enabled else ()
        extra_metrics = ("policy_loss",) if self._entropy_bonus_enabled else ()  # TRL logs it with a bonus only
        extra_metrics += ("aux_loss",) if self.aux_loss_enabled else ()
        extra_metrics += self._loss_type.extra_metrics
        self._row_skipping = None
        if option("skip_zero_advantage_rows"):
            problems = skipping_problems(self)
            if problems:
                logger.warning(
                    "skip_zero_advantage_rows=True does nothing in this run: leaving zero-advantage rows out would "
                    "change the gradient, because " + "; ".join(problems) + "."
                )
            else:
                self._row_skipping = ZeroAdvantageRowSkipping(self.importance_sampling_level)
        skipping_metrics = ("skipped_rows/fraction",) if self._row_skipping is not None else ()
        self._diagnostics = {
            mode: DiagnosticsAccumulator(
                ratio_stats=option("log_diagnostics"),
                quantiles=getattr(args, "ratio_quantiles", None),
                histograms=option("log_histograms"),
                clip_metrics=self._loss_type.clip_metrics,
                loss_terms=loss_terms,
                extra_metrics=extra_metrics + (skipping_metrics if mode == "train" else ()),
                sampler_mismatch=self.use_vllm and option("log_sampler_mismatch"),
            )
            for mode in ("train", "eval")
        }
        if truncation_warning(args):
            warnings.warn(truncation_warning(args), UserWarning, stacklevel=2)
        self._init_nonfinite_guard(option("nonfinite_policy"), option("max_nonfinite_skips"))
        self._init_dynamic_sampling(option("dynamic_sampling"), option("dynamic_sampling_max_rounds"))
        if option("warn_on_anomalies"):
            # First in line, so that the loggers and the console after it see the `alarms/<name>` counts it adds.
            self.callback_handler.callbacks.insert(0, AnomalyMonitor.from_config(args))

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        selection = None  # with skip_zero_advantage_rows: only the rows that can move the loss (skipping.py)
        if mode == "train" and self._row_skipping is not None:
            inputs, selection = self._row_skipping.select(inputs)
        logps, entropies, aux_loss = self._policy_logps_and_entropies(model, inputs)
        num_rows = None if selection is None else selection.num_rows
        objective = gather_objective_inputs(self, inputs, logps, entropies, aux_loss, mode, num_rows=num_rows)
        out = policy_objective(
            objective.logps,
            objective.old_logps,
            objective.ref_logps,
            objective.advantages,
            objective.mask,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            beta=self.beta,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            sapo_temperature_pos=self.args.sapo_temperature_pos,
            sapo_temperature_neg=self.args.sapo_temperature_neg,
            sequence_weights=objective.sequence_weights,
            token_weights=objective.token_weights,
            denominator=objective.denominator,
            loss_scale=objective.loss_scale,
            implementation=self._loss_implementation,
            per_token=self._diagnostics[mode].ratio_stats,
            **({} if selection is None else selection.policy_options()),
        )
        loss = out.loss
        # Each term in the units of the backward loss: summed over a step's micro-batches they give its loss.
        terms = {"policy": out.policy_loss, "kl_penalty": out.kl_penalty}
        extras = {}
        if objective.sequence_weights is not None:
            extras["vespo/phi_seq_mean"] = (objective.sequence_weights.sum(), objective.sequence_weights.numel())
        scale = objective.accumulation_scale
        if self._entropy_bonus_enabled:
            # As TRL logs it: the policy loss before the bonus and before any division by the accumulation steps.
            extras["policy_loss"] = (out.loss.detach() / objective.loss_scale, 1)
            coef, mean_entropy = self._entropy_bonus(entropies, objective.mask, objective.entropy_mask, mode)
            loss = loss - coef * mean_entropy * scale
            terms["entropy_bonus"] = -coef * mean_entropy.detach() * scale
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss * scale
            terms["router"] = self.router_aux_loss_coef * aux_loss.detach() * scale
            extras["aux_loss"] = (aux_loss, 1)
        if selection is not None:
            extras["skipped_rows/fraction"] = selection.skipped_fraction()
            out = selection.with_whole_batch_clip_counts(out)
        optimizer_step = mode == "eval" or self.accelerator.sync_gradients
        self._diagnostics[mode].add_loss_step(out, entropies, terms, extras, optimizer_step=optimizer_step)
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
            **{key: inputs.get(key) for key in FORWARD_KEYS},
        )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self._diagnostics[mode].sampler_mismatch and output.get("sampling_per_token_logps") is not None:
            # TRL computes the trainer's log-probs at generation only for the correction (or misaligned steps)
            logps = trainer_logps(self, output) if "old_per_token_logps" not in output else None
            mismatch = sampler_mismatch(
                output,
                self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
                trainer_logps=logps,
            )
            self._diagnostics[mode].add_sampler_mismatch(mismatch)
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if not self._defer_reward_spread:  # dynamic sampling adds the batch that trains once it is assembled
            # This process's completion lengths are the rows of its slice (TRL's `process_slice`) of the rewards.
            lengths = torch.tensor([len(ids) for ids in completion_ids_list], device=rewards_per_func.device)
            first_row = self.accelerator.process_index * len(prompts)
            self._add_reward_spread(rewards_per_func, "train" if self.model.training else "eval", lengths, first_row)
        return rewards_per_func

    def _add_reward_spread(
        self, rewards_per_func: torch.Tensor, mode: str, lengths: torch.Tensor | None = None, first_row: int = 0
    ) -> None:
        """Feed the per-group reward spread of a generation batch (`(N, F)`, every process's rows), and with this
        process's completion `lengths` (rows `first_row ..`) the length/reward correlation, to the diagnostics."""
        # The total reward TRL builds its advantages from; rows that no function scored stay NaN.
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, rewards)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        self._diagnostics[mode].add_rewards(rewards, num_generations, lengths, first_row)

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
