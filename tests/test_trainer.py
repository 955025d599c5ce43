"""`GRPOTrainerExt` against stock TRL with DeepSeekMath's GRPO objective, and its LoRA behaviour (other TRL options:
`test_trainer_loss_types.py`)."""

import gc

import pytest
import torch
from helpers import count_a_reward, tiny_grpo_args, tiny_lora, train_logs
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

# Metrics both trainers log. Equal within float32 rounding: the two losses are the same formula, evaluated in a
# different order (selection instead of multiplication by the mask), so the per-step results agree to ~1e-7
# relative; over four steps of lr 1e-2 the weights stay within ~1e-6 of each other. A different sampled completion
# (the only way the runs could diverge further) would move `reward` by >= 0.1, far outside the tolerance.
COMPARED = [
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "reward",
    "reward_std",
    "rewards/count_a_reward/mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "completions/mean_length",
]
RTOL, ATOL = 1e-5, 1e-6
REUSED = {"num_iterations": 2, "gradient_accumulation_steps": 2}  # reused generations: ratios move and clip


@pytest.mark.parametrize(
    "use_lora, implementation", [(False, None), (True, None), (False, "fused")], ids=["full", "lora", "full-fused"]
)
def test_trains_step_for_step_like_stock_trl_grpo(
    use_lora, implementation, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    """With the default configuration the formula trains (the opt-in kernel is never called); with the kernel asked
    for, it trains the same steps."""
    from trl_grpo_ext.ops import objective

    kernel_calls = []
    kernel_loss = objective.kernel_loss
    monkeypatch.setattr(objective, "kernel_loss", lambda *a, **k: kernel_calls.append(1) or kernel_loss(*a, **k))

    def lora():
        return tiny_lora() if use_lora else None

    # Adapters start at zero and move slowly: a larger step makes the reused batches clip in both modes.
    learning_rate = 5e-2 if use_lora else 1e-2

    stock, _ = train_logs(
        tmp_path / "stock",
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=GRPOTrainer,
        config_cls=GRPOConfig,
        peft_config=lora(),
        learning_rate=learning_rate,
        loss_type="grpo",
        beta=0.04,
        epsilon=0.2,
        use_bias_correction_kl=False,
        **REUSED,
    )
    ours, _ = train_logs(
        tmp_path / "ours",
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=GRPOTrainerExt,
        config_cls=GRPOConfigExt,
        peft_config=lora(),
        learning_rate=learning_rate,
        **({} if implementation is None else {"loss_implementation": implementation}),
        **REUSED,
    )

    assert bool(kernel_calls) == (implementation is not None)
    assert len(stock) == len(ours) == 4
    compared = 0
    for step, (expected, got) in enumerate(zip(stock, ours, strict=True), start=1):
        for key in COMPARED:
            assert (key in expected) == (key in got), (step, key)
            if key in expected and expected[key] is not None:
                assert got[key] == pytest.approx(expected[key], rel=RTOL, abs=ATOL), (step, key)
                compared += 1
    # Steps 2 and 4 reuse the generation batch (num_iterations=2): their ratios move and some tokens clip.
    assert any(entry["clip_ratio/region_mean"] > 0 for entry in ours)
    assert any(entry["kl"] > 0 for entry in ours)
    assert compared >= 40


def test_lora_trains_only_adapters_and_uses_the_base_model_as_reference(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    seen_ref_logps = []

    class RecordingTrainer(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            seen_ref_logps.append(
                (
                    inputs["prompt_ids"],
                    inputs["prompt_mask"],
                    inputs["completion_ids"],
                    inputs["completion_mask"],
                    inputs["ref_per_token_logps"],
                )
            )
            return super()._compute_loss(model, inputs)

    args = GRPOConfigExt(**tiny_grpo_args(tmp_path, num_iterations=2, learning_rate=5e-2))
    # Models that earlier tests left alive (held until this test ends, so that no id is reused) are not counted.
    gc.collect()
    alive_before = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Module)]
    models_before = {id(obj) for obj in alive_before}
    trainer = RecordingTrainer(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
        peft_config=tiny_lora(),
    )
    trainable = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    base_before = {
        name: param.detach().clone() for name, param in trainer.model.named_parameters() if "lora_" not in name
    }
    adapters_before = {name: trainer.model.get_parameter(name).detach().clone() for name in trainable}

    # No second model in memory: the reference is the policy with its adapters disabled.
    assert trainer.ref_model is None
    gc.collect()
    causal_lm_class = type(trainer.model.get_base_model())
    built_here = [obj for obj in gc.get_objects() if type(obj) is causal_lm_class and id(obj) not in models_before]
    assert len(built_here) == 1

    trainer.train()

    for name, before in base_before.items():
        assert torch.equal(trainer.model.get_parameter(name), before), name
    assert any(not torch.equal(trainer.model.get_parameter(name), before) for name, before in adapters_before.items())

    # The reference log-probs used in every step are those of the untouched base model, loaded afresh.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert len(seen_ref_logps) == 4
    for prompt_ids, prompt_mask, completion_ids, completion_mask, ref_logps in seen_ref_logps:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        with torch.no_grad():
            logits = base(input_ids, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1)).logits
        logps = torch.log_softmax(logits[:, -completion_ids.size(1) - 1 : -1].float(), dim=-1)
        expected = logps.gather(-1, completion_ids[..., None]).squeeze(-1)
        mask = completion_mask.bool()
        torch.testing.assert_close(ref_logps[mask], expected[mask], rtol=1e-4, atol=1e-5)


def test_the_formula_trains_by_default_and_the_removed_auto_is_refused_naming_it(tmp_path):
    assert GRPOConfigExt(**tiny_grpo_args(tmp_path)).loss_implementation == "reference"
    with pytest.raises(ValueError, match="`loss_implementation='auto'` was removed: the formula, "):
        GRPOConfigExt(**tiny_grpo_args(tmp_path, loss_implementation="auto"))


def test_the_fused_kernel_serves_every_clipped_objective_and_an_explicit_kernel_is_never_ignored(tmp_path):
    from trl_grpo_ext.config import fused_kernel_problems

    assert not fused_kernel_problems(GRPOConfigExt(**tiny_grpo_args(tmp_path)))
    assert not fused_kernel_problems(GRPOConfig(**tiny_grpo_args(tmp_path)))  # TRL's defaults: dapo, beta 0
    # The bias-correction flag has no effect without a KL term; reward scaling happens before the loss.
    for option in (dict(beta=0.0, use_bias_correction_kl=True), dict(scale_rewards="batch"), dict(loss_type="bnpo")):
        assert not fused_kernel_problems(GRPOConfigExt(**tiny_grpo_args(tmp_path, **option))), option
    for option in (
        dict(loss_type="sapo"),
        dict(importance_sampling_level="sequence"),
        dict(delta=1.5),
        dict(use_bias_correction_kl=True),
        dict(top_entropy_quantile=0.5),
        dict(off_policy_mask_threshold=0.5),
    ):
        assert fused_kernel_problems(GRPOConfigExt(**tiny_grpo_args(tmp_path, **option))), option
        for implementation in ("fused", "compiled"):
            with pytest.raises(ValueError, match=f"loss_implementation='{implementation}' cannot compute"):
                GRPOConfigExt(**tiny_grpo_args(tmp_path, loss_implementation=implementation, **option))


def test_model_card_carries_the_project_tag(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path))
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.create_model_card(model_name="tiny-grpo")
    card = (tmp_path / "README.md").read_text()
    front_matter = card.split("---")[1]
    for tag in ("trl", "grpo", "trl_grpo_ext"):
        assert f"- {tag}\n" in front_matter


def test_default_args_are_deepseekmath_s_config(
    tiny_model_path, tiny_tokenizer, prompt_dataset, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    assert isinstance(trainer.args, GRPOConfigExt)
    assert trainer.args.output_dir.endswith("-GRPO")
    assert (trainer.beta, trainer.loss_type, trainer.epsilon_low) == (0.04, "grpo", 0.2)


def test_trl_s_positional_arguments_are_taken(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    config = tiny_grpo_args(tmp_path, loss_type="grpo", beta=0.04, use_bias_correction_kl=False, max_steps=2)
    stock = GRPOTrainer(tiny_model_path, count_a_reward, GRPOConfig(**config), prompt_dataset, None, tiny_tokenizer)
    stock.train()
    ours = GRPOTrainerExt(tiny_model_path, count_a_reward, GRPOConfig(**config), prompt_dataset, None, tiny_tokenizer)
    ours.train()
    assert ours.train_dataset is prompt_dataset and ours.processing_class is tiny_tokenizer
    losses = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (stock, ours)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    with pytest.raises(TypeError, match="multiple values for argument 'train_dataset'"):
        GRPOTrainerExt(tiny_model_path, count_a_reward, GRPOConfig(**config), prompt_dataset, train_dataset=[])


def test_the_loss_split_adds_up_when_optimizer_steps_have_different_micro_batch_counts(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    from datasets import Dataset

    # 4 prompts x 4 completions, one prompt per micro-batch: an epoch is 4 micro-batches, steps of 3 and 1.
    dataset = Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="]})
    config = tiny_grpo_args(
        tmp_path, gradient_accumulation_steps=3, steps_per_generation=2, logging_steps=2, max_steps=4
    )
    trainer = GRPOTrainerExt(
        tiny_model_path, count_a_reward, GRPOConfigExt(**config), dataset, processing_class=tiny_tokenizer
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs
    for entry in logs:
        assert entry["loss/policy"] + entry["loss/kl_penalty"] == pytest.approx(entry["loss"], rel=1e-4, abs=1e-6)
