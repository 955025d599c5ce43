"""`skip_zero_advantage_rows`: the rows that cannot move the loss are left out of the training forward, exactly.

Half of the prompts get a constant reward (advantage 0 for their groups): the runs with skipping must log the loss and
gradient norm of the same run without it, and of stock `trl.GRPOTrainer`, to float rounding (rel 1e-5: the same sums
in another order and the forward on a smaller batch).
"""

import math
from unittest import mock

import pytest
import torch
from helpers import constant_reward, half_constant_reward, tiny_grpo_args, tiny_lora, train_logs
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.extras import skipping as skipping_module
from trl_grpo_ext.extras.skipping import ZeroAdvantageRowSkipping
from trl_grpo_ext.ops import LOSS_TYPES, ObjectiveOptions, policy_objective

RTOL, ATOL = 1e-5, 1e-6
# Logged the same with and without skipping (entropy and ratio/* describe the trained rows only).
SAME = (
    "loss",
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "completions/mean_length",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "loss/policy",
)
# Generations reused, no KL term (skipping would change its gradient), half of the groups without spread.
REUSED = {"num_iterations": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "reward_funcs": half_constant_reward}


class RowCounting(GRPOTrainerExt):
    """Counts the rows of every forward with gradient in `forward_rows` (the training forward; generation scores
    without one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_rows = []

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if torch.is_grad_enabled():
            self.forward_rows.append(input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


def assert_same(expected_logs, got_logs, keys=SAME):
    assert len(expected_logs) == len(got_logs) == 4
    for step, (expected, got) in enumerate(zip(expected_logs, got_logs, strict=True), start=1):
        for key in keys:
            if key in expected and not math.isnan(expected[key]):
                assert got[key] == pytest.approx(expected[key], rel=RTOL, abs=ATOL), (step, key)


# name -> TRL options (each run pair takes about a second)
CASES = {
    "dapo": {"loss_type": "dapo"},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.1},
    "sapo": {"loss_type": "sapo"},
    "vespo": {"loss_type": "vespo"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_skipping_logs_the_loss_and_grad_norm_of_the_run_without_it_and_of_stock_trl(
    name, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    options = {**REUSED, **CASES[name]}
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    stock, _ = train_logs(tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **options)
    whole, whole_trainer = train_logs(
        tmp_path / "w", *tiny_run, trainer_cls=RowCounting, config_cls=GRPOConfig, **options
    )
    skipped, trainer = train_logs(
        tmp_path / "k",
        *tiny_run,
        trainer_cls=RowCounting,
        config_cls=GRPOConfigExt,
        skip_zero_advantage_rows=True,
        **options,
    )
    assert trainer._row_skipping is not None
    assert_same(stock, skipped)
    assert_same(whole, skipped)
    # Half of the groups have no spread: about half the rows never reached the training forward.
    assert sum(trainer.forward_rows) < 0.75 * sum(whole_trainer.forward_rows)
    assert all(0.0 < entry["skipped_rows/fraction"] < 1.0 for entry in skipped)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_skipping_a_lora_adapter_logs_the_loss_and_grad_norm_of_the_run_without_it(
    loss_type, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    options = {**REUSED, "loss_type": loss_type, "learning_rate": 5e-2}
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    whole, _ = train_logs(
        tmp_path / "w", *tiny_run, trainer_cls=RowCounting, config_cls=GRPOConfig, peft_config=tiny_lora(), **options
    )
    skipped, _ = train_logs(
        tmp_path / "k",
        *tiny_run,
        trainer_cls=RowCounting,
        config_cls=GRPOConfigExt,
        peft_config=tiny_lora(),
        skip_zero_advantage_rows=True,
        **options,
    )
    assert_same(whole, skipped)
    assert all(entry["skipped_rows/fraction"] > 0 for entry in skipped)


def test_the_training_forward_sees_only_the_rows_with_a_nonzero_advantage(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    seen = []
    original_select = ZeroAdvantageRowSkipping.select

    def recording_select(self, inputs):
        selected, selection = original_select(self, inputs)
        tokens = inputs["completion_mask"].sum(dim=1)
        seen.append(((inputs["advantages"] != 0) & (tokens > 0)).sum().item())
        return selected, selection

    with mock.patch.object(ZeroAdvantageRowSkipping, "select", recording_select):
        logs, trainer = train_logs(
            tmp_path,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=RowCounting,
            config_cls=GRPOConfigExt,
            loss_type="dapo",
            skip_zero_advantage_rows=True,
            **REUSED,
        )
    assert len(trainer.forward_rows) == len(seen) == 8  # 4 steps of 2 micro-batches of 4 rows
    assert trainer.forward_rows == [max(trainable, 1) for trainable in seen]
    for step, entry in enumerate(logs):
        window = seen[2 * step : 2 * step + 2]
        assert entry["skipped_rows/fraction"] == pytest.approx(sum(4 - kept for kept in window) / 8)


def test_a_micro_batch_whose_rows_all_skip_trains_one_row_to_an_exact_zero_loss(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    logs, trainer = train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=RowCounting,
        config_cls=GRPOConfigExt,
        loss_type="grpo",
        skip_zero_advantage_rows=True,
        **{**REUSED, "reward_funcs": constant_reward},
    )
    assert trainer.forward_rows == [1] * 8  # one carrier row per micro-batch keeps the backward going
    for entry in logs:
        assert entry["loss"] == 0.0 and entry["grad_norm"] == 0.0
        assert entry["skipped_rows/fraction"] == 1.0
        assert entry["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"beta": 0.04}, "beta=0.04"),
        ({"entropy_coef": 0.01}, "entropy bonus"),
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
    ],
)
def test_skipping_does_nothing_and_says_why_once_where_it_would_change_the_gradient(
    options, reason, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path, skip_zero_advantage_rows=True, loss_type="dapo", **options))
    with mock.patch.object(skipping_module.logger, "warning") as warning:
        trainer = GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=half_constant_reward,
            args=args,
            train_dataset=prompt_dataset,
            processing_class=tiny_tokenizer,
        )
    messages = [call.args[0] for call in warning.call_args_list if "skip_zero_advantage_rows" in call.args[0]]
    assert len(messages) == 1 and reason in messages[0] and "does nothing" in messages[0]
    assert trainer._row_skipping is None
    assert "skipped_rows/fraction" not in trainer._diagnostics["train"].extra_metrics


def test_a_plain_trl_config_skips_nothing(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=half_constant_reward,
        args=GRPOConfig(**tiny_grpo_args(tmp_path, beta=0.0)),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    assert trainer._row_skipping is None


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_objective_of_the_kept_rows_with_the_whole_batch_counts_is_the_whole_batch_objective(loss_type, level):
    generator = torch.Generator().manual_seed(0)
    rows, width = 8, 6
    logps = -torch.rand(rows, width, generator=generator, dtype=torch.float64) - 0.1
    old = logps + 0.1 * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    advantages[[1, 4, 5]] = 0.0
    mask = torch.rand(rows, width, generator=generator) < 0.8
    mask[6] = False  # no completion token
    loss = ObjectiveOptions(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=1.1 if loss_type == "cispo" else None,
        beta=0.0,
    )
    options = dict(
        denominator=torch.tensor(37.0, dtype=torch.float64),
        token_weights=torch.rand(rows, 1, generator=generator, dtype=torch.float64),
    )
    weights = torch.rand(rows, 1, generator=generator, dtype=torch.float64)

    def objective(keep):
        leaf = logps.clone().requires_grad_(True)
        extra = {"sequence_weights": weights[keep]} if LOSS_TYPES[loss_type].needs_sequence_weights else {}
        counts = {} if keep.all() else {"batch_rows": rows, "batch_tokens": mask.sum()}
        out = policy_objective(
            leaf[keep],
            old[keep],
            None,
            advantages[keep],
            mask[keep],
            loss,
            **{**options, "token_weights": options["token_weights"][keep]},
            **extra,
            **counts,
        )
        out.loss.backward()
        return out.loss.detach(), leaf.grad

    everything = torch.ones(rows, dtype=torch.bool)
    trains = (advantages != 0) & mask.any(dim=1)
    whole_loss, whole_grad = objective(everything)
    kept_loss, kept_grad = objective(trains)
    assert kept_loss.item() != 0.0
    torch.testing.assert_close(kept_loss, whole_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(kept_grad, whole_grad, rtol=1e-12, atol=1e-15)


def test_batch_rows_below_the_rows_passed_is_refused():
    logps = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="batch_rows"):
        policy_objective(logps, None, None, torch.ones(4), torch.ones(4, 3), ObjectiveOptions(beta=0.0), batch_rows=3)


def test_a_log_step_whose_rows_all_skip_logs_no_entropy_rather_than_0(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """TRL's `entropy` is a mean over micro-batches: one that only carried the graph must not add a 0 to it (which
    halved the logged entropy with gradient accumulation 2, and raised a false entropy collapse)."""
    logs, _ = train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=RowCounting,
        config_cls=GRPOConfigExt,
        skip_zero_advantage_rows=True,
        **{**REUSED, "reward_funcs": constant_reward},
    )
    assert all(entry["skipped_rows/fraction"] == 1.0 for entry in logs)
    assert not any("entropy" in entry or "alarms/entropy_collapse" in entry for entry in logs)


def test_a_carrier_micro_batch_adds_neither_entropy_nor_phi_to_the_logged_means():
    from trl_grpo_ext.diagnostics import DiagnosticsAccumulator

    accumulator = DiagnosticsAccumulator(ratio_stats=False, extra_metrics=("vespo/phi_seq_mean",))
    logps = torch.full((2, 3), -1.0, requires_grad=True)
    advantages = torch.tensor([1.0, -1.0])
    for carrier in (False, True):
        mask = torch.zeros(2, 3) if carrier else torch.ones(2, 3)
        out = policy_objective(logps, None, None, advantages, mask, ObjectiveOptions(beta=0.0))
        entropies = torch.full((2, 3), 4.0)
        phi = (torch.zeros(()), 0) if carrier else (torch.tensor(3.0), 2)
        accumulator.add_loss_step(out, entropies, extras={"vespo/phi_seq_mean": phi}, carrier=carrier)
    summary = accumulator.summarize(accumulator.pack()[None])  # one process
    assert summary.per_step["entropy"] == [4.0]  # not [4.0, 0.0]
    assert summary.per_step["vespo/phi_seq_mean"] == [1.5]
