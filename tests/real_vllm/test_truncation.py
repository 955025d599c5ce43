"""`match_sampler_truncation` and held-out evaluation on vLLM's real CPU engine.

The trainer's cut is vLLM's own (its sampler's processed log-probs, every cut, temperature, ties); on the engine, the
correction's ratio under `top_p` and `top_k` is the engine's mismatch alone (near 1), the trainer's truncated
log-probs are those of a plain forward cut by hand, and with a plain `trl.GRPOConfig` a truncated run is stock TRL's.
Held-out evaluation samples through the engine, leaves training unchanged, and is reproducible in colocate mode.
"""

import math

import pytest
import torch
from vllm_helpers import (
    DEMO_MODEL,
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
from trl_grpo_ext.extras.vllm.sampler_cuts import SamplerCuts, truncated_log_probs

KEPT_MASS = "sampling/truncation/kept_mass"


def vllm_processed_log_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """vLLM's processed log-probs `(B, V)` of `logits`, from vLLM's own sampler on the CPU (min_p through its own
    logits processor), as the engine computes them when it samples."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    rows = logits.shape[0]
    processors = []
    if min_p:
        processor = object.__new__(MinPLogitsProcessor)  # the state its update_state would leave for these rows
        processor.min_p_count, processor.min_p = rows, torch.full((rows, 1), float(min_p))
        processors.append(processor)
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), float(temperature)),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((rows,), float(top_p)) if top_p < 1 else None,
        top_k=torch.full((rows,), int(top_k), dtype=torch.int32) if top_k > 0 else None,
        # A generator per row keeps the sampler on its uncompiled path; the log-probs do not depend on it.
        generators={row: torch.Generator().manual_seed(row) for row in range(rows)},
        max_num_logprobs=-1,  # every token's
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
    )
    output = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), metadata)
    return output.logprobs_tensors.logprobs


SAMPLER_CASES = {
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "top_k,top_p": dict(top_k=6, top_p=0.7),
    "all,temperature": dict(top_k=8, top_p=0.9, min_p=0.02, temperature=0.6),
    "top_p,temperature": dict(top_p=0.5, temperature=1.7),
}


@pytest.mark.parametrize("name", SAMPLER_CASES)
def test_the_trainer_s_cut_is_that_of_vllm_s_sampler(name):
    """Every token vLLM's sampler keeps has the truncated log-prob vLLM reports; every token it drops is outside the
    trainer's cut. Logits with ties at the top-k threshold and among the likeliest tokens included."""
    settings = {"temperature": 1.0, **SAMPLER_CASES[name]}
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 64, generator=generator) * 2.0
    logits[:8, :5] = logits[:8, :5].amax(dim=1, keepdim=True)  # five-way ties at the top
    logits[8:16, 1:4] = logits[8:16, :1]  # ties with the most likely token, around the top-k threshold
    vllm = vllm_processed_log_probs(logits, **settings)
    cuts = SamplerCuts(
        top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0), min_p=settings.get("min_p", 0)
    )
    every_token = torch.arange(64).expand(48, 64)
    ours = truncated_log_probs((logits / settings["temperature"])[:, None].expand(48, 64, 64), every_token, cuts)
    kept = torch.isfinite(vllm)
    torch.testing.assert_close(ours.truncated[kept], vllm[kept], rtol=0, atol=2e-5)
    # vLLM drops a token the trainer keeps only where it breaks a tie at the top-p boundary (equal probabilities).
    q = torch.where(kept, vllm.exp(), 0.0)
    tie_broken = ~kept & ours.kept
    if tie_broken.any():
        probabilities = (logits / settings["temperature"]).softmax(-1)
        smallest = torch.where(kept, probabilities, math.inf).amin(dim=1, keepdim=True).expand_as(probabilities)
        torch.testing.assert_close(probabilities[tie_broken], smallest[tie_broken])
    assert (ours.kept == kept).float().mean() > 0.99 and (q.sum(dim=1) - 1).abs().max() < 1e-5
    assert (~kept).any()  # the cuts did act


# -- On the engine ----------------------------------------------------------------------------------------------------


def held_out_partial_credit(completions, solution, **kwargs) -> list[float]:
    """The share of letters in place (in [0, 1]): a held-out metric with spread."""
    return [
        sum(a == b for a, b in zip(c, s, strict=False)) / len(s) for c, s in zip(completions, solution, strict=True)
    ]


def train(trainer_class, args, dataset, tokenizer, **kwargs):
    trainer = recording(trainer_class)(
        model=DEMO_MODEL,
        reward_funcs=reversal_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.engine_calls = 0
    llm = trainer.vllm_generation.llm
    generate = llm.generate

    def counted(*args, **kwargs):
        trainer.engine_calls += 1
        return generate(*args, **kwargs)

    llm.generate = counted  # every call of this trainer, held-out passes included (`recording` sees training's)
    try:
        trainer.train()
    finally:
        llm.__dict__.pop("generate", None)  # the shared engine's own method again, for the next trainer
    return trainer


# Token-level weights with bounds that never act here, so that each token's weight is its raw truncated ratio.
TOKEN_LEVEL = dict(
    vllm_importance_sampling_mode="token_truncate",
    vllm_importance_sampling_clip_min=0.01,
    vllm_importance_sampling_clip_max=100.0,
)
RUNS = {
    "top_p": ("ext", dict(top_p=0.8, min_p=0.02, **TOKEN_LEVEL)),
    "top_k": ("ext", dict(generation_kwargs={"top_k": 3}, **TOKEN_LEVEL)),
    "top_k-heldout": ("ext", dict(generation_kwargs={"top_k": 3}, heldout_every_steps=1, **TOKEN_LEVEL)),
    "stock-top_k": ("stock", dict(top_k=3)),
    "plain-top_k": ("plain", dict(top_k=3)),
}


@pytest.fixture(scope="module")
def runs(shared_engine, reversal_dataset, demo_tokenizer, tmp_path_factory):
    from trl import GRPOConfig, GRPOTrainer

    trained = {}
    for name, (side, options) in RUNS.items():
        output_dir = tmp_path_factory.mktemp(name)
        extra = {}
        if side == "ext":
            args = GRPOConfigExt(**vllm_args(output_dir, beta=0.0, **options))
            if "heldout_every_steps" in options:
                extra = dict(
                    heldout_metrics=[held_out_partial_credit],
                    heldout_dataset=reversal_dataset.select(range(8)),
                )
        else:
            args = GRPOConfig(**vllm_args(output_dir, **options))
        trainer_class = GRPOTrainer if side == "stock" else GRPOTrainerExt
        trained[name] = train(trainer_class, args, reversal_dataset, demo_tokenizer, **extra)
    return trained


def cut_by_hand(logits: torch.Tensor, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The log-softmax of `logits` `(..., V)` after vLLM's cuts, masked explicitly (min_p, top_k, top_p by sort)."""
    z = logits.double()
    if min_p:
        p = z.softmax(-1)
        z = z.masked_fill(p < min_p * p.amax(-1, keepdim=True), -math.inf)
    if top_k:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], -math.inf)
    if top_p < 1:
        descending, order = z.sort(dim=-1, descending=True)
        q = descending.softmax(-1)
        dropped = (q.cumsum(-1) - q) >= top_p
        z = z.scatter(-1, order, descending.masked_fill(dropped, -math.inf))
    return z.log_softmax(-1)


@pytest.mark.parametrize("name", ["top_p", "top_k"])
def test_under_truncation_the_correction_s_ratio_is_the_engine_mismatch_alone(name, runs):
    """The weights are exp(trainer's truncated log-prob - vLLM's), token by token (bounds that never act): near 1,
    and each above the whole-vocabulary ratio by the kept mass (`own_logps`: the trainer's whole-vocabulary
    log-probs at generation time)."""
    trainer = runs[name]
    logs = training_logs(trainer.state.log_history)
    assert len(logs) == len(trainer.batches) == 3
    for entry, batch, outputs in zip(logs, trainer.batches, trainer.outputs, strict=True):
        mask = batch["completion_mask"].bool()
        vllm = torch.cat([torch.tensor(row) for row in vllm_rows(outputs)]).double()
        ratio = batch["importance_sampling_ratio"][mask]
        truncated = ratio.log().double() + vllm
        whole = batch["own_logps"][mask].double()
        assert (truncated >= whole - 1e-5).all() and (truncated - whole).mean() > 0.01  # log S <= 0, and it acted
        assert ratio.mean().item() == pytest.approx(1.0, abs=0.01)
        assert ((ratio < 0.9) | (ratio > 1.1)).float().mean() < 0.05
        assert entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
        assert entry["sampling/importance_sampling_ratio_raw/mean"] == pytest.approx(ratio.mean().item(), rel=1e-4)
        assert 0.3 < entry[KEPT_MASS] < 0.99  # stock TRL's ratio would carry this factor
        assert entry["sampling/truncation/outside_cut_fraction"] < 0.02


def test_the_trainer_s_truncated_log_probs_are_a_plain_forward_cut_by_hand(runs, reversal_dataset, demo_tokenizer):
    """At generation time (`recording` keeps the generation-time model's whole-vocabulary log-probs in `own_logps`):
    the correction's log-probs, recovered from its weights and vLLM's log-probs, are the hand-cut log-softmax of a
    plain transformers forward of the same weights, here recomputed for the first batch (weights of step 0)."""
    from transformers import AutoModelForCausalLM

    trainer = runs["top_p"]
    batch, outputs = trainer.batches[0], trainer.outputs[0]
    mask = batch["completion_mask"].bool()
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)  # the weights of step 0, which sampled the first batch
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, batch["prompt_ids"].shape[1] - 1 : -1]
    by_hand = cut_by_hand(logits, top_p=0.8, min_p=0.02).gather(-1, batch["completion_ids"][..., None])[..., 0]
    vllm = torch.cat([torch.tensor(row) for row in vllm_rows(outputs)]).double()
    recovered = batch["importance_sampling_ratio"][mask].log().double() + vllm
    finite = torch.isfinite(by_hand[mask])  # a sampled token outside the hand cut (boundary): counted as kept
    assert finite.float().mean() > 0.98
    torch.testing.assert_close(recovered[finite], by_hand[mask][finite], rtol=0, atol=1e-4)


def test_with_a_plain_trl_config_a_truncated_run_is_stock_trl_s(runs):
    stock, ours = runs["stock-top_k"], runs["plain-top_k"]
    assert ours._vllm_batches.match is None
    assert_same_batches(ours, stock)
    for theirs, mine in zip(stock.batches, ours.batches, strict=True):
        assert torch.equal(mine["importance_sampling_ratio"], theirs["importance_sampling_ratio"])
    assert_same_logs(ours, stock, ("loss", "grad_norm", "reward", "entropy") + TRL_SAMPLING)
    # Stock TRL's sequence-level ratio carries the kept mass of every token (top_k=3 of 14 tokens).
    assert all(
        entry["sampling/importance_sampling_ratio/mean"] < 0.9 for entry in training_logs(stock.state.log_history)
    )
    assert all(KEPT_MASS not in entry for entry in training_logs(ours.state.log_history))


def test_held_out_evaluation_samples_through_the_engine_and_leaves_training_unchanged(runs):
    plain, evaluated = runs["top_k"], runs["top_k-heldout"]
    heldout = [entry for entry in evaluated.state.log_history if "heldout/held_out_partial_credit/mean@1" in entry]
    assert [entry["step"] for entry in heldout] == [1, 2, 3]
    # 8 prompts x 1 completion in one chunk per pass, through the engine; training's calls as without the passes.
    assert len(evaluated.outputs) == len(plain.outputs) == 3
    assert evaluated.engine_calls == plain.engine_calls + 3
    assert all(0.0 < entry["heldout/held_out_partial_credit/mean@1"] < 1.0 for entry in heldout)
    assert_same_batches(evaluated, plain)
    assert_same_logs(evaluated, plain, ("loss", "grad_norm", "reward", "entropy", KEPT_MASS) + TRL_SAMPLING, rel=0)
    # Colocate: the engine samples with this process's generator, which the pass seeds per chunk: a pass at the same
    # weights gives the same completions, and the values.
    evaluated._last_loaded_step = -1  # the shared engine holds the weights of the runs trained after this one
    again = [evaluated.evaluate_heldout(log=False) for _ in range(2)]
    assert again[0] == again[1]
