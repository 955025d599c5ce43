"""`GRPOConfigExt` defaults and field documentation."""

import dataclasses

from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt


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
