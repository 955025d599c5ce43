"""`match_sampler_truncation` with stand-ins for vLLM: the correction sees only the engine's mismatch under top_k,
top_p and min_p; the surrogate's old log-probs stay TRL's; off (or with a plain `trl.GRPOConfig`) and without a cut
the run is stock TRL's; and the TRL code it reproduces (the correction's weights and metrics, the fused head's logit
transform) behaves as TRL's."""

import math

import pytest
import torch
from helpers import (
    CORRECTION_MODES,
    SamplerStandIn,
    assert_same_logs,
    make_trainer,
    tiny_grpo_args,
    training_entries,
    use_sampler_stand_in,
)
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.config import TRL_BEHAVIOUR, option
from trl_grpo_ext.extras.vllm.correction import TRL_CORRECTION_METRICS, correction_metrics, correction_ratio
from trl_grpo_ext.extras.vllm.mismatch import sampler_mismatch
from trl_grpo_ext.extras.vllm.sampler_cuts import SamplerCuts, truncated_log_probs
from trl_grpo_ext.extras.vllm.truncation_match import TruncationMatch, trainer_truncated_logps, truncation_warning

VLLM = {"use_vllm": True, "vllm_mode": "colocate", "vllm_importance_sampling_correction": True}
KEPT_MASS = "sampling/truncation/kept_mass"


def offset(position: int, prompt_length: int) -> float:
    """The stand-in engine's deterministic log-prob error at completion token `position` (as `SamplerStandIn`'s)."""
    return 0.05 * math.sin(position + prompt_length)


def cut_log_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM's processed log-probs, written as its sampler computes them: temperature, min_p, top_k, then top_p on the
    ascending sort (a token is dropped where the cumulative mass up to it is <= 1 - top_p)."""
    z = logits.float() / temperature
    if min_p:
        p = z.softmax(-1)
        z = z.masked_fill(p < min_p * p.amax(-1, keepdim=True), -math.inf)
    if top_k > 0:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], -math.inf)
    if top_p < 1.0:
        ascending, order = z.sort(dim=-1)
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        dropped[..., -1] = False
        z = z.scatter(-1, order, ascending.masked_fill(dropped, -math.inf))
    return z.log_softmax(-1)


class TruncatingStandIn(SamplerStandIn):
    """A stand-in engine that samples, token by token, from the truncated distribution of the trainer's own model
    (its cuts and temperature as TRL hands them to vLLM, `generation_kwargs` last) and reports vLLM's processed
    log-probs plus the deterministic `offset`: the only engine mismatch."""

    def __init__(self, *, temperature, top_k, top_p, min_p, generation_kwargs=None, **kwargs):
        super().__init__(**kwargs)
        settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p or 0.0}
        settings.update({k: v for k, v in (generation_kwargs or {}).items() if k in settings})
        self.settings = settings

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        eos = self.tokenizer.eos_token_id
        completions, logprobs = [], []
        for prompt in prompts:
            sequence, reported = list(prompt), []
            while len(sequence) - len(prompt) < self.max_new_tokens:
                logits = self.model(torch.tensor([sequence])).logits[0, -1]
                scores = cut_log_probs(logits, **self.settings)
                token = int(torch.multinomial(scores.exp(), 1))
                reported.append([scores[token].item() + offset(len(reported), len(prompt))])
                sequence.append(token)
                if token == eos:
                    break
            completions.append(sequence[len(prompt) :])
            logprobs.append(reported)
        return prompts, completions, logprobs, None


@pytest.fixture
def truncating_engine(monkeypatch):
    import trl.trainer.grpo_trainer

    monkeypatch.setattr(trl.trainer.grpo_trainer, "VLLMGeneration", TruncatingStandIn)


@pytest.fixture
def plain_engine(monkeypatch):
    use_sampler_stand_in(monkeypatch)


def capturing(trainer_class):
    class Capturing(trainer_class):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            mode = "train" if self.model.training else "eval"
            logged = {
                name: self._metrics[mode][name][-1] for name in TRL_CORRECTION_METRICS if self._metrics[mode][name]
            }
            batch = {k: v.clone() for k, v in output.items() if torch.is_tensor(v)}
            batch["whole_vocabulary_logps"] = whole_vocabulary_logps(self.model, batch, self.temperature)
            self.captured.append((batch, logged))
            return output

    return Capturing


def run(trainer_class, args, model_path, tokenizer, dataset):
    trainer = make_trainer(
        args.output_dir, model_path, tokenizer, dataset, trainer_cls=capturing(trainer_class), args=args
    )
    trainer.captured = []
    trainer.train()
    return trainer, training_entries(trainer)


def expected_offsets(output) -> torch.Tensor:
    prompt_lengths = output["prompt_mask"].sum(dim=1).tolist()
    width = output["completion_mask"].shape[1]
    return torch.tensor([[offset(t, length) for t in range(width)] for length in prompt_lengths])


def whole_vocabulary_logps(model, output, temperature) -> torch.Tensor:
    """The trainer's whole-vocabulary log-probs of the batch, from a plain forward of its model."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, output["prompt_ids"].shape[1] - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(-1, output["completion_ids"][..., None])[..., 0]


def test_a_plain_trl_config_keeps_stock_trl_s_behaviour():
    plain = GRPOConfig(**tiny_grpo_args("unused"))
    assert option(plain, "match_sampler_truncation") is False
    assert option(GRPOConfigExt(**tiny_grpo_args("unused")), "match_sampler_truncation") is True
    assert option(plain, "log_sampler_mismatch") is True  # every other field: GRPOConfigExt's default
    assert set(TRL_BEHAVIOUR) <= set(GRPOConfigExt.__dataclass_fields__)


@pytest.mark.parametrize(
    "config, warned",
    [
        (GRPOConfigExt, False),  # matched: nothing to warn about
        (lambda **kw: GRPOConfigExt(**kw, match_sampler_truncation=False), True),
        (GRPOConfig, True),  # stock TRL's behaviour
    ],
    ids=["ext", "ext-off", "plain"],
)
def test_the_truncation_warning_is_given_only_where_the_option_is_off(config, warned):
    args = config(**tiny_grpo_args("unused"), **VLLM, top_p=0.9)
    assert (truncation_warning(args) is not None) is warned
    if warned:
        assert "match_sampler_truncation=True" in truncation_warning(args)


# Each cut with one importance-sampling mode (every cut and every mode, at four runs).
CUT_SETTINGS = {
    "top_k": ("token_truncate", {"top_k": 3}),
    "top_p-temperature": ("sequence_mask", {"top_p": 0.8, "temperature": 0.7}),
    "min_p-generation_kwargs": ("token_mask", {"generation_kwargs": {"min_p": 0.7}}),
    "all": ("sequence_truncate", {"top_k": 5, "top_p": 0.9, "min_p": 0.1}),
}
FAST = {"top_k", "top_p-temperature"}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in CUT_SETTINGS]
)
def test_with_matched_truncation_the_correction_sees_only_the_engine_mismatch(
    name, truncating_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    mode, settings = CUT_SETTINGS[name]
    args = GRPOConfigExt(
        **tiny_grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
        **VLLM,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=3.0,
        **settings,
    )
    trainer, logs = run(GRPOTrainerExt, args, tiny_model_path, tiny_tokenizer, prompt_dataset)
    assert len(trainer.captured) == len(logs) == 2
    sequence_level = mode.startswith("sequence")
    for (output, logged), entry in zip(trainer.captured, logs, strict=True):
        mask = output["completion_mask"].bool()
        engine_error = torch.where(mask, expected_offsets(output), 0.0)
        # The correction's log ratio is the engine's error alone: exp(-offset) per token, its product per sequence.
        expected = -engine_error.sum(dim=1, keepdim=True) if sequence_level else -engine_error[mask]
        log_ratio = output["importance_sampling_ratio"].log()
        torch.testing.assert_close(log_ratio if sequence_level else log_ratio[mask], expected, rtol=0, atol=2e-5)
        # The surrogate's old log-probs are the whole vocabulary's, as in TRL.
        whole = output["whole_vocabulary_logps"]
        torch.testing.assert_close(output["old_per_token_logps"][mask], whole[mask], rtol=0, atol=2e-5)
        weights = output["importance_sampling_ratio"].flatten() if sequence_level else log_ratio[mask].exp()
        assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(weights.mean().item(), abs=1e-6)
        assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(
            engine_error.abs().max().item(), abs=2e-5
        )
        # The mismatch metrics see the same truncated log-probs.
        raw = "sampling/importance_sampling_ratio_raw/mean"
        assert entry[raw] == pytest.approx(expected.exp().mean().item(), rel=1e-4)
        assert 0.0 < entry[KEPT_MASS] < 0.99  # the cut left that much of the trainer's mass: stock TRL's ratio factor
        assert entry["sampling/truncation/outside_cut_fraction"] == 0.0  # same weights, same precision


@pytest.mark.parametrize("config", ["plain", "ext-off"])
def test_with_the_option_off_a_truncated_run_is_stock_trl_s(
    config, truncating_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    common = {**tiny_grpo_args(tmp_path / "s", num_iterations=2, gradient_accumulation_steps=2), **VLLM, "top_k": 3}
    _, stock = run(GRPOTrainer, GRPOConfig(**common), tiny_model_path, tiny_tokenizer, prompt_dataset)
    if config == "plain":
        args = GRPOConfig(**{**common, "output_dir": str(tmp_path / "o")})
    else:  # TRL's objective defaults, written out
        args = GRPOConfigExt(
            **{**common, "output_dir": str(tmp_path / "o")},
            loss_type="dapo",
            beta=0.0,
            use_bias_correction_kl=True,
            match_sampler_truncation=False,
        )
    trainer, ours = run(GRPOTrainerExt, args, tiny_model_path, tiny_tokenizer, prompt_dataset)
    assert trainer._vllm_batches.match is None
    assert assert_same_logs(stock, ours) >= 40
    assert all(KEPT_MASS not in entry for entry in ours)
    assert all(entry["sampling/importance_sampling_ratio/mean"] < 0.9 for entry in stock if "reward" in entry)


def test_without_a_cut_the_option_changes_nothing(
    plain_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    common = tiny_grpo_args(tmp_path, num_iterations=2, gradient_accumulation_steps=2)
    on = GRPOConfigExt(**common, **VLLM)
    off = GRPOConfigExt(**{**common, "output_dir": str(tmp_path / "off")}, **VLLM, match_sampler_truncation=False)
    trainer, matched = run(GRPOTrainerExt, on, tiny_model_path, tiny_tokenizer, prompt_dataset)
    _, unmatched = run(GRPOTrainerExt, off, tiny_model_path, tiny_tokenizer, prompt_dataset)
    assert trainer._vllm_batches.match is None
    assert assert_same_logs(unmatched, matched) >= 40
    assert all(KEPT_MASS not in entry for entry in matched)


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_the_correction_weights_and_their_metrics_are_trl_s(
    mode, plain_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    """Recomputed from TRL's own old log-probs, `correction_ratio` gives TRL's `importance_sampling_ratio` bit for bit
    and `correction_metrics` the values TRL logged, in every mode, with bounds that act."""
    low, high = (0.97, 1.03) if mode.startswith("token") else (1.0, 1.07)
    args = GRPOConfig(
        **tiny_grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=16),
        **VLLM,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    trainer, _ = run(GRPOTrainerExt, args, tiny_model_path, tiny_tokenizer, prompt_dataset)
    acted = False
    for output, logged in trainer.captured:
        ratio = correction_ratio(sampler_mismatch(output, mode, low, high).log_ratio, mode, low, high)
        assert torch.equal(ratio, output["importance_sampling_ratio"])
        acted |= bool(((ratio == low) | (ratio == high) | (ratio == 0)).any())
        sequence_level = mode.startswith("sequence")
        values = correction_metrics(trainer.accelerator, output["old_per_token_logps"], output, ratio, sequence_level)
        assert values == logged
    assert acted


def test_the_trainer_pass_gives_trl_s_log_probs_with_scaled_and_capped_logits(
    plain_engine, tiny_tokenizer, prompt_dataset, tmp_path
):
    """A model whose configuration scales and soft-caps its logits (TRL's fused head reads `logit_scale` and
    `final_logit_softcapping`): the pass's own projection gives TRL's log-probs, and its kept mass is that of the
    transformed, tempered logits."""
    from trl_grpo_ext.testing import save_tiny

    path = save_tiny(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.config.logit_scale, model.config.final_logit_softcapping = 0.6, 2.0
    model.save_pretrained(path)
    args = GRPOConfig(**tiny_grpo_args(tmp_path / "out"), **VLLM, temperature=0.7, top_k=4)
    trainer = make_trainer(args.output_dir, path, tiny_tokenizer, prompt_dataset, args=args)
    generator = torch.Generator().manual_seed(0)
    output = {
        "prompt_ids": torch.randint(3, 20, (6, 5), generator=generator),
        "prompt_mask": torch.ones(6, 5, dtype=torch.long),
        "completion_ids": torch.randint(3, 20, (6, 7), generator=generator),
        "completion_mask": torch.ones(6, 7, dtype=torch.long),
    }
    output["prompt_mask"][:2, :2] = 0  # left padding
    cuts = SamplerCuts(top_k=4)
    logps, truncated = trainer_truncated_logps(trainer, output, cuts)
    torch.testing.assert_close(truncated.logps, logps, rtol=0, atol=1e-5)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 4:-1]
        plain = hidden @ model.get_output_embeddings().weight.T
    transformed = 2.0 * torch.tanh(plain * 0.6 / 2.0) / 0.7
    expected = truncated_log_probs(transformed, output["completion_ids"], cuts)
    torch.testing.assert_close(truncated.log_kept_mass, expected.log_kept_mass, rtol=0, atol=1e-5)
    untransformed = (plain / 0.7).log_softmax(-1).gather(-1, output["completion_ids"][..., None])[..., 0]
    assert (untransformed - logps).abs().max() > 0.05  # TRL's head did apply the transform


def test_the_match_acts_only_with_vllm_a_cut_and_the_option(
    plain_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    def built(**overrides):
        args = GRPOConfigExt(**tiny_grpo_args(tmp_path), **overrides)
        return make_trainer(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, args=args)

    assert built(top_k=3)._vllm_batches is None  # transformers' generate: no engine log-probs
    assert built(**VLLM, top_k=-1)._vllm_batches.match is None  # vLLM's "no top-k"
    match = built(**VLLM, generation_kwargs={"top_p": 0.95})._vllm_batches.match
    assert isinstance(match, TruncationMatch) and match.cuts == SamplerCuts(top_p=0.95)


def test_the_trainer_pass_projects_only_the_scored_tokens(
    plain_engine, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    """Completion padding and tool output are never projected through the head: over micro-batches of 4 and 2 rows,
    the projected positions are the scored tokens, their kept mass that of the whole padded batch's logits; the
    other positions keep TRL's log-probs with a log kept mass of 0."""
    import trl_grpo_ext.extras.vllm.truncation_match as module

    args = GRPOConfig(**tiny_grpo_args(tmp_path / "out", per_device_eval_batch_size=4), **VLLM, top_p=0.6)
    trainer = make_trainer(args.output_dir, tiny_model_path, tiny_tokenizer, prompt_dataset, args=args)
    generator = torch.Generator().manual_seed(1)
    completion_mask = torch.ones(6, 7, dtype=torch.long)
    for row, length in enumerate([7, 3, 5, 0, 1, 6]):
        completion_mask[row, length:] = 0
    tool_mask = torch.ones(6, 7, dtype=torch.long)
    tool_mask[0, 2:4] = 0  # tool output inside the first completion
    output = {
        "prompt_ids": torch.randint(3, 20, (6, 5), generator=generator),
        "prompt_mask": torch.ones(6, 5, dtype=torch.long),
        "completion_ids": torch.randint(3, 20, (6, 7), generator=generator),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
    }
    projected = []
    original = module.truncated_log_probs_from_hidden

    def counted(hidden, *args, **kwargs):
        projected.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(module, "truncated_log_probs_from_hidden", counted)
    cuts = SamplerCuts(top_p=0.6)
    logps, truncated = trainer_truncated_logps(trainer, output, cuts)
    scored = completion_mask.bool() & tool_mask.bool()
    assert projected == [int(scored[:4].sum()), int(scored[4:].sum())] and sum(projected) == 20
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[:, 4:-1]
    expected = truncated_log_probs(logits, output["completion_ids"], cuts)
    torch.testing.assert_close(truncated.log_kept_mass[scored], expected.log_kept_mass[scored], rtol=0, atol=1e-5)
    assert torch.equal(truncated.kept[scored], expected.kept[scored])
    assert (truncated.log_kept_mass[scored] < 0).any()
    assert (truncated.log_kept_mass[~scored] == 0).all() and truncated.kept[~scored].all()
    assert torch.equal(truncated.logps[~scored], logps[~scored])
    torch.testing.assert_close(truncated.logps, logps, rtol=0, atol=1e-5)
