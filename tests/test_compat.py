"""The supported TRL and transformers releases: version checks, refused options, and behaviour that must not vary."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import trl
from helpers import count_a_reward, tiny_grpo_args
from packaging.version import Version
from peft import LoraConfig

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt, _compat
from trl_grpo_ext._compat import (
    CALLED_METHODS,
    OVERRIDDEN_HOOKS,
    TRL_ATTRIBUTES,
    TRL_VLLM_ATTRIBUTES,
    IncompatibleTRLError,
    check_transformers_version,
    check_trl_surface,
    check_trl_version,
    is_tested_trl,
    options_missing_from_trl,
    seed_before_model_init,
    trl_surface_differences,
    trl_surface_summary,
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
    def test_an_untested_release_imports_silently_its_hooks_are_checked_when_the_trainer_is_built(self, version):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_trl_version(version)
        assert not is_tested_trl(version)

    def test_versions_with_another_loss_hook_are_refused(self):
        with pytest.raises(ImportError, match=r"needs trl>=1.14.0,<1.17.0; trl 0.19.1 is installed"):
            check_trl_version("0.19.1")


class _StopBeforeTheModel(Exception):
    """Raised by the check that follows TRL's surface check in `GRPOTrainerExt.__init__`, before any model loads."""


def _build_until_the_model_would_load(monkeypatch, tmp_path):
    """Build a `GRPOTrainerExt` up to the check after TRL's surface check (its dataset check), which stops it."""
    import trl_grpo_ext.trainer

    def stop(*args):
        raise _StopBeforeTheModel

    monkeypatch.setattr(trl_grpo_ext.trainer, "check_train_dataset", stop)
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path))
    GRPOTrainerExt(model=str(tmp_path / "no-model"), reward_funcs=count_a_reward, args=args, train_dataset=None)


class TestTrlSurfaceCheck:
    """Where the trainer is built, the hooks it overrides, the TRL methods it calls and the attributes it reads are
    compared with the installed TRL: a newer release whose surface matches warns once, naming it; a difference is one
    error naming the hook and what changed, before any model loads."""

    def test_the_installed_trl_matches_every_pin(self):
        differences, compared = trl_surface_differences()
        assert differences == []
        assert compared == len(OVERRIDDEN_HOOKS) + len(CALLED_METHODS) + len(TRL_ATTRIBUTES) + len(TRL_VLLM_ATTRIBUTES)

    @trains_on_cpu
    def test_a_tested_release_builds_without_a_word(self, monkeypatch, tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with pytest.raises(_StopBeforeTheModel):
                _build_until_the_model_would_load(monkeypatch, tmp_path)

    @trains_on_cpu
    def test_a_newer_release_whose_surface_matches_warns_naming_it_before_any_model_loads(self, monkeypatch, tmp_path):
        monkeypatch.setattr(trl, "__version__", "1.19.0")
        with pytest.warns(UserWarning) as caught, pytest.raises(_StopBeforeTheModel):
            _build_until_the_model_would_load(monkeypatch, tmp_path)
        (warning,) = [w for w in caught if "trl 1.19.0" in str(w.message)]
        assert str(warning.message).startswith(
            "trl 1.19.0 is untested (tested: trl>=1.14.0,<1.17.0); the 54 TRL hooks, methods and attributes "
            "GRPOTrainerExt overrides, calls or reads match it."
        )

    @pytest.mark.parametrize(
        ("hook", "changed", "message"),
        [
            (
                "log",
                lambda self, logs: None,
                "GRPOTrainer.log(self, logs) no longer takes 'start_time', which GRPOTrainerExt passes",
            ),
            (
                "_calculate_rewards",
                lambda self, inputs, prompts, completions, completion_ids_list, tools=None: None,
                "GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, completion_ids_list, tools=None) "
                "takes 'tools', which GRPOTrainerExt's override does not know",
            ),
            (
                "_compute_loss",
                lambda self, model, inputs, scale: None,
                "GRPOTrainer._compute_loss(self, model, inputs, scale) now requires 'scale', which GRPOTrainerExt "
                "does not pass",
            ),
            (
                "get_high_entropy_mask",
                None,
                "GRPOTrainer.get_high_entropy_mask is gone",
            ),
        ],
    )
    @trains_on_cpu  # TRL 1.15 refuses the CPU before the check runs
    def test_a_changed_hook_is_one_error_naming_it_and_the_change_before_any_model_loads(
        self, hook, changed, message, monkeypatch, tmp_path
    ):
        monkeypatch.setattr(trl, "__version__", "1.19.0")
        if changed is None:
            monkeypatch.delattr(trl.GRPOTrainer, hook)
        else:
            changed.__name__ = hook
            monkeypatch.setattr(trl.GRPOTrainer, hook, changed)
        with pytest.raises(IncompatibleTRLError) as error:
            _build_until_the_model_would_load(monkeypatch, tmp_path)
        assert str(error.value) == (
            f"trl 1.19.0 differs from what GRPOTrainerExt overrides, calls or reads: {message}. Install a tested "
            "release: pip install 'trl>=1.14.0,<1.17.0'."
        )

    def test_an_attribute_trl_no_longer_sets_is_named(self, monkeypatch):
        """TRL renames `_buffered_inputs` in a newer release: its source no longer assigns the name."""
        original = _compat.inspect.getsource

        def renamed(obj):
            source = original(obj)
            return (
                source.replace("self._buffered_inputs", "self._buffered_batches") if obj is trl.GRPOTrainer else source
            )

        monkeypatch.setattr(_compat.inspect, "getsource", renamed)
        _compat._assigned_attributes.cache_clear()
        try:
            differences, _ = trl_surface_differences()
            summary = trl_surface_summary("1.19.0")
        finally:
            _compat._assigned_attributes.cache_clear()
        assert differences == [
            "GRPOTrainer no longer sets the attribute '_buffered_inputs', which GRPOTrainerExt reads"
        ]
        assert summary == f"trl 1.19.0, untested (tested: trl>=1.14.0,<1.17.0): 1 of 54 differ: {differences[0]}"
        with pytest.raises(IncompatibleTRLError, match="'_buffered_inputs'"):
            _compat._assigned_attributes.cache_clear()
            try:
                check_trl_surface(None, "1.16.0")
            finally:
                _compat._assigned_attributes.cache_clear()

    def test_with_vllm_the_backend_s_methods_are_compared_and_a_backend_that_moved_is_named(self, monkeypatch):
        import sys

        differences, compared = trl_surface_differences(use_vllm=True)
        assert differences == [] and compared == 56
        monkeypatch.setitem(sys.modules, "trl.generation.vllm_generation", None)  # as if a release moved it
        differences, compared = trl_surface_differences(use_vllm=True)
        assert compared == 56 and len(differences) == 1
        assert differences[0].startswith("trl.generation.vllm_generation.VLLMGeneration does not import")

    def test_the_summary_names_a_matching_release_tested_or_not(self):
        assert trl_surface_summary("1.16.0") == (
            "trl 1.16.0, tested: the 54 hooks, methods and attributes GRPOTrainerExt relies on match"
        )
        assert trl_surface_summary("2.1.0").startswith("trl 2.1.0, untested (tested: trl>=1.14.0,<1.17.0): the 54")


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
