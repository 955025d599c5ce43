"""`GRPOConfigExt` defaults and field documentation."""

import dataclasses
import re

import pytest
from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt


def test_defaults_are_deepseekmath_s_objective(tmp_path):
    config = GRPOConfigExt(output_dir=str(tmp_path))
    assert config.beta == 0.04
    assert config.epsilon == 0.2
    assert config.epsilon_high is None
    assert config.loss_type == "grpo"
    assert config.use_bias_correction_kl is False
    assert config.scale_rewards == "group"


def test_defaults_differ_from_trl_where_deepseekmath_does(tmp_path):
    stock = GRPOConfig(output_dir=str(tmp_path), bf16=False)
    assert (stock.beta, stock.loss_type, stock.use_bias_correction_kl) == (0.0, "dapo", True)


def test_bf16_is_on_only_where_a_bf16_gpu_is_used(tmp_path):
    assert GRPOConfigExt(output_dir=str(tmp_path)).bf16 == is_torch_bf16_gpu_available()
    assert GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True).bf16 is False
    assert GRPOConfigExt(output_dir=str(tmp_path), bf16=False).bf16 is False


def test_every_field_declared_here_has_help_text():
    own = GRPOConfigExt.__dict__["__annotations__"]
    fields = {field.name: field for field in dataclasses.fields(GRPOConfigExt)}
    assert own
    for name in own:
        assert fields[name].metadata.get("help"), name


def test_is_a_trl_grpo_config(tmp_path):
    assert isinstance(GRPOConfigExt(output_dir=str(tmp_path)), GRPOConfig)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ratio_quantiles": 0.95}, "`ratio_quantiles` must be a list of numbers (e.g. [0.05, 0.5, 0.95]), got 0.95."),
        ({"heldout_pass_at": 4}, "`heldout_pass_at` must be a list of whole numbers (e.g. [1, 4]), got 4."),
        ({"heldout_pass_at": [2.5]}, "`heldout_pass_at` must be a list of whole numbers (e.g. [1, 4]), got [2.5]."),
        ({"reward_weights": 1.0}, "`reward_weights` must be a list of numbers (e.g. [1.0, 0.5]), got 1.0."),
        ({"reward_weights": ["a"]}, "`reward_weights` must be a list of numbers (e.g. [1.0, 0.5]), got ['a']."),
    ],
)
def test_a_scalar_or_a_fraction_for_a_list_field_is_one_sentence_naming_it(fields, message, tmp_path):
    with pytest.raises(ValueError) as error:
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, **fields)
    assert str(error.value) == message


def test_list_fields_take_whole_floats_as_numbers(tmp_path):
    config = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, ratio_quantiles=[0, 1], heldout_pass_at=[1.0, 4])
    assert config.ratio_quantiles == [0.0, 1.0] and config.heldout_pass_at == [1, 4]


def test_an_unknown_loss_type_is_named_with_the_known_ones_before_any_model_loads(tmp_path):
    known = "('grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo', 'cispo', 'sapo', 'vespo')"
    with pytest.raises(ValueError, match=re.escape(f"`loss_type` must be one of {known}, got 'grpoo'.")):
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, loss_type="grpoo")
    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_type="grpoo")
    with pytest.raises(ValueError, match="got 'grpoo'"):  # before the model (a path that does not exist) loads
        GRPOTrainerExt(model=str(tmp_path / "no-model"), reward_funcs=len, args=plain, train_dataset=None)


def test_a_kernel_asked_for_outside_its_domain_is_refused_in_one_sentence():
    with pytest.raises(ValueError) as refused:
        GRPOConfigExt(output_dir="unused", loss_implementation="fused", top_entropy_quantile=0.5, use_cpu=True)
    assert str(refused.value).startswith(
        "loss_implementation='fused' cannot compute this objective: it takes no per-token weights (off-policy or "
        "entropy masks, vLLM's correction). Use loss_implementation='reference' (the default)."
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "`padding_free_row_tokens` must be an integer >= 1, got True (a bool)."),
        (2048.0, "`padding_free_row_tokens` must be an integer >= 1, got 2048.0 (a float)."),
        ("2048", "`padding_free_row_tokens` must be an integer >= 1, got '2048' (a str)."),
        (0, "`padding_free_row_tokens` must be >= 1, got 0."),
    ],
)
def test_an_integer_field_refuses_bools_and_non_integers_in_one_sentence(value, message, tmp_path):
    """`padding_free_row_tokens=True` was a budget of one token (a bool is an int): every sequence in a row of its
    own, at the padded forward's speed, silently."""
    with pytest.raises(ValueError) as error:
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, padding_free_row_tokens=value)
    assert str(error.value) == message
    config = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, padding_free_row_tokens=1)
    assert config.padding_free_row_tokens == 1


def test_reward_weights_of_a_plain_trl_config_are_refused_before_any_model_loads(tmp_path):
    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, reward_weights=[1.0])
    plain.reward_weights = 1.0  # TRL's own config keeps what it is given
    with pytest.raises(ValueError, match=re.escape("`reward_weights` must be a list of numbers")):
        GRPOTrainerExt(model=str(tmp_path / "no-model"), reward_funcs=len, args=plain, train_dataset=None)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"per_device_train_batch_size": 3},
            "`per_device_train_batch_size` (3) must give whole groups of `num_generations` (8) completions: the "
            "generation batch (per_device_train_batch_size 3 x 1 process x steps_per_generation 1 = 3) is not a "
            "multiple of 8. Set per_device_train_batch_size to a multiple of 8 (e.g. 8), or `num_generations` to a "
            "divisor of 3 (e.g. 3).",
        ),
        (
            {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2},
            "`per_device_train_batch_size` (6) must give whole groups of `num_generations` (8) completions: the "
            "generation batch (per_device_train_batch_size 6 x 1 process x steps_per_generation 2 = 12) is not a "
            "multiple of 8. Set per_device_train_batch_size to a multiple of 4 (e.g. 8), or `num_generations` to a "
            "divisor of 12 (e.g. 6).",
        ),
        (
            {"per_device_train_batch_size": 4, "generation_batch_size": 12},
            "`generation_batch_size` (12) must be a multiple of `num_generations` (8): each prompt's 8 completions "
            "are generated in one batch. Set it to 8 or 16.",
        ),
    ],
)
def test_a_batch_without_whole_groups_names_the_field_set_and_a_value_that_works(fields, message, tmp_path):
    """TRL said `generation_batch_size (3) must be divisible by num_generations (8)`, a field the user never set."""
    with pytest.raises(ValueError) as error:
        GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, num_generations=8, **fields)
    assert str(error.value) == message


def test_the_configuration_adds_at_most_30_fields_to_trl_s():
    """A user tunes a few options: the alarm thresholds are one mapping, each feature a handful of fields."""
    stock = {spec.name for spec in dataclasses.fields(GRPOConfig)}
    added = [spec.name for spec in dataclasses.fields(GRPOConfigExt) if spec.name not in stock]
    assert len(added) <= 30, added
