"""`GRPOTrainerExt`: TRL's `GRPOTrainer` whose loss is this package's.

Generation, rewards, advantages, reference log-probs, PEFT and distributed training are TRL's, unchanged. Every TRL
(and transformers `Trainer`) hook that the package overrides is overridden here, once (`_compat.OVERRIDDEN_HOOKS` pins
their signatures against the installed TRL), and hands its concern to the helper that holds it:

- `_compute_loss`: the objective (`batch.gather_objective_inputs`, `ops.policy_objective`), row skipping
  (`extras.skipping`) and the per-micro-batch diagnostics sums (`diagnostics`);
- `_get_per_token_logps_and_entropies`: every log-prob forward, padding-free (`forward.PackedLogProbs`);
- `_generate_and_score_completions`: selective rollouts (`extras.selective`), dynamic sampling (`extras.dynamic`), the
  per-group reward spread of the batch that trains, vLLM's truncation match and mismatch (`extras.vllm`);
- `_calculate_rewards`: the rewards and completion lengths of the batch just scored (`ScoredBatch`);
- `log`: the one gather of the diagnostics per log step;
- `training_step`, `_get_grad_norm`: the non-finite guard's verdicts (`guardrails.nonfinite.NonFiniteEnforcer`);
- `_save_checkpoint`, `_get_output_dir`, `_push_from_checkpoint`, `_load_optimizer_and_scheduler`: crash-safe
  checkpoints and exact resume (`checkpointing.Checkpoints`);
- `evaluate`: held-out evaluation (`extras.heldout`);
- `create_model_card`: TRL's model card, with this package's sections and `report.png` added (`tools.card`).

The state that a resumed run needs is registered by name with `Checkpoints.register`, once, here. Each module of
`extras/` is imported inside the `if` of the option that turns it on: a run loads only the extras it uses.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import transformers
import trl
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from ._compat import (
    check_transformers_version,
    check_trl_surface,
    check_trl_version,
    ignore_renamed_checkpointing_warnings,
    options_missing_from_trl,
    seed_before_model_init,
)
from .batch import entropy_bonus, gather_objective_inputs, policy_logps_and_entropies
from .checkpointing import Checkpoints
from .config import GRPOConfigExt, config_problems, option
from .diagnostics import DiagnosticsAccumulator
from .diagnostics.loggers import write_histograms
from .forward import FORWARD_METRICS, PackedLogProbs, forward_counts
from .forward.layout import upload
from .guardrails.anomaly import AlarmSettings, AnomalyMonitor
from .guardrails.launch import check_launch, check_train_dataset
from .guardrails.nonfinite import NonFiniteEnforcer, NonFiniteGuard
from .guardrails.reward_errors import guard_reward_funcs, reward_kwarg_names
from .metrics import HELDOUT_PREFIX, KL, LOSS, NONFINITE_SKIPPED_STEPS, SKIPPED_ROWS_FRACTION, VESPO_PHI_SEQ_MEAN
from .ops import LOSS_TYPES, policy_objective, total_loss
from .ops.validation import raise_problems

# The hooks overridden below are those of the TRL and transformers releases `_compat` names.
check_trl_version(trl.__version__)
check_transformers_version(transformers.__version__)
ignore_renamed_checkpointing_warnings()

__all__ = ["GRPOTrainerExt"]

_TRL_PARAMETERS = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]  # without `self`


@dataclass
class ScoredBatch:
    """The rewards of one generation batch, as `_calculate_rewards` saw them.

    Attributes:
        rewards_per_func (`torch.Tensor` of shape `(N, F)`): every process's rows, NaN where a function did not score.
        lengths (`torch.Tensor` of shape `(n,)`): this process's completion lengths, rows `first_row ..` of them.
        first_row (`int`): the global row of this process's first completion.
    """

    rewards_per_func: torch.Tensor
    lengths: torch.Tensor
    first_row: int


class _RowsToScore(list):
    """This process's rows of a generation batch, handed to TRL's `_generate_and_score_completions`, which passes this
    very list to `_calculate_rewards`: the one way back for what the reward call scored, which TRL's method does not
    return (a trainer attribute set by one hook for another to read would outlive the call)."""

    scored: ScoredBatch | None = None


class GRPOTrainerExt(GRPOTrainer):
    """[`trl.GRPOTrainer`] whose loss is this package's: DeepSeekMath's GRPO objective by default, every TRL option
    honoured.

    Takes the same arguments as `trl.GRPOTrainer`, by position or by name. `args` defaults to a [`GRPOConfigExt`]
    (DeepSeekMath's objective); with a plain `trl.GRPOConfig`, or any TRL option set (every `loss_type`,
    sequence-level importance sampling, `delta`, entropy masking and bonus, off-policy masking, the KL bias
    correction, vLLM's importance-sampling correction, the Mixture-of-Experts router loss, batch reward scaling,
    normalise-then-sum), it trains step for step like stock TRL. With `peft_config=LoraConfig(...)` only the adapter
    is trained, and the reference log-probs come from the same model with its adapters disabled.

    Besides TRL's metrics it logs the diagnostics (ratio distribution, per-group reward spread, loss split, the
    sampler/trainer mismatch with vLLM), keeps non-finite updates off the weights, warns about anomalies, names
    failing reward functions, writes crash-safe checkpoints that resume exactly, and writes a model card with a
    training report. The console shows a progress bar and one line of key signals per log step (`console`), and each
    alarm also reaches trackio and W&B as an alert where `report_to` names them. With `heldout_metrics=[...]` (and
    `heldout_dataset`, or `eval_dataset`) it evaluates held-out prompts with k sampled completions each,
    independently of the reward (`extras.heldout`). Opt-in (`GRPOConfigExt`): `dynamic_sampling` replaces the
    groups without reward spread by informative ones generated for fresh prompts, `selective_rollouts` skips before
    generation the prompts predicted to give no reward spread, and `skip_zero_advantage_rows` leaves the rows that
    cannot move the loss out of the training forward, exactly.

    Args:
        heldout_metrics (callable or list of callables, *optional*): metric functions with the reward-function
            signature, evaluated on held-out prompts (`heldout_*` fields of [`GRPOConfigExt`]).
        heldout_dataset (`datasets.Dataset`, *optional*): the held-out prompts; default: `eval_dataset`.
        Every other argument is `trl.GRPOTrainer`'s.

    Raises:
        ValueError: at construction, for an invalid configuration (`config.config_problems`: `epsilon`,
            `epsilon_high`, `beta`, a `loss_implementation` that cannot compute the configured objective, ...), an
            option the installed TRL lacks, an empty training set, or one without a `prompt` column.
        TypeError: at construction, for a reward function without `**kwargs` that lacks a keyword argument TRL will
            pass it (`guardrails.reward_errors.check_reward_signature`).
        IncompatibleTRLError: at construction, before any model loads, where the installed TRL's private surface
            that the package overrides or reads differs from the pins in `_compat` (`_compat.check_trl_surface`).
    """

    _tag_names = ["trl", "grpo", "trl_grpo_ext"]
    #: Extra rows for the model card's metrics table (e.g. held-out accuracy measured by a recipe).
    card_metrics: dict[str, float] | None = None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        *positional,
        heldout_metrics=None,
        heldout_dataset=None,
        **kwargs,
    ):
        if len(positional) > len(_TRL_PARAMETERS) - 3:
            raise TypeError(f"GRPOTrainerExt takes at most {len(_TRL_PARAMETERS)} arguments besides `self`.")
        for name, value in zip(_TRL_PARAMETERS[3:], positional, strict=False):
            if name in kwargs:
                raise TypeError(f"GRPOTrainerExt got multiple values for argument {name!r}.")
            kwargs[name] = value
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfigExt(f"{model_name.split('/')[-1]}-GRPO")
        if isinstance(model, str) and os.path.isdir(model):
            # What the saved config and a LoRA adapter name as their base model: loadable from any folder.
            model = os.path.abspath(model)
        # Before any model is loaded; GRPOConfigExt checked itself too, this covers a plain trl.GRPOConfig and a
        # configuration changed after construction.
        raise_problems(
            config_problems(args) + config_problems(args, only_after_trl=True) + options_missing_from_trl(args)
        )
        check_trl_surface(args)  # TRL's hooks, methods and attributes relied on, against the installed TRL
        check_train_dataset(kwargs.get("train_dataset"), kwargs.get("environment_factory"))
        heldout = None
        if _asks_for_heldout(args, heldout_metrics):
            from .extras.heldout import HeldoutEvaluator

            heldout = HeldoutEvaluator(args, heldout_metrics, heldout_dataset, kwargs.get("eval_dataset"))
            if heldout.stands_in_for_eval_dataset:
                kwargs["eval_dataset"] = heldout.dataset
        seed_before_model_init(args)
        # For the model card, as given: PEFT writes the modules that `target_modules="all-linear"` matched into it.
        self._peft_config = copy.deepcopy(kwargs.get("peft_config"))
        reward_kwargs = reward_kwarg_names(kwargs.get("train_dataset"), kwargs.get("environment_factory") is not None)
        super().__init__(model, guard_reward_funcs(reward_funcs, reward_kwargs), args=args, **kwargs)
        check_launch(self.accelerator)  # processes that a launcher started but accelerate runs apart

        self._loss_type = LOSS_TYPES[self.loss_type]
        self._loss_implementation = option(args, "loss_implementation")
        self._packed_forward = PackedLogProbs(
            self,
            option(args, "padding_free"),
            option(args, "padding_free_row_tokens"),
            option(args, "shared_prompt_forward"),
        )
        self._row_skipping = None
        if option(args, "skip_zero_advantage_rows"):
            from .extras.skipping import row_skipping

            self._row_skipping = row_skipping(self)  # None, with a warning, where skipping would change the gradient
        self._diagnostics = {mode: self._build_diagnostics(mode) for mode in ("train", "eval")}
        self._vllm_batches = None
        if self.use_vllm:
            from .extras.vllm.mismatch import VllmBatches

            self._vllm_batches = VllmBatches(self, measure=option(args, "log_sampler_mismatch"))

        self._checkpoints = Checkpoints(self)
        self._nonfinite_guard = NonFiniteGuard(option(args, "nonfinite_policy"), option(args, "max_nonfinite_skips"))
        self._checkpoints.register("nonfinite_guard", self._nonfinite_guard)
        self._nonfinite_steps = NonFiniteEnforcer(self, self._nonfinite_guard, self._checkpoints)
        self._selective, self._dynamic_sampler = None, None
        if option(args, "selective_rollouts"):
            from .extras.selective import SelectiveRollouts, selective_options

            self._selective = SelectiveRollouts(self, **selective_options(args))
            self._checkpoints.register("selective_rollouts", self._selective, rewind=True)
            self._checkpoints.register("prompt_stream", self._selective.stream, rewind=True)
        if option(args, "dynamic_sampling"):
            from .extras.dynamic import DynamicSampler

            rounds, margin = option(args, "dynamic_sampling_max_rounds"), option(args, "dynamic_sampling_round_margin")
            sampler = DynamicSampler(self, rounds, margin=margin, selective=self._selective)
            if self._selective is None:  # else the stream is the one selective rollouts registered
                self._checkpoints.register("prompt_stream", sampler.stream, rewind=True)
            self._checkpoints.register("dynamic_sampling", sampler.keep_rate, rewind=True)
            self._dynamic_sampler = sampler
        self._heldout = heldout
        if heldout is not None:
            heldout.attach(self)
        self.add_callback(AlarmSettings.from_config(args))  # kept in the trainer state, for `report`
        if option(args, "warn_on_anomalies"):
            # First in line, so that the loggers and the console after it see the `alarms/<name>` counts it adds.
            self.callback_handler.callbacks.insert(0, AnomalyMonitor.from_config(args))
            from .extras.alerts import TrackerAlerts

            TrackerAlerts.install(self)  # each alarm as a trackio / W&B alert, where report_to names them
        if option(args, "console") == "compact":
            from .extras.console import ConsoleCallback

            ConsoleCallback.install(self)

    def _build_diagnostics(self, mode: str) -> DiagnosticsAccumulator:
        loss_terms = ("policy", "kl_penalty")
        loss_terms += ("entropy_bonus",) if self._entropy_bonus_enabled else ()
        loss_terms += ("router",) if self.aux_loss_enabled else ()
        extra_metrics = ("policy_loss",) if self._entropy_bonus_enabled else ()  # TRL logs it with a bonus only
        extra_metrics += ("aux_loss",) if self.aux_loss_enabled else ()
        extra_metrics += self._loss_type.extra_metrics
        extra_metrics += FORWARD_METRICS
        if mode == "train" and self._row_skipping is not None:
            extra_metrics += (SKIPPED_ROWS_FRACTION,)
        return DiagnosticsAccumulator(
            ratio_stats=option(self.args, "log_diagnostics"),
            quantiles=option(self.args, "ratio_quantiles"),
            histograms=option(self.args, "log_histograms"),
            clip_metrics=self._loss_type.clip_metrics,
            loss_terms=loss_terms,
            extra_metrics=extra_metrics,
            sampler_mismatch=self.use_vllm and option(self.args, "log_sampler_mismatch"),
        )

    # The objective

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        # What TRL's padded layout forwards for the whole micro-batch (forward/*), whatever rows are skipped.
        counts = forward_counts(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_mask"])
        selection = None  # with skip_zero_advantage_rows: only the rows that can move the loss (extras.skipping)
        if mode == "train" and self._row_skipping is not None:
            inputs, selection = self._row_skipping.select(inputs)
        logps, entropies, aux_loss = policy_logps_and_entropies(self, model, inputs)
        num_rows = None if selection is None else selection.num_rows
        objective = gather_objective_inputs(self, inputs, logps, entropies, mode, num_rows=num_rows)
        out = policy_objective(
            objective.logps,
            objective.old_logps,
            objective.ref_logps,
            objective.advantages,
            objective.mask,
            objective.options,
            sequence_weights=objective.sequence_weights,
            token_weights=objective.token_weights,
            denominator=objective.denominator,
            loss_scale=objective.loss_scale,
            implementation=self._loss_implementation,
            **({} if selection is None else selection.policy_options()),
        )
        extras = {}
        carrier = selection is not None and selection.carrier
        if objective.sequence_weights is not None:
            weights = objective.sequence_weights
            extras[VESPO_PHI_SEQ_MEAN] = (weights.sum() * (not carrier), weights.numel() * (not carrier))
        bonus = None
        if self._entropy_bonus_enabled:
            # As TRL logs it: the policy loss before the bonus and before any division by the accumulation steps.
            extras["policy_loss"] = (out.loss.detach() / objective.loss_scale, 1)
            bonus = entropy_bonus(self, entropies, objective.mask, objective.entropy_mask, mode)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            extras["aux_loss"] = (aux_loss, 1)
        loss, added = total_loss(
            out.loss,
            scale=objective.accumulation_scale,
            entropy_bonus=bonus,
            router=(self.router_aux_loss_coef, aux_loss) if self.aux_loss_enabled else None,
        )
        # Each term in the units of the backward loss: summed over a step's micro-batches they give its loss.
        terms = {"policy": out.policy_loss, "kl_penalty": out.kl_penalty, **added}
        extras.update(counts.metrics())
        if selection is not None:
            extras[SKIPPED_ROWS_FRACTION] = selection.skipped_fraction()
            out = selection.with_whole_batch_clip_counts(out)
        optimizer_step = mode == "eval" or self.accelerator.sync_gradients
        self._diagnostics[mode].add_loss_step(out, entropies, terms, extras, optimizer_step, carrier=carrier)
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **forward_inputs,
    ):
        """TRL's hook, padding-free where the run allows it (`forward.logprobs`), TRL's padded forward elsewhere:
        log-probs `(N, C)`, entropies `(N, C)` or `None`, the router loss (0-dim) or `None`."""
        packed = self._packed_forward(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            forward_inputs,
        )
        if packed is not None:
            return packed
        return self._stock_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **forward_inputs,
        )

    def _stock_logps_and_entropies(self, *args, **kwargs):
        """TRL's padded log-prob forward, as stock TRL runs it (the same arguments as the hook)."""
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    # Generation and rewards

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        vllm_batches = self._vllm_batches
        mark = vllm_batches.mark(mode) if vllm_batches is not None else None
        if self._dynamic_sampler is not None and mode == "train":
            output, scored = self._dynamic_sampler.generate(inputs, self._generate_and_score)
        elif self._selective is not None and mode == "train":
            output, scored = self._selective.generate(inputs, self._generate_and_score)
        else:
            output, scored = self._generate_and_score(inputs)
        self._add_reward_spread(scored, mode)
        if vllm_batches is not None:  # after the rounds of dynamic sampling: the batch that trains
            mismatch = vllm_batches.finish(output, mode, mark)
            if mismatch is not None:
                self._diagnostics[mode].add_sampler_mismatch(mismatch)
        return output

    def _generate_and_score(self, inputs: list[dict]) -> tuple[dict, ScoredBatch]:
        """TRL's generation and scoring of one generation batch (`inputs`: this process's rows), and what its reward
        call scored."""
        rows = _RowsToScore(inputs)
        output = super()._generate_and_score_completions(rows)
        if rows.scored is None:
            raise RuntimeError(
                "TRL's _generate_and_score_completions returned without passing the rows it was given to "
                "_calculate_rewards: this TRL release scores a batch in a way GRPOTrainerExt does not know."
            )
        return output, rows.scored

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if isinstance(inputs, _RowsToScore):
            # Uploaded without waiting for the device (from a host list: a blocking copy otherwise). This process's
            # completions are the rows of its slice (TRL's `process_slice`) of the gathered rewards.
            lengths = upload([len(ids) for ids in completion_ids_list], rewards_per_func.device)
            first_row = self.accelerator.process_index * len(prompts)
            inputs.scored = ScoredBatch(rewards_per_func, lengths, first_row)
        return rewards_per_func

    def _add_reward_spread(self, scored: ScoredBatch, mode: str) -> None:
        """Feed the per-group reward spread of the batch that trains, and the length/reward correlation, to the
        diagnostics."""
        # The total reward TRL builds its advantages from; rows that no function scored stay NaN.
        rewards_per_func = scored.rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, rewards)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        self._diagnostics[mode].add_rewards(rewards, num_generations, scored.lengths, scored.first_row)

    # Logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        accumulator = self._diagnostics[mode]
        packed = accumulator.pack()
        # The diagnostics' only collective: every process's sums since the last log, in one gather.
        gathered = self.accelerator.gather(packed[None]) if packed is not None else None
        summary = accumulator.summarize(gathered)
        if self.beta == 0.0:
            summary.per_step.pop(KL, None)
        for name, values in summary.per_step.items():
            if values:  # TRL's log divides by the number of values: a name without any is not created
                self._metrics[mode][name].extend(values)
        for name, value in summary.scalars.items():
            self._metrics[mode][name].append(value)
        if mode == "train" and self._nonfinite_guard.policy != "off" and LOSS in logs:
            self._metrics[mode][NONFINITE_SKIPPED_STEPS].append(self._nonfinite_guard.skipped)
        super().log(logs, start_time)
        if summary.histograms and self.accelerator.is_main_process:
            write_histograms(self.callback_handler, summary.histograms, mode, self.state.global_step)

    # The non-finite guard

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._nonfinite_steps.record_loss(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        return self._nonfinite_steps.judge_step(model, super()._get_grad_norm(model, grad_norm=grad_norm))

    # Checkpoints

    def _save_checkpoint(self, model, trial) -> None:
        with self._checkpoints.staged_save(trial):
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial) -> str:
        return self._checkpoints.output_dir(super()._get_output_dir(trial=trial))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._checkpoints.may_push():
            super()._push_from_checkpoint(checkpoint_folder)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self._checkpoints.load(checkpoint)

    # Held-out evaluation and the model card

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`, with the held-out metrics among the returned (and logged) metrics."""
        if self._heldout is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        return self._heldout.evaluate(super().evaluate, eval_dataset, ignore_keys, metric_key_prefix)

    def evaluate_heldout(self, log: bool = True) -> dict[str, float]:
        """Run the held-out evaluation now, on every process (each samples its share of the prompts).

        Args:
            log (`bool`): also log the values as their own entry at the current step.

        Returns:
            `dict`: `heldout/<metric>/mean@<n>`, `heldout/<metric>/pass@<k>` and `heldout/<metric>/scored@<n>` (the
            number of completions scored), the same on every process.
        """
        if self._heldout is None:
            raise ValueError("evaluate_heldout() needs heldout_metrics=[...] given to the trainer.")
        return self._heldout.run(log)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        """TRL's model card (`README.md` in `args.output_dir`) with this package's sections, and `report.png`."""
        model_name = model_name or os.path.basename(os.path.normpath(self.args.output_dir))
        super().create_model_card(model_name, dataset_name, tags)
        if self.is_world_process_zero():
            from .tools.card import add_to_model_card  # the tools load when a card is written, not with the trainer

            add_to_model_card(self, dataset_name, peft_config=self._peft_config, card_metrics=self.card_metrics)


def _asks_for_heldout(args, metrics) -> bool:
    """Whether the run asks for held-out evaluation: metrics given, a schedule, or a best-model metric it would log
    (the held-out evaluator refuses the last two without metrics)."""
    best = (getattr(args, "metric_for_best_model", None) or "").removeprefix("eval_")
    return metrics is not None or bool(option(args, "heldout_every_steps")) or best.startswith(HELDOUT_PREFIX)
