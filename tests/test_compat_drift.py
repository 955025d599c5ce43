"""Every piece of TRL code the package reproduces is recorded in `_compat.TRL_COPIES`, and behaves as TRL's own."""

import ast
import importlib
import inspect
import pathlib
import re

import pytest
import torch
import trl
from helpers import count_a_reward, tiny_grpo_args, train_logs, use_sampler_stand_in
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext._compat import (
    CALLED_METHODS,
    FORWARD_KEYS,
    OVERRIDDEN_HOOKS,
    TRL_ATTRIBUTES,
    TRL_COPIES,
    TRL_VLLM_ATTRIBUTES,
)

TESTS = pathlib.Path(__file__).parent


def _resolve(dotted: str):
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_recorded_copy_names_a_live_object_and_the_test_that_pins_it():
    assert len(TRL_COPIES) >= 5
    for where, origin, test in TRL_COPIES:
        assert _resolve(where) is not None, where
        assert origin.startswith("trl/") and ".py: " in origin, origin
        path, _, function = test.partition("::")
        source = (TESTS.parent / path.split(" ")[0]).read_text()
        if function:
            assert f"def {function}(" in source, test


@pytest.fixture(scope="module")
def stock_trainer(tiny_model_path, tiny_tokenizer, tmp_path_factory):
    """A stock `trl.GRPOTrainer` as built for a training run (nothing is trained)."""
    from datasets import Dataset

    args = GRPOConfig(**tiny_grpo_args(tmp_path_factory.mktemp("stock")))
    dataset = Dataset.from_dict({"prompt": ["abc="] * 8})
    return GRPOTrainer(tiny_model_path, count_a_reward, args, dataset, processing_class=tiny_tokenizer)


def test_the_trainer_overrides_exactly_the_pinned_hooks_of_trl():
    """Every method of `GRPOTrainerExt` that TRL (or transformers' Trainer) also has is a pinned hook, each defined in
    `GRPOTrainerExt` itself: no other class of the package sits between it and TRL."""
    assert GRPOTrainerExt.__bases__ == (GRPOTrainer,)
    overridden = {
        name
        for name, value in vars(GRPOTrainerExt).items()
        if callable(value) and hasattr(GRPOTrainer, name) and name != "__init__"
    }
    assert overridden == set(OVERRIDDEN_HOOKS)


@pytest.mark.parametrize("name", sorted({**OVERRIDDEN_HOOKS, **CALLED_METHODS}))
def test_every_hook_and_method_of_trl_the_package_uses_takes_the_arguments_it_is_given(name, stock_trainer):
    arguments = {**OVERRIDDEN_HOOKS, **CALLED_METHODS}[name]
    signature = inspect.signature(getattr(stock_trainer, name))  # bound: without `self`
    signature.bind(**dict.fromkeys(arguments))  # raises TypeError for a renamed or removed parameter


@pytest.mark.parametrize("name", sorted(OVERRIDDEN_HOOKS))
def test_every_override_accepts_every_parameter_of_trl_s_hook(name):
    """`OVERRIDDEN_HOOKS` lists every parameter of TRL's hook (`check_trl_surface` reports one TRL adds); the
    override takes each of them, so TRL's callers can pass any."""
    signature = inspect.signature(getattr(GRPOTrainerExt, name))
    signature.bind(None, **dict.fromkeys(OVERRIDDEN_HOOKS[name]))


@pytest.mark.parametrize("name", TRL_ATTRIBUTES)
def test_every_attribute_of_trl_the_package_reads_is_set_by_trl(name, stock_trainer):
    assert hasattr(stock_trainer, name), f"trl.GRPOTrainer {trl.__version__} has no attribute {name!r}"


def test_the_pinned_attributes_are_all_the_private_ones_the_package_reads():
    """A private attribute of the trainer that some module of the package reads is in `TRL_ATTRIBUTES`, unless the
    package sets it itself."""
    package = TESTS.parent / "trl_grpo_ext"
    sources = "\n".join(path.read_text() for path in package.rglob("*.py"))
    read = set(re.findall(r"\btrainer\._([a-z][a-z0-9_]*)\b", sources))
    read |= set(re.findall(r"\bself\._([a-z][a-z0-9_]*)\b", (package / "trainer.py").read_text()))
    ours = set(re.findall(r"\bself\._([a-z][a-z0-9_]*)\s*(?::[^=]*)?=", (package / "trainer.py").read_text()))
    methods = {name.lstrip("_") for name in vars(GRPOTrainerExt)} | {name.lstrip("_") for name in CALLED_METHODS}
    trl_private = {name for name in read - ours - methods if not callable(getattr(GRPOTrainer, f"_{name}", None))}
    assert {"logs", "metrics", "step", "buffered_inputs"} <= trl_private  # what the scan must find, at least
    assert {f"_{name}" for name in trl_private} <= set(TRL_ATTRIBUTES) | set(TRL_VLLM_ATTRIBUTES)


def test_the_forwarded_model_inputs_are_trl_s():
    """TRL's `_compute_loss` passes these extra inputs to `_get_per_token_logps_and_entropies`: the same list."""
    tree = ast.parse(inspect.getsource(GRPOTrainer._compute_loss).lstrip().replace("\n    ", "\n"))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_get_per_token_logps_and_entropies"
    ]
    assert len(calls) == 1
    keywords = {keyword.arg for keyword in calls[0].keywords} - {"compute_entropy", "compute_aux_loss"}
    assert keywords == set(FORWARD_KEYS)


@pytest.mark.slow
def test_the_entropy_bonus_is_trl_s(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """The copied controller moves the coefficient as TRL's does, step for step (GA 2, entropy below target)."""
    options = {"loss_type": "grpo", "beta": 0.04, "use_adaptive_entropy": True, "entropy_coef": 0.01}
    options["entropy_target"] = 5.0
    options |= {"config_cls": GRPOConfig, "num_iterations": 2, "gradient_accumulation_steps": 2}  # TRL's config
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    stock, _ = train_logs(tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **options)
    ours, _ = train_logs(tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **options)
    coefficients = [entry["entropy_coef"] for entry in stock if "entropy_coef" in entry]
    assert len(set(coefficients)) > 1  # the controller did move it
    assert coefficients == pytest.approx([entry["entropy_coef"] for entry in ours if "entropy_coef" in entry])


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_sampler_mismatch_bounds_are_trl_s(mode, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """The entries `sampler_mismatch` calls outside the bounds are exactly those TRL's correction changed."""
    from trl_grpo_ext.extras.vllm.mismatch import sampler_mismatch

    captured = []

    class Capturing(GRPOTrainerExt):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            captured.append(output)
            return output

    monkeypatch = pytest.MonkeyPatch()
    use_sampler_stand_in(monkeypatch)
    try:
        low, high = (0.97, 1.03) if mode.startswith("token") else (1.0, 1.07)
        args = GRPOConfigExt(
            **tiny_grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=16),
            use_vllm=True,
            vllm_mode="colocate",
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=low,
            vllm_importance_sampling_clip_max=high,
        )
        trainer = Capturing(tiny_model_path, count_a_reward, args, prompt_dataset, processing_class=tiny_tokenizer)
        trainer.train()
    finally:
        monkeypatch.undo()
    outside_counts, unit_counts = 0, 0
    for output in captured:
        mismatch = sampler_mismatch(output, mode, low, high)
        units, outside = mismatch.units, mismatch.outside
        corrected = output["importance_sampling_ratio"]  # TRL's, after truncation or masking
        assert mismatch.applied is corrected
        changed = (corrected - torch.exp(mismatch.log_ratio)).abs() > 1e-6
        assert torch.equal(outside & units, changed & units)
        outside_counts, unit_counts = outside_counts + int((outside & units).sum()), unit_counts + int(units.sum())
    assert 0 < outside_counts < unit_counts  # the bounds bound for some entries, not all
