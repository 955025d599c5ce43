"""`GRPOTrainerExt` honours every TRL 1.16 GRPO option as stock `trl.GRPOTrainer` does: same per-step metrics.

Each test trains both trainers from the same tiny model, data and seed (num_iterations=2, gradient accumulation 2,
so that ratios move and clip) and compares every metric stock TRL logs. Tolerance rel 1e-5 / abs 1e-6: the two
losses are the same formulas evaluated in another order (selection instead of multiplication by the mask, expm1 for
the KL, the exponential continued linearly only above 20), ~1e-7 relative per step; a different sampled completion,
the only way the runs could drift further, would move `reward` by >= 0.1.
"""

import pytest
import torch
from helpers import CORRECTION_MODES, assert_same_logs, count_a_reward, tiny_lora, train_logs, use_sampler_stand_in
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOTrainerExt

# Both trainers take TRL's own config; generations are reused (ratios move and clip).
TRL_RUN = {"config_cls": GRPOConfig, "num_iterations": 2, "gradient_accumulation_steps": 2}


def length_reward(completions, **kwargs):
    return [float(len(completion) % 3) for completion in completions]


def assert_terms_add_up(logs, terms):
    for entry in logs:
        total = sum(entry[f"loss/{term}"] for term in terms)
        assert total == pytest.approx(entry["loss"], rel=1e-4, abs=1e-6)


# name -> (TRL options, the loss terms the split must show). Values are chosen so that each option binds in these
# runs: delta below the largest ratios, an off-policy threshold below the KL of negative-advantage rows, ...
OPTIONS = {
    "trl-defaults": ({}, ("policy", "kl_penalty")),
    "bnpo": ({"loss_type": "bnpo", "beta": 0.04}, ("policy", "kl_penalty")),
    "dr_grpo": ({"loss_type": "dr_grpo", "beta": 0.04}, ("policy", "kl_penalty")),
    "dapo": ({"loss_type": "dapo", "beta": 0.04}, ("policy", "kl_penalty")),
    "luspo-sequence": (
        {"loss_type": "luspo", "beta": 0.04, "importance_sampling_level": "sequence"},
        ("policy", "kl_penalty"),
    ),
    "cispo": ({"loss_type": "cispo", "beta": 0.04, "epsilon_high": 1.1}, ("policy", "kl_penalty")),
    "sapo": ({"loss_type": "sapo", "beta": 0.04}, ("policy", "kl_penalty")),
    "vespo": ({"loss_type": "vespo", "beta": 0.04}, ("policy", "kl_penalty")),
    "grpo-sequence-level": (
        {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"},
        ("policy", "kl_penalty"),
    ),
    "delta": ({"loss_type": "grpo", "beta": 0.04, "delta": 1.3}, ("policy", "kl_penalty")),
    "bias-corrected-kl": (
        {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True},
        ("policy", "kl_penalty"),
    ),
    "top-entropy-quantile": (
        {"loss_type": "grpo", "beta": 0.04, "top_entropy_quantile": 0.5},
        ("policy", "kl_penalty"),
    ),
    "off-policy-mask": (
        {"loss_type": "grpo", "beta": 0.04, "off_policy_mask_threshold": 0.01},
        ("policy", "kl_penalty"),
    ),
    "entropy-bonus": (
        {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01},
        ("policy", "kl_penalty", "entropy_bonus"),
    ),
    "adaptive-entropy": (
        {"loss_type": "grpo", "beta": 0.04, "use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 5.0},
        ("policy", "kl_penalty", "entropy_bonus"),
    ),
    "batch-reward-scaling": ({"loss_type": "grpo", "beta": 0.04, "scale_rewards": "batch"}, ("policy", "kl_penalty")),
}
FAST = {"trl-defaults", "dapo", "vespo"}  # the rest run with the slow tests (CI runs them)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in OPTIONS]
)
def test_each_trl_option_trains_step_for_step_like_stock_trl(
    name, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    options, terms = OPTIONS[name]
    stock, _ = train_logs(tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **TRL_RUN, **options)
    ours, trainer = train_logs(tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **TRL_RUN, **options)
    assert assert_same_logs(stock, ours) >= 40
    assert_terms_add_up(ours, terms)
    assert all("ratio/p50" in entry for entry in ours)  # this package's diagnostics, for every option


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_lora_with_other_loss_types_trains_like_stock_trl(
    loss_type, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    options = {"loss_type": loss_type, "beta": 0.04, "learning_rate": 5e-2}

    stock, _ = train_logs(
        tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **TRL_RUN, peft_config=tiny_lora(), **options
    )
    ours, _ = train_logs(
        tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **TRL_RUN, peft_config=tiny_lora(), **options
    )
    assert assert_same_logs(stock, ours) >= 40


@pytest.mark.slow
def test_normalize_then_sum_of_several_rewards_trains_like_stock_trl(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    options = {"loss_type": "grpo", "beta": 0.04, "multi_objective_aggregation": "normalize_then_sum"}
    rewards = [count_a_reward, length_reward]
    stock, _ = train_logs(
        tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **TRL_RUN, reward_funcs=rewards, **options
    )
    ours, _ = train_logs(
        tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **TRL_RUN, reward_funcs=rewards, **options
    )
    assert assert_same_logs(stock, ours) >= 40


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_vllm_importance_sampling_correction_trains_like_stock_trl(
    mode, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    use_sampler_stand_in(monkeypatch)
    options = {
        "loss_type": "grpo",
        "beta": 0.04,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": mode,
        # bounds that bind for some tokens (sequences) with the stand-in's +-0.05 offsets
        "vllm_importance_sampling_clip_min": 0.97 if mode.startswith("token") else 1.0,
        "vllm_importance_sampling_clip_max": 1.03 if mode.startswith("token") else 1.08,
    }
    stock, _ = train_logs(tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **TRL_RUN, **options)
    ours, _ = train_logs(tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **TRL_RUN, **options)
    assert assert_same_logs(stock, ours) >= 40
    prefix = "sampling/importance_sampling_ratio_raw"
    generated = [entry for entry in ours if f"{prefix}/p50" in entry]
    assert len(generated) == 2  # the steps that generated (num_iterations=2)
    for entry in generated:
        assert entry[f"{prefix}/min"] <= entry[f"{prefix}/p05"] <= entry[f"{prefix}/p50"]
        assert entry[f"{prefix}/p50"] <= entry[f"{prefix}/p95"] <= entry[f"{prefix}/max"]
        assert 0.0 < entry[f"{prefix}/outside_fraction"] < 1.0  # the bounds bind for some, not all
        corrected_max = entry["sampling/importance_sampling_ratio/max"]  # TRL's, after truncation or masking
        assert corrected_max <= options["vllm_importance_sampling_clip_max"] + 1e-6
        assert corrected_max <= entry[f"{prefix}/max"] + 1e-6


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    """A tiny Qwen3 Mixture-of-Experts model (4 experts, 2 per token) with the character tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_grpo_ext.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny_moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_mixture_of_experts_router_loss_trains_like_stock_trl(loss_type, tiny_moe_path, prompt_dataset, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path)
    options = {"loss_type": loss_type, "beta": 0.04}
    stock, _ = train_logs(
        tmp_path / "s", tiny_moe_path, tokenizer, prompt_dataset, trainer_cls=GRPOTrainer, **TRL_RUN, **options
    )
    ours, trainer = train_logs(
        tmp_path / "o", tiny_moe_path, tokenizer, prompt_dataset, trainer_cls=GRPOTrainerExt, **TRL_RUN, **options
    )
    assert trainer.aux_loss_enabled
    assert assert_same_logs(stock, ours) >= 40
    assert all(entry["aux_loss"] > 0 and entry["loss/router"] > 0 for entry in ours)
    assert_terms_add_up(ours, ("policy", "kl_penalty", "router"))
