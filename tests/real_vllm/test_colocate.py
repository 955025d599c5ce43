"""TRL's colocate mode on vLLM's real CPU engine: stock TRL trains with the shim, `GRPOTrainerExt` trains step for
step like it (every importance-sampling mode, LoRA), its sampler-mismatch metrics are those of vLLM's own log-probs,
the non-finite guard keeps a NaN step out of the engine's weights too, dynamic sampling's extra rounds sample through
the engine with one sync per step, and skipping zero-advantage rows changes nothing.

All trainers of this module share the session's engine (`shared_engine`); each pushes its weights at its first
generation. The engine runs in bfloat16 (vLLM's choice for a float32 checkpoint; TRL passes no dtype), the trainer
in float32: that is the sampler/trainer mismatch measured here.
"""

import math

import pytest
import torch
from helpers import WeightRecorder
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from vllm_helpers import (
    DEMO_MODEL,
    ENGINE_LOGP_ATOL,
    ENGINE_LOSS_ATOL,
    TRL_SAMPLING,
    assert_same_batches,
    assert_same_logs,
    recording,
    reversal_reward,
    training_logs,
    vllm_args,
    vllm_rows,
)

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

pytestmark = pytest.mark.usefixtures("shared_engine")

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# Tight bounds, so that every mode truncates or masks part of each batch (the raw ratios lie within ~0.9-1.1).
TIGHT_BOUNDS = dict(vllm_importance_sampling_clip_min=0.995, vllm_importance_sampling_clip_max=1.005)
COMPARED = ("loss", "grad_norm", "reward", "reward_std", "entropy", "clip_ratio/region_mean")


class FirstGradient(TrainerCallback):
    """The gradient of the first optimizer step, flattened."""

    def __init__(self):
        self.gradient = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.gradient is None:
            self.gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.fixture(autouse=True)
def restore_engine_generate():
    """Each trainer of `recording` wraps the shared engine's `generate`; the next test finds it as it was."""
    import cpu_engines

    engine = cpu_engines._SHARED_ENGINE.get("engine")
    yield
    engine = engine or cpu_engines._SHARED_ENGINE.get("engine")
    if engine is not None:
        engine.__dict__.pop("generate", None)


def train(trainer_class, args, dataset, tokenizer, reward=reversal_reward, **kwargs):
    gradient = FirstGradient()
    trainer = recording(trainer_class)(
        model=DEMO_MODEL,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[gradient],
        **kwargs,
    )
    trainer.train()
    trainer.first_gradient = gradient.gradient
    return trainer


def engine_model(trainer):
    """The model inside TRL's colocated engine (this process)."""
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def assert_engine_holds(trainer, weights: dict[str, torch.Tensor]):
    """The engine's weights are `weights` (transformers names, float32), as the engine's dtype rounds them."""
    engine = dict(engine_model(trainer).named_parameters())
    layer = "model.layers.1"
    pairs = {
        f"{layer}.self_attn.o_proj.weight": weights[f"{layer}.self_attn.o_proj.weight"],
        f"{layer}.mlp.down_proj.weight": weights[f"{layer}.mlp.down_proj.weight"],
        f"{layer}.self_attn.qkv_proj.weight": torch.cat(
            [weights[f"{layer}.self_attn.{name}_proj.weight"] for name in "qkv"]
        ),
        # vLLM pads the vocabulary to a multiple of 64; the LM head is the tied embedding
        "model.embed_tokens.weight": weights["model.embed_tokens.weight"],
    }
    for name, expected in pairs.items():
        held = engine[name][: expected.shape[0]]
        assert held.shape == expected.shape, name
        assert torch.equal(held, expected.to(held.dtype)), name


def test_stock_trl_trains_with_the_shim_and_the_engine_follows_the_trainer(reversal_dataset, demo_tokenizer, tmp_path):
    args = GRPOConfig(**vllm_args(tmp_path, learning_rate=3e-2))
    trainer = train(GRPOTrainer, args, reversal_dataset, demo_tokenizer)
    logs = training_logs(trainer.state.log_history)
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)
    # The policy moved far (lr 3e-2), and the engine still samples as the trainer scores: each sync reached every
    # layer, the LM head included (vLLM computes it from a packed copy of the embedding unless the shim is on).
    assert all(entry["sampling/sampling_logp_difference/mean"] < 0.05 for entry in logs)
    trainer.vllm_generation.sync_weights()
    assert_engine_holds(trainer, {n: p.detach() for n, p in trainer.model.named_parameters()})
    first, last = trainer.batches[0], trainer.batches[-1]
    assert not torch.equal(first["completion_ids"], last["completion_ids"])


@pytest.mark.parametrize("mode", MODES)
def test_every_importance_sampling_mode_trains_like_stock_trl(mode, reversal_dataset, demo_tokenizer, tmp_path):
    """The same generated batches (same seed, same engine) give the same loss, gradient and logs; each mode
    truncates or masks part of them (tight bounds)."""
    config = vllm_args(tmp_path, vllm_importance_sampling_mode=mode, **TIGHT_BOUNDS)
    stock = train(GRPOTrainer, GRPOConfig(**config), reversal_dataset, demo_tokenizer)
    ours = train(GRPOTrainerExt, GRPOConfig(**config), reversal_dataset, demo_tokenizer)
    assert_same_batches(ours, stock)
    for theirs, mine in zip(stock.batches, ours.batches, strict=True):
        ratio = theirs["importance_sampling_ratio"]
        bounded = (ratio == 0.995) | (ratio == 1.005) if "truncate" in mode else ratio == 0.0
        assert bounded.any()  # the bounds act on part of every batch
        assert torch.equal(mine["importance_sampling_ratio"], ratio)
    assert_same_logs(ours, stock, COMPARED + TRL_SAMPLING)
    torch.testing.assert_close(
        ours.first_gradient, stock.first_gradient, rtol=1e-4, atol=1e-6 * stock.first_gradient.abs().max().item()
    )
    for entry in training_logs(ours.state.log_history):
        assert 0.0 < entry["sampling/importance_sampling_ratio_raw/outside_fraction"] <= 1.0
        assert math.isfinite(entry["sampling/sampler_k3_kl"])


def test_deepseekmath_s_objective_trains_like_stock_trl_under_vllm(reversal_dataset, demo_tokenizer, tmp_path):
    """GRPOConfigExt's defaults (loss_type="grpo", beta=0.04, no KL bias correction) written as a TRL config: the
    reference model, the KL term and the correction together."""
    config = vllm_args(
        tmp_path,
        loss_type="grpo",
        beta=0.04,
        use_bias_correction_kl=False,
        vllm_importance_sampling_mode="token_truncate",
    )
    stock = train(GRPOTrainer, GRPOConfig(**config), reversal_dataset, demo_tokenizer)
    ours = train(GRPOTrainerExt, GRPOConfig(**config), reversal_dataset, demo_tokenizer)
    assert_same_batches(ours, stock)
    # The engine's side carries the rounding of the synced weights (ENGINE_LOGP_ATOL): the sampling metrics on the
    # engine's log-probs' scale, the rest to 1e-4 relative (2e-5 measured at the third step without AVX-512).
    assert_same_logs(ours, stock, COMPARED + ("kl",), rel=1e-4)
    assert_same_logs(ours, stock, TRL_SAMPLING, abs=ENGINE_LOGP_ATOL)
    torch.testing.assert_close(
        ours.first_gradient, stock.first_gradient, rtol=1e-4, atol=1e-6 * stock.first_gradient.abs().max().item()
    )


def expected_mismatch(batch, rows, trainer_logps, sequence_level, clip_min, clip_max) -> dict[str, float]:
    """The mismatch metrics of one generation, from vLLM's log-probs and the trainer's, in float64."""
    mask = batch["completion_mask"].bool()
    difference = torch.zeros(mask.shape, dtype=torch.float64)
    for index, row in enumerate(rows):
        assert int(mask[index].sum()) == len(row)  # vLLM's completion is the row's completion tokens, EOS included
        difference[index, : len(row)] = trainer_logps[index, : len(row)].double() - torch.tensor(row).double()
    units = difference.sum(dim=1) if sequence_level else difference[mask]
    ratio = units.exp()
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        outside |= ratio < clip_min
    if clip_max is not None:
        outside |= ratio > clip_max
    token = difference[mask]
    return {
        "sampling/importance_sampling_ratio_raw/mean": ratio.mean().item(),
        "sampling/importance_sampling_ratio_raw/min": ratio.min().item(),
        "sampling/importance_sampling_ratio_raw/max": ratio.max().item(),
        "sampling/importance_sampling_ratio_raw/outside_fraction": outside.double().mean().item(),
        "sampling/sampler_k3_kl": (token.exp() - token - 1).mean().item(),
    }


@pytest.mark.parametrize(
    "mode, correction",
    [("token_truncate", True), ("sequence_mask", True), ("token_truncate", False)],
    ids=["token-level", "sequence-level", "correction-off"],
)
def test_the_mismatch_metrics_are_those_of_vllm_s_own_log_probs(
    mode, correction, reversal_dataset, demo_tokenizer, tmp_path
):
    """vLLM's log-probs as its outputs report them (not as TRL's batch carries them) against the trainer's, per
    generation; with the correction off, the trainer's come from the package's own extra forward pass."""
    config = vllm_args(
        tmp_path,
        learning_rate=3e-2,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_correction=correction,
        vllm_importance_sampling_clip_min=0.97,
        vllm_importance_sampling_clip_max=1.03,
    )
    trainer = train(GRPOTrainerExt, GRPOConfigExt(**config), reversal_dataset, demo_tokenizer)
    logs = training_logs(trainer.state.log_history)
    assert len(logs) == len(trainer.batches) == len(trainer.outputs) == 3
    for entry, batch, outputs in zip(logs, trainer.batches, trainer.outputs, strict=True):
        rows = vllm_rows(outputs)
        mask = batch["completion_mask"].bool()
        sampled = torch.cat([torch.tensor(row) for row in rows])
        assert torch.equal(batch["sampling_per_token_logps"][mask], sampled)  # TRL's copy is vLLM's
        if correction:
            torch.testing.assert_close(batch["old_per_token_logps"][mask], batch["own_logps"][mask])
            trainer_logps = batch["old_per_token_logps"]
        else:
            assert "old_per_token_logps" not in batch
            trainer_logps = batch["own_logps"]
        expected = expected_mismatch(batch, rows, trainer_logps, mode.startswith("sequence"), 0.97, 1.03)
        for name, value in expected.items():
            assert entry[name] == pytest.approx(value, rel=1e-4, abs=1e-7), name
        # A bfloat16 engine against a float32 trainer: a small mismatch, not none (the metric sees it) and not a
        # large one (the engine samples with the trainer's current weights).
        assert 1e-6 < entry["sampling/sampler_k3_kl"] < 0.01
        if correction:
            assert "sampling/importance_sampling_ratio/ess" in entry


def test_lora_trains_like_stock_trl_and_the_engine_holds_the_merged_weights(
    reversal_dataset, demo_tokenizer, tmp_path
):
    from transformers import AutoModelForCausalLM

    def lora():
        return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")

    config = vllm_args(tmp_path, learning_rate=5e-2)
    stock = train(GRPOTrainer, GRPOConfig(**config), reversal_dataset, demo_tokenizer, peft_config=lora())
    ours = train(GRPOTrainerExt, GRPOConfig(**config), reversal_dataset, demo_tokenizer, peft_config=lora())
    assert_same_batches(ours, stock)
    assert_same_logs(ours, stock, COMPARED + TRL_SAMPLING)

    def base_weights(trainer):
        named = trainer.model.get_base_model().named_parameters()
        return {n.replace(".base_layer", ""): p.detach().clone() for n, p in named if "lora_" not in n}

    original = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).state_dict()
    model, base = ours.model, base_weights(ours)
    # Each sync merges the adapter, pushes, and unmerges: W + BA - BA gives W back up to float32 rounding (PEFT's
    # arithmetic, stock TRL's too), so the base stays where it was, within an ulp per sync.
    assert all(torch.equal(base[name], value) for name, value in base_weights(stock).items())
    for name, value in base.items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=1e-7)
    ours.vllm_generation.sync_weights()
    with torch.no_grad():
        model.merge_adapter()
        merged = {
            n.replace(".base_layer", ""): p.detach().clone() for n, p in model.get_base_model().named_parameters()
        }
        model.unmerge_adapter()
    assert not torch.equal(
        merged["model.layers.1.self_attn.o_proj.weight"], base["model.layers.1.self_attn.o_proj.weight"]
    )
    assert_engine_holds(ours, merged)
    assert all(
        entry["sampling/sampling_logp_difference/mean"] < 0.05 for entry in training_logs(ours.state.log_history)
    )


class NanLossAtStep2(GRPOTrainerExt):
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        return loss * math.nan if self.state.global_step + 1 == 2 else loss


def test_a_skipped_nan_step_never_reaches_the_engine(reversal_dataset, demo_tokenizer, tmp_path):
    weights = WeightRecorder()
    trainer = recording(NanLossAtStep2)(
        model=DEMO_MODEL,
        reward_funcs=reversal_reward,
        args=GRPOConfigExt(**vllm_args(tmp_path, max_steps=4, nonfinite_policy="skip")),
        train_dataset=reversal_dataset,
        processing_class=demo_tokenizer,
        callbacks=[weights],
    )
    trainer.train()
    before, step1, step2, step3, step4 = weights.snapshots
    assert all(torch.equal(step1[name], step2[name]) for name in step1)  # the NaN step left the weights alone
    assert not all(torch.equal(step2[name], step3[name]) for name in step2)  # and training went on
    logs = training_logs(trainer.state.log_history)
    assert [entry["nonfinite/skipped_steps"] for entry in logs] == [0, 1, 1, 1]
    # Step 3 generated with the weights synced after the skipped step: those of step 1, finite, as scored.
    assert all(math.isfinite(entry["sampling/sampling_logp_difference/max"]) for entry in logs)
    assert logs[2]["sampling/sampling_logp_difference/mean"] < 0.05
    trainer.vllm_generation.sync_weights()
    assert_engine_holds(trainer, {n: p.detach() for n, p in trainer.model.named_parameters()})
    assert all(torch.isfinite(p).all() for p in engine_model(trainer).parameters())


def test_sleep_mode_is_refused_by_the_cpu_engine():
    """`vllm_enable_sleep_mode` needs a GPU engine: vLLM refuses it on its CPU platform, before starting anything."""
    from vllm import LLM

    with pytest.raises(ValueError, match="Sleep mode is not supported"):
        LLM(model=DEMO_MODEL, enable_sleep_mode=True, max_model_len=32)


def half_constant_reward(prompts, completions, solution, **kwargs) -> list[float]:
    """Constant for the prompts of at most 4 letters (their groups have no spread), the reversal reward otherwise."""
    rewards = reversal_reward(completions, solution)
    return [1.0 if len(prompt) <= 5 else value for prompt, value in zip(prompts, rewards, strict=True)]


def counting_syncs(trainer) -> list[int]:
    """The optimizer step (`global_step`) at each of the trainer's weight syncs into the engine."""
    steps, sync = [], trainer.vllm_generation.sync_weights

    def counted():
        steps.append(trainer.state.global_step)
        return sync()

    trainer.vllm_generation.sync_weights = counted
    return steps


def test_dynamic_sampling_generates_its_extra_rounds_with_one_sync_per_step(
    reversal_dataset, demo_tokenizer, tmp_path
):
    trainer = recording(GRPOTrainerExt)(
        model=DEMO_MODEL,
        reward_funcs=half_constant_reward,
        args=GRPOConfigExt(**vllm_args(tmp_path, dynamic_sampling=True)),
        train_dataset=reversal_dataset,
        processing_class=demo_tokenizer,
    )
    syncs = counting_syncs(trainer)
    trainer.train()
    logs = training_logs(trainer.state.log_history)
    assert syncs == [0, 1, 2]  # once per optimizer step, before its first round
    rounds = [entry["dynamic_sampling/rounds"] for entry in logs]
    assert sum(rounds) > 0 and len(trainer.outputs) == len(logs) + sum(rounds)  # extra rounds, each through vLLM
    # Every round sampled with the step's weights, as the trainer scores them.
    for batch in trainer.batches:
        mask = batch["completion_mask"].bool()
        assert (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask].abs().mean() < 0.05


def test_skipping_zero_advantage_rows_changes_nothing_under_vllm(reversal_dataset, demo_tokenizer, tmp_path):
    # Bit-exact batches need a forward whose rows do not depend on which other rows it carries: TRL's padded layout.
    # Packed (the default), skipping changes which completions share a packed row, so the summation order and the
    # weights' last bits; tests/test_extras_skipping.py holds the packed case to TRL's losses and gradient norms.
    config = vllm_args(tmp_path, beta=0.0, loss_type="grpo", padding_free=False)
    skipping = train(
        GRPOTrainerExt,
        GRPOConfigExt(**config, skip_zero_advantage_rows=True),
        reversal_dataset,
        demo_tokenizer,
        reward=half_constant_reward,
    )
    plain = train(
        GRPOTrainerExt, GRPOConfigExt(**config), reversal_dataset, demo_tokenizer, reward=half_constant_reward
    )
    assert_same_batches(skipping, plain)
    # `entropy` and `ratio/*` cover the rows that trained only (docs/sampling.md); the loss and gradient are the
    # plain run's, to the rounding the engine adds after the first weight sync (ENGINE_LOGP_ATOL): 1e-4 relative, the
    # loss (a small difference of terms weighted by the engine's log-probs) to ENGINE_LOSS_ATOL too.
    exact = tuple(key for key in COMPARED if key not in ("entropy", "loss"))
    assert_same_logs(skipping, plain, exact, rel=1e-4)
    assert_same_logs(skipping, plain, ("loss", "loss/policy"), rel=1e-4, abs=ENGINE_LOSS_ATOL)
    assert_same_logs(skipping, plain, TRL_SAMPLING, abs=ENGINE_LOGP_ATOL)  # the engine's log-probs' own scale
    assert all(entry["skipped_rows/fraction"] > 0 for entry in training_logs(skipping.state.log_history))
