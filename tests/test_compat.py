"""The supported TRL and transformers releases: version checks, refused options, and behaviour that must not vary."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import trl
from helpers import count_a_reward, tiny_grpo_args
from packaging.version import Version
from peft import LoraConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext._compat import (
    check_transformers_version,
    check_trl_version,
    options_missing_from_trl,
    seed_before_model_init,
)

INSTALLED_TRL = Version(trl.__version__)
# The tests train on the CPU, which TRL 1.15's log-prob kernel cannot run on (its refusal is tested below).
trains_on_cpu = pytest.mark.skipif(
    Version("1.15.0") <= INSTALLED_TRL < Version("1.16.0"), reason="TRL 1.15 trains on CUDA or XPU devices only"
)


class TestTrlVersionGuard:
    @pytest.mark.parametrize("version", ["1.14.0", "1.14.2", "1.15.0", "1.16.0", "1.16.9"])
    def test_the_tested_range_is_silent(self, version):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_trl_version(version)

    @pytest.mark.parametrize("version", ["1.13.0", "1.17.0", "2.0.0"])
    def test_untested_versions_warn_with_the_range(self, version):
        with pytest.warns(UserWarning, match=r"tested with trl>=1.14.0,<1.17.0; trl " + version):
            check_trl_version(version)

    def test_versions_with_another_loss_hook_are_refused(self):
        with pytest.raises(ImportError, match=r"needs trl>=1.14.0,<1.17.0; trl 0.19.1 is installed"):
            check_trl_version("0.19.1")


class TestTransformersVersionGuard:
    @pytest.mark.parametrize("version", ["5.5.3", "5.2.0", "4.57.6"])
    def test_a_transformers_that_divides_the_loss_twice_is_refused(self, version):
        with pytest.raises(
            ImportError, match=rf"needs transformers>=5\.5\.4; transformers {version} is installed"
        ) as error:
            check_transformers_version(version)
        assert "gradient accumulation" in str(error.value)

    @pytest.mark.parametrize("version", ["5.5.4", "5.18.0", "5.24.0", "6.0.0"])
    def test_later_releases_pass(self, version):
        check_transformers_version(version)


class TestOptionsOfNewerTrl:
    def test_an_option_value_the_installed_trl_lacks_is_named_with_the_trl_that_adds_it(self):
        problems = options_missing_from_trl(SimpleNamespace(pad_to_multiple_of="auto"), trl_version="1.14.2")
        assert len(problems) == 1
        assert problems[0].startswith("pad_to_multiple_of='auto' needs trl>=1.16.0 (trl 1.14.2 is installed)")

    def test_the_same_value_is_accepted_where_trl_has_it(self):
        args = SimpleNamespace(pad_to_multiple_of="auto", device=torch.device("cpu"))
        assert options_missing_from_trl(args, trl_version="1.16.0") == []

    def test_other_values_are_accepted_by_older_trl(self):
        for value in (None, 64):
            assert options_missing_from_trl(SimpleNamespace(pad_to_multiple_of=value), trl_version="1.14.0") == []

    @pytest.mark.parametrize("device", ["cpu", "mps"])
    def test_trl_1_15_refuses_devices_its_triton_kernel_cannot_run_on(self, device):
        args = SimpleNamespace(pad_to_multiple_of=None, device=torch.device(device))
        problems = options_missing_from_trl(args, trl_version="1.15.0")
        assert len(problems) == 1
        assert problems[0].startswith(f"Training on a {device} device needs trl>=1.16.0 (trl 1.15.0 is installed)")
        assert "Triton" in problems[0]
        for trl_version in ("1.14.0", "1.16.0"):
            assert options_missing_from_trl(args, trl_version=trl_version) == []

    @pytest.mark.skipif(INSTALLED_TRL >= Version("1.16.0"), reason="TRL 1.16 implements pad_to_multiple_of='auto'")
    def test_the_trainer_refuses_it_at_construction(self, tiny_model_path, prompt_dataset, tmp_path):
        args = GRPOConfigExt(**tiny_grpo_args(tmp_path, pad_to_multiple_of="auto"))
        with pytest.raises(ValueError, match=r"pad_to_multiple_of='auto' needs trl>=1\.16\.0"):
            GRPOTrainerExt(model=tiny_model_path, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset)

    @pytest.mark.skipif(INSTALLED_TRL < Version("1.16.0"), reason="TRL before 1.16 has no pad_to_multiple_of='auto'")
    def test_the_trainer_accepts_it_where_trl_has_it(self, tiny_model_path, prompt_dataset, tmp_path):
        args = GRPOConfigExt(**tiny_grpo_args(tmp_path, pad_to_multiple_of="auto"))
        trainer = GRPOTrainerExt(
            model=tiny_model_path, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset
        )
        assert trainer.args.pad_to_multiple_of is None  # TRL resolves "auto" to no padding off Neuron

    @pytest.mark.skipif(
        not Version("1.15.0") <= INSTALLED_TRL < Version("1.16.0"), reason="only TRL 1.15 lacks a CPU log-prob path"
    )
    def test_the_trainer_refuses_a_cpu_run_with_trl_1_15(self, tiny_model_path, prompt_dataset, tmp_path):
        args = GRPOConfigExt(**tiny_grpo_args(tmp_path))
        with pytest.raises(ValueError, match=r"Training on a cpu device needs trl>=1\.16\.0 \(trl 1\.15\.0 is"):
            GRPOTrainerExt(model=tiny_model_path, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset)


class TestSeeding:
    def test_trl_before_1_15_gets_the_seed_before_the_model_is_built(self):
        torch.manual_seed(123)
        seed_before_model_init(SimpleNamespace(seed=7), trl_version="1.14.2")
        drawn = torch.rand(4)
        torch.manual_seed(7)
        assert torch.equal(drawn, torch.rand(4))

    def test_trl_that_seeds_itself_is_left_alone(self):
        torch.manual_seed(123)
        seed_before_model_init(SimpleNamespace(seed=7), trl_version="1.15.0")
        drawn = torch.rand(4)
        torch.manual_seed(123)
        assert torch.equal(drawn, torch.rand(4))

    @trains_on_cpu
    def test_lora_adapters_start_alike_whatever_the_global_rng_held(self, tiny_model_path, prompt_dataset, tmp_path):
        # A resumed run and its reference are separate processes: their adapters must start from the same weights.
        adapters = []
        for rng_state in (1, 2):
            torch.manual_seed(rng_state)
            trainer = GRPOTrainerExt(
                model=tiny_model_path,
                reward_funcs=count_a_reward,
                args=GRPOConfigExt(**tiny_grpo_args(tmp_path)),
                train_dataset=prompt_dataset,
                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
            )
            adapters.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_A" in n})
        assert adapters[0] and adapters[0].keys() == adapters[1].keys()
        assert any(weight.abs().sum() > 0 for weight in adapters[0].values())
        for name, weight in adapters[0].items():
            assert torch.equal(weight, adapters[1][name]), name


@trains_on_cpu
def test_gradient_accumulation_gives_the_gradient_of_the_whole_batch(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    # Two micro-batches of 4 and one batch of 8 hold the same 8 completions (one generation batch either way): the
    # accumulated gradient must be the same. With transformers < 5.5.4 it was half of it.
    logs = []
    for batch_size, accumulation in ((8, 1), (4, 2)):
        args = GRPOConfigExt(
            **tiny_grpo_args(
                tmp_path / str(accumulation),
                per_device_train_batch_size=batch_size,
                gradient_accumulation_steps=accumulation,
                max_steps=1,
            )
        )
        trainer = GRPOTrainerExt(
            model=tiny_model_path,
            reward_funcs=count_a_reward,
            args=args,
            train_dataset=prompt_dataset,
            processing_class=tiny_tokenizer,
        )
        trainer.train()
        logs.append(next(entry for entry in trainer.state.log_history if "loss" in entry))
    whole, accumulated = logs
    assert whole["completions/mean_length"] == accumulated["completions/mean_length"]
    assert whole["grad_norm"] > 0
    assert accumulated["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
