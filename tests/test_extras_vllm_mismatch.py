"""The sampler/trainer mismatch with vLLM (a stand-in sampler): logged with the correction on and off, its k3 KL and
effective sample size against their closed forms, training unchanged, and the warning about truncated sampling."""

import math

import pytest
import torch
from helpers import assert_same_logs, count_a_reward, tiny_grpo_args, train_logs, use_sampler_stand_in
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.diagnostics import DiagnosticsAccumulator
from trl_grpo_ext.extras.vllm.mismatch import SamplerMismatch, sampler_mismatch
from trl_grpo_ext.extras.vllm.truncation_match import truncation_warning
from trl_grpo_ext.ops.numerics import kl_estimator

RAW = "sampling/importance_sampling_ratio_raw"
VLLM = {"loss_type": "grpo", "beta": 0.04, "use_vllm": True, "vllm_mode": "colocate"}
# Generation aligned with the optimizer steps: without the correction TRL computes no trainer log-probs, so the
# extra forward pass does (with num_iterations=2 and gradient accumulation 2, TRL computes them itself).
ALIGNED = {"num_iterations": 1, "gradient_accumulation_steps": 1}
# Against stock TRL: both trainers take TRL's own config, generations reused unless ALIGNED.
TRL_RUN = {"config_cls": GRPOConfig, "num_iterations": 2, "gradient_accumulation_steps": 2}


@pytest.fixture
def stand_in(monkeypatch):
    use_sampler_stand_in(monkeypatch)


def expected_offsets(output) -> torch.Tensor:
    """`trainer_logp - sampler_logp` as the stand-in makes it, `(N, T)`: minus its offset `0.05 sin(t + prompt
    length)` at completion token t (both score with the same weights)."""
    prompt_lengths = output["prompt_mask"].sum(dim=1, keepdim=True)
    positions = torch.arange(output["completion_mask"].shape[1])[None, :]
    return -0.05 * torch.sin((positions + prompt_lengths).float())


def ess(weights: torch.Tensor) -> float:
    weights = weights.double()
    return (weights.sum() ** 2 / (weights.numel() * weights.pow(2).sum())).item()


class Capturing(GRPOTrainerExt):
    """Keeps every batch `_generate_and_score_completions` returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.captured.append(output)
        return output


def mismatch_entries(trainer) -> list[dict]:
    """The entries of the log history that carry the mismatch (those of the steps that generated)."""
    return [entry for entry in trainer.state.log_history if f"{RAW}/p50" in entry]


@pytest.mark.parametrize("aligned", [True, False], ids=["extra-forward", "trl-logps"])
def test_without_the_correction_the_mismatch_is_logged_and_training_is_that_of_stock_trl(
    aligned, stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    options = {**TRL_RUN, **VLLM, "vllm_importance_sampling_correction": False, **(ALIGNED if aligned else {})}
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    stock, _ = train_logs(tmp_path / "s", *tiny_run, trainer_cls=GRPOTrainer, **options)
    ours, _ = train_logs(tmp_path / "o", *tiny_run, trainer_cls=GRPOTrainerExt, **options)
    assert assert_same_logs(stock, ours) >= 40  # the extra forward pass changes nothing in training
    assert not any("sampling/sampling_logp_difference/mean" in entry for entry in stock)  # TRL logs nothing here
    generated = [entry for entry in ours if f"{RAW}/p50" in entry]
    assert len(generated) == (4 if aligned else 2)  # the steps that generated
    for entry in generated:
        assert entry[f"{RAW}/min"] <= entry[f"{RAW}/p05"] <= entry[f"{RAW}/p50"] <= entry[f"{RAW}/p95"]
        assert entry[f"{RAW}/p95"] <= entry[f"{RAW}/max"] and 0.0 < entry[f"{RAW}/ess"] <= 1.0
        assert entry["sampling/sampler_k3_kl"] > 0.0
        assert "sampling/importance_sampling_ratio/ess" not in entry  # no correction weights


def test_k3_kl_and_effective_sample_size_are_those_of_the_sampler_offsets(
    stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """With the correction off the trainer's log-probs come from the extra forward pass; against the stand-in's known
    offsets, the logged KL and ESS are their closed forms (token mode, sequence mode for the ESS)."""
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    for mode in ("token_truncate", "sequence_mask"):
        options = {
            **ALIGNED,
            **VLLM,
            "vllm_importance_sampling_correction": False,
            "vllm_importance_sampling_mode": mode,
        }
        _, trainer = train_logs(tmp_path / mode, *tiny_run, trainer_cls=Capturing, **options)
        generated = mismatch_entries(trainer)
        assert len(trainer.captured) == len(generated) == 4
        for output, entry in zip(trainer.captured, generated, strict=True):
            assert "old_per_token_logps" not in output  # the trainer's log-probs came from the extra forward pass
            mask = output["completion_mask"].bool()
            offsets = torch.where(mask, expected_offsets(output), 0.0)
            k3 = kl_estimator(offsets.double())[mask].mean().item()
            assert entry["sampling/sampler_k3_kl"] == pytest.approx(k3, rel=1e-4)
            weights = offsets.sum(dim=1).exp() if mode.startswith("sequence") else offsets[mask].exp()
            assert entry[f"{RAW}/ess"] == pytest.approx(ess(weights), rel=1e-5)
            assert entry[f"{RAW}/mean"] == pytest.approx(weights.double().mean().item(), rel=1e-5)


def test_with_the_correction_the_applied_weights_effective_sample_size_is_logged(
    stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    options = {
        **ALIGNED,
        **VLLM,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_min": 0.97,
        "vllm_importance_sampling_clip_max": 1.03,
    }
    _, trainer = train_logs(tmp_path, *tiny_run, trainer_cls=Capturing, **options)
    generated = mismatch_entries(trainer)
    assert len(trainer.captured) == len(generated) == 4
    for output, entry in zip(trainer.captured, generated, strict=True):
        mask = output["completion_mask"].bool()
        applied = output["importance_sampling_ratio"][mask]  # TRL's truncated weights
        raw = (output["old_per_token_logps"] - output["sampling_per_token_logps"])[mask].exp()
        assert not torch.allclose(applied, raw)  # the bounds bind
        assert entry["sampling/importance_sampling_ratio/ess"] == pytest.approx(ess(applied), rel=1e-6)
        assert entry[f"{RAW}/ess"] == pytest.approx(ess(raw), rel=1e-5)
        k3 = kl_estimator((output["old_per_token_logps"] - output["sampling_per_token_logps"]).double())[mask]
        assert entry["sampling/sampler_k3_kl"] == pytest.approx(k3.mean().item(), rel=1e-6)


def test_the_first_generation_shows_the_same_mismatch_with_and_without_the_correction(
    stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """The first batch is sampled alike in both runs: the extra forward pass gives TRL's own trainer log-probs."""
    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    first = {}
    for correction in (True, False):
        options = {**ALIGNED, **VLLM, "vllm_importance_sampling_correction": correction, "max_steps": 1}
        _, trainer = train_logs(tmp_path / str(correction), *tiny_run, trainer_cls=Capturing, **options)
        first[correction] = mismatch_entries(trainer)[0]
    for name in ("min", "max", "p05", "p50", "p95", "mean", "ess", "outside_fraction"):
        assert first[False][f"{RAW}/{name}"] == pytest.approx(first[True][f"{RAW}/{name}"], rel=1e-6), name
    assert first[False]["sampling/sampler_k3_kl"] == pytest.approx(first[True]["sampling/sampler_k3_kl"], rel=1e-5)


def test_switching_the_mismatch_metrics_off_skips_the_extra_forward_pass(
    stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    from trl_grpo_ext.extras.vllm import mismatch

    tiny_run = (tiny_model_path, tiny_tokenizer, prompt_dataset)
    calls = []
    original = mismatch.trainer_logps
    monkeypatch.setattr(mismatch, "trainer_logps", lambda *args: calls.append(1) or original(*args))
    options = {**ALIGNED, **VLLM, "vllm_importance_sampling_correction": False, "max_steps": 2}
    _, trainer = train_logs(tmp_path / "off", *tiny_run, trainer_cls=Capturing, log_sampler_mismatch=False, **options)
    assert mismatch_entries(trainer) == [] and calls == []
    _, trainer = train_logs(tmp_path / "on", *tiny_run, trainer_cls=Capturing, **options)
    assert len(mismatch_entries(trainer)) == len(calls) == 2  # one pass per generation


def mismatch_batch(seed: int, sequence: bool = False, corrected: bool = True) -> SamplerMismatch:
    generator = torch.Generator().manual_seed(seed)
    trainer = torch.randn(6, 10, generator=generator) * 0.3 - 2.0
    sampler = trainer + torch.randn(6, 10, generator=generator) * 0.1
    sampler[0, 3] = math.nan  # a token the sampler could not score
    mask = torch.rand(6, 10, generator=generator) < 0.8
    output = {"completion_mask": mask.long(), "sampling_per_token_logps": sampler, "old_per_token_logps": trainer}
    mode = "sequence_truncate" if sequence else "token_truncate"
    if corrected:
        log_ratio = torch.nan_to_num((trainer - sampler) * mask, nan=0.0)
        log_ratio = log_ratio.sum(dim=1, keepdim=True) if sequence else log_ratio
        output["importance_sampling_ratio"] = log_ratio.exp().clamp(0.9, 1.1)
    return sampler_mismatch(output, mode, 0.9, 1.1)


def packed(accumulator: DiagnosticsAccumulator) -> torch.Tensor:
    """The accumulator's vector at a log step (one micro-batch of the loss, whose sums are not looked at here)."""
    zero = torch.zeros((), dtype=torch.float64)
    accumulator._steps.append(accumulator.step_layout.pack(dict.fromkeys(accumulator.step_layout.names, zero)))
    return accumulator.pack()


@pytest.mark.parametrize("sequence", [False, True], ids=["token", "sequence"])
def test_two_processes_report_the_mismatch_of_their_pooled_batches(sequence):
    batches = [mismatch_batch(seed, sequence) for seed in range(4)]
    accumulators = [DiagnosticsAccumulator(sampler_mismatch=True) for _ in range(2)]
    for index, batch in enumerate(batches):  # process 0 gets batches 0, 2; process 1 gets 1, 3
        accumulators[index % 2].add_sampler_mismatch(batch)
    gathered = torch.stack([packed(accumulator) for accumulator in accumulators])
    scalars = accumulators[0].summarize(gathered).scalars

    raw = torch.cat([batch.log_ratio[batch.units] for batch in batches]).double().exp()
    applied = torch.cat([batch.applied[batch.units] for batch in batches])
    k3 = torch.cat([kl_estimator(batch.token_log_ratio.double())[batch.scored] for batch in batches])
    outside = sum(int((batch.outside & batch.units).sum()) for batch in batches)
    assert scalars[f"{RAW}/ess"] == pytest.approx(ess(raw), rel=1e-9)
    assert scalars[f"{RAW}/mean"] == pytest.approx(raw.mean().item(), rel=1e-9)
    assert scalars["sampling/importance_sampling_ratio/ess"] == pytest.approx(ess(applied), rel=1e-9)
    assert scalars["sampling/sampler_k3_kl"] == pytest.approx(k3.mean().item(), rel=1e-9)
    assert scalars[f"{RAW}/outside_fraction"] == pytest.approx(outside / raw.numel())
    assert all(not batch.scored[0, 3] for batch in batches)  # the unscored token is left out of the KL


def test_without_the_correction_no_applied_weights_are_reported():
    accumulator = DiagnosticsAccumulator(sampler_mismatch=True)
    accumulator.add_sampler_mismatch(mismatch_batch(0, corrected=False))
    scalars = accumulator.summarize(packed(accumulator)[None]).scalars
    assert f"{RAW}/ess" in scalars and "sampling/importance_sampling_ratio/ess" not in scalars


def vllm_config(**overrides):
    return GRPOConfig(
        **tiny_grpo_args("unused"),
        use_vllm=True,
        vllm_importance_sampling_correction=overrides.pop("correction", True),
        **overrides,
    )


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"top_k": 50}, "top_k=50"),
        ({"min_p": 0.05}, "min_p=0.05"),
        ({"generation_kwargs": {"top_p": 0.95}}, "top_p=0.95"),  # generation_kwargs override the fields, as in TRL
    ],
)
def test_truncated_sampling_with_the_correction_is_warned_about(overrides, named):
    warning = truncation_warning(vllm_config(**overrides))
    assert warning is not None and named in warning and "#6789" in warning and "top_p=1.0" in warning


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # TRL's defaults do not truncate
        {"top_k": -1},  # vLLM's "no top-k"
        {"top_p": 0.9, "correction": False},  # no correction to bias
        {"top_p": 0.9, "generation_kwargs": {"top_p": 1.0}},  # overridden back to no truncation
    ],
)
def test_untruncated_sampling_or_no_correction_is_not_warned_about(overrides):
    assert truncation_warning(vllm_config(**overrides)) is None


def test_the_trainer_warns_about_truncated_sampling_at_construction(
    stand_in, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    args = GRPOConfigExt(
        **tiny_grpo_args(tmp_path),
        **VLLM,
        vllm_importance_sampling_correction=True,
        top_k=5,
        match_sampler_truncation=False,
    )
    with pytest.warns(UserWarning, match=r"truncated distribution \(top_k=5\)"):
        GRPOTrainerExt(tiny_model_path, count_a_reward, args, prompt_dataset, processing_class=tiny_tokenizer)
