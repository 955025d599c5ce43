"""The packed forward where users train (`trl_grpo_ext.forward.attention`): flash-attention's varlen path (emulated on
the CPU by `benchmarks.emulation`: transformers' own flash code with exact stand-ins for the kernels), flex
attention, bf16 autocast over float32 weights, a rotary embedding that depends on the forward's length, the router
loss, and the host synchronisations of the packed layout."""

import logging

import pytest
import torch
from helpers import half_constant_reward, make_trainer, tiny_lora

from benchmarks.emulation import flash_attention_emulation, use_flash_attention
from trl_grpo_ext.forward import logprobs, pack_rows, row_spans
from trl_grpo_ext.forward.attention import attention_kind, length_dependent_rope

P, C = 7, 9
PROMPT_LENGTHS = [7, 3, 5, 7, 2, 4, 6, 5]
COMPLETION_LENGTHS = [9, 1, 4, 0, 9, 6, 3, 8]
#: rows that repeat an earlier row's prompt (`padded_rows(shared=True)`), and that row
SHARED_LEADERS = {3: 0, 5: 0, 4: 1, 7: 6}


def padded_rows(seed: int = 0, shared: bool = True, vocab: int = 20):
    """Rows as TRL builds them: prompts left-padded to P, completions right-padded to C (one has no completion)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(PROMPT_LENGTHS), P + C), generator=generator)
    lengths = list(PROMPT_LENGTHS)
    if shared:
        for row, leader in SHARED_LEADERS.items():
            ids[row, :P], lengths[row] = ids[leader, :P], lengths[leader]
    mask = torch.ones_like(ids)
    for i, (prompt, completion) in enumerate(zip(lengths, COMPLETION_LENGTHS, strict=True)):
        mask[i, : P - prompt] = 0
        mask[i, P + completion :] = 0
    return ids * mask, mask


@pytest.fixture
def trainer(tmp_path, tiny_model_path, prompt_dataset):
    return make_trainer(tmp_path, tiny_model_path, None, prompt_dataset)


@pytest.fixture
def flash():
    with flash_attention_emulation():
        yield


def _layouts(monkeypatch) -> list:
    """Records every layout the packed forward builds."""
    built = []

    def recording(*args, **kwargs):
        built.append(pack_rows(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(logprobs, "pack_rows", recording)
    return built


def _segments_per_row(layout) -> list[int]:
    """The parts of each packed row that attend apart (a sequence, a shared prompt, a completion after it)."""
    counts = []
    for ids, units, branches in zip(layout.input_ids, layout.units, layout.branches, strict=True):
        real = ids != 0
        counts.append(len(set(zip(units[real].tolist(), branches[real].tolist(), strict=True))))
    return counts


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "packed"])
@pytest.mark.parametrize("row_tokens", [None, 12], ids=["one-row", "several-rows"])
def test_flash_attention_packs_any_number_of_rows_exactly(trainer, flash, monkeypatch, shared, row_tokens):
    """transformers recognises packed sequences from position_ids only for a batch of one row: the boundaries are
    given explicitly, so that two packed rows or more are exact, with shared prompts forwarded once."""
    use_flash_attention(trainer.model)
    assert attention_kind(trainer.model.config) == "varlen"
    pf = trainer._packed_forward
    pf.shared_prompts, pf.row_tokens = shared, row_tokens
    layouts = _layouts(monkeypatch)
    ids, mask = padded_rows(1)
    padded, padded_entropy, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C, compute_entropy=True)
    packed = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_entropy=True)
    check = pf.self_check
    assert check.passed and check.shared_passed is (True if shared else None)
    layout = layouts[-1]
    if row_tokens is not None:
        assert layout.input_ids.size(0) >= 2 and max(_segments_per_row(layout)) >= 2
    if shared and row_tokens is None:  # each prompt once (its last token once per completion), then the completions
        prompts = sum(PROMPT_LENGTHS[i] - 1 for i in set(SHARED_LEADERS.values()) | {1, 2})
        assert int((layout.input_ids != 0).sum()) == prompts + sum(1 + c for c in COMPLETION_LENGTHS)
    completion = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][completion], padded[completion], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1][completion], padded_entropy[completion], rtol=0, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "packed"])
def test_the_gradient_under_flash_attention_is_the_padded_one(trainer, flash, shared):
    use_flash_attention(trainer.model)
    trainer._packed_forward.shared_prompts, trainer._packed_forward.row_tokens = shared, 12
    ids, mask = padded_rows(2)
    completion = mask[:, P:].float()

    def gradient(hook):
        trainer.model.zero_grad()
        logps, _, _ = hook(trainer.model, ids, mask, C)
        (logps * completion).sum().backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    padded = gradient(trainer._stock_logps_and_entropies)
    torch.testing.assert_close(gradient(trainer._get_per_token_logps_and_entropies), padded, rtol=1e-4, atol=1e-5)


def test_the_self_check_runs_in_the_training_layout_and_catches_a_kernel_that_crosses_sequences(
    trainer, flash, monkeypatch, caplog
):
    """A varlen path that loses its boundaries (stand-in: the packed_attention keyword dropped before the model, as a
    model that does not pass its keywords down would) differs only across packed sequences of one row: the check,
    which packs several sequences into each of two rows, falls back."""
    use_flash_attention(trainer.model)
    forward = trainer.model.forward

    def loses_boundaries(*args, packed_attention=None, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", loses_boundaries)
    layouts = _layouts(monkeypatch)
    ids, mask = padded_rows(3)
    with caplog.at_level(logging.WARNING):
        out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    check = trainer._packed_forward.self_check
    assert not check.passed and check.difference > 10 * check.tolerance
    assert "does not keep packed sequences apart" in caplog.text
    # The check's rows: two or more, several sequences in one.
    assert all(layout.input_ids.size(0) >= 2 and max(_segments_per_row(layout)) >= 2 for layout in layouts)
    monkeypatch.setattr(trainer.model, "forward", forward)
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    torch.testing.assert_close(out[0], padded)


def test_the_self_check_is_a_few_truncated_rows_whatever_the_batch(trainer, monkeypatch):
    """At 8K completions the first step must not pack the whole rows into a dense check: the check forwards at most
    four sequences of at most 32 + 32 tokens, in two rows or more."""
    layouts = _layouts(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (8, 300 + 500), generator=generator)
    mask = torch.ones_like(ids)
    trainer._packed_forward._run_self_check(ids, mask, 500)
    assert len(layouts) == 2  # packed, then shared
    for layout in layouts:
        assert (layout.input_ids != 0).sum() <= 4 * 64 and layout.input_ids.size(0) >= 2


def test_bf16_autocast_over_float32_weights_packs_within_the_padded_forward_s_noise(
    tmp_path, tiny_model_path, prompt_dataset, caplog
):
    """GRPOConfigExt's default on a GPU: float32 weights, bf16 autocast. Both forwards compute in bf16, which the
    check's tolerance measures (not the weights' float32 tolerance): packing engages, exact to bf16 rounding."""
    trainer = make_trainer(tmp_path, tiny_model_path, None, prompt_dataset, bf16=True)
    assert trainer.model.dtype == torch.float32
    ids, mask = padded_rows(4)
    with caplog.at_level(logging.WARNING):
        packed = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    check = trainer._packed_forward.self_check
    assert check.dtype == torch.bfloat16 and check.passed and check.shared_passed, caplog.text
    assert "runs padded" not in caplog.text and "differs" not in caplog.text
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    completion = mask[:, P:].bool()
    assert (packed[0] - padded).abs()[completion].max() <= check.tolerance


@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_under_bf16_a_model_that_ignores_the_shared_prompt_mask_still_packs_without_sharing(
    tmp_path, tiny_model_path, prompt_dataset, monkeypatch, model
):
    """The bf16 tolerance still tells a completion that attends to its siblings from rounding: on the tests' random
    model, whose attention barely matters (a difference of about 0.018), and on the demo's trained one (about 4, where
    bf16 rounding alone moves its log-probs by about 0.04)."""
    from trl_grpo_ext.tools.recipes.demo import DEMO_MODEL

    path = tiny_model_path if model == "tiny" else DEMO_MODEL
    trainer = make_trainer(tmp_path, path, None, prompt_dataset, bf16=True)
    forward = trainer.model.forward

    def ignores_mask(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:  # TRL's padded forward keeps its mask
            kwargs["attention_mask"] = attention_mask
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", ignores_mask)
    ids, mask = padded_rows(3, vocab=len(trainer.processing_class))
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    check = trainer._packed_forward.self_check
    assert check.passed and check.shared_passed is False
    assert check.shared_difference > 1.5 * check.tolerance


@pytest.mark.slow
def test_flex_attention_shares_prompts_through_a_block_mask(trainer):
    """Flex attention (forwards without gradient: its backward does not run on a CPU)."""
    trainer.model.config._attn_implementation = "flex_attention"
    trainer._packed_forward.row_tokens = 12
    ids, mask = padded_rows(5)
    with torch.no_grad():
        padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
        packed = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert trainer._packed_forward.self_check.shared_passed
    completion = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][completion], padded[completion], rtol=0, atol=1e-5)


def _long_rope_model(path):
    """A Phi-3-architecture model with "longrope" rotary embeddings whose short and long factors differ a lot, saved
    with the tiny tokenizer: the rotary frequencies switch at 16 positions."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from trl_grpo_ext.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    half = 4  # head_dim 8
    config = Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * half,
            "long_factor": [8.0] * half,
            "original_max_position_embeddings": 16,
            "partial_rotary_factor": 1.0,
        },
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_rotary_embedding_of_the_forward_s_length_sees_the_padded_width(tmp_path, prompt_dataset):
    """Phi-3's "longrope" picks its frequencies from the forward's largest position: TRL's padded rows reach it
    (width 16 + 3 columns, past the 16 positions of the short factors) where no real sequence does."""
    path = _long_rope_model(tmp_path / "phi3")
    trainer = make_trainer(tmp_path / "out", path, None, prompt_dataset)
    assert length_dependent_rope(trainer.model.config)
    ids, mask = padded_rows(6)
    ids, mask = torch.nn.functional.pad(ids, (3, 0)), torch.nn.functional.pad(mask, (3, 0))  # width 19
    assert int(mask.sum(dim=1).max()) <= 16 < ids.size(1)  # longrope switches past 16 positions
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    packed = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert trainer._packed_forward.self_check.passed
    completion = mask[:, -C:].bool()
    torch.testing.assert_close(packed[0][completion], padded[completion], rtol=0, atol=1e-5)


def _router_model(path, output_router_logits: bool):
    """A two-layer Mixtral-architecture model (4 experts, 2 per token) with the tiny tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from trl_grpo_ext.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=0.01,
        max_position_embeddings=64,
        sliding_window=None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_model_with_the_router_loss_on_packs_without_a_4d_mask_and_runs_padded_past_the_row_budget(
    tmp_path, prompt_dataset
):
    """`output_router_logits=True` in the config: every forward computes the router loss from the attention mask,
    which the shared-prompt layout's 4-D mask would crash. The router-loss forward itself is one packed row without a
    tail, no longer than a dense mask's budget."""
    path = _router_model(tmp_path / "moe", output_router_logits=True)
    trainer = make_trainer(tmp_path / "out", path, None, prompt_dataset)
    ids, mask = padded_rows(7)
    padded = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C, compute_aux_loss=True)
    packed = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)  # a forward without the loss
    completion = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][completion], padded[0][completion], rtol=0, atol=1e-5)
    # With the loss: one row of the chunk's 8 rows' tokens, longer than the padded width 16: padded, as TRL does.
    out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_aux_loss=True)
    torch.testing.assert_close(out[2], padded[2])
    trainer._packed_forward.row_tokens = 256  # a budget that holds the chunk: packed, the same loss
    out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_aux_loss=True)
    torch.testing.assert_close(out[0][completion], padded[0][completion], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2], padded[2], rtol=1e-5, atol=1e-6)


def test_a_training_run_under_flash_attention_logs_its_padded_twin_s_losses(tmp_path, tiny_model_path, prompt_dataset):
    """Gradient checkpointing and LoRA (its reference the adapters-disabled model) with several packed rows: the
    packed_attention keyword reaches the layers when gradient checkpointing recomputes them."""
    runs = {}
    with flash_attention_emulation():
        for padding_free in (True, False):
            trainer = make_trainer(
                tmp_path / str(padding_free),
                tiny_model_path,
                None,
                prompt_dataset,
                peft_config=tiny_lora(),
                gradient_checkpointing=True,
                padding_free=padding_free,
                padding_free_row_tokens=24,
                max_steps=2,
            )
            use_flash_attention(trainer.model)
            trainer.train()
            if padding_free:
                assert trainer._packed_forward.self_check.shared_passed
            runs[padding_free] = [entry for entry in trainer.state.log_history if "loss" in entry]
    for key in ("loss", "grad_norm"):
        shared = torch.tensor([entry[key] for entry in runs[True]])
        padded = torch.tensor([entry[key] for entry in runs[False]])
        torch.testing.assert_close(shared, padded, rtol=1e-4, atol=1e-6)


def test_one_host_synchronisation_per_chunk_and_one_asynchronous_upload(trainer):
    """What a GPU would wait for, counted on the CPU (`benchmarks.syncs.SyncCounter`): reads of device values
    (`tolist`, `item`), data-dependent shapes (boolean indexing, `nonzero`) and tensors made from host data, in this
    package's code of a packed forward with shared prompts over three chunks. Per chunk: the rows' spans, read once,
    and the layout's arrays, uploaded once (asynchronously from pinned memory on a GPU)."""
    from benchmarks.syncs import SyncCounter

    ids, mask = padded_rows(8)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)  # the self-check, once per run
    with SyncCounter("cpu") as counter:
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, batch_size=3, compute_entropy=True)
    ours = {site: n for (owner, _, site), n in counter.sites.items() if owner == "trl_grpo_ext"}
    uploads = sum(n for site, n in ours.items() if site.endswith(" upload"))
    assert uploads == 3, ours
    assert sum(ours.values()) - uploads == 3, ours  # row_spans' read of each chunk


def test_forward_metrics_count_the_whole_micro_batch_when_rows_are_skipped(tmp_path, tiny_model_path, prompt_dataset):
    """forward/* say what TRL's padded layout forwards for the training micro-batch, whatever rows are skipped."""
    logs = {}
    for skip in (True, False):
        trainer = make_trainer(
            tmp_path / str(skip),
            tiny_model_path,
            None,
            prompt_dataset,
            reward_funcs=half_constant_reward,  # half of the groups without spread: their rows are skipped
            beta=0.0,
            skip_zero_advantage_rows=skip,
        )
        trainer.train()
        logs[skip] = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert any(entry["skipped_rows/fraction"] > 0 for entry in logs[True])
    for key in ("forward/padding_fraction", "forward/tokens_per_distinct", "forward/repeated_prompt_fraction"):
        torch.testing.assert_close(
            torch.tensor([entry[key] for entry in logs[True]]), torch.tensor([entry[key] for entry in logs[False]])
        )


def test_the_packed_layout_is_built_on_the_device_from_per_piece_arrays():
    """No per-token Python list: the host work grows with the rows, not with their tokens."""
    ids, mask = padded_rows(9)
    spans = row_spans(mask, C, ids)
    long_ids = torch.nn.functional.pad(ids, (0, 4000))
    long_mask = torch.nn.functional.pad(mask, (0, 4000))
    long_mask[:, P : P + 4000] = 1  # the same rows with 4,000 more completion tokens each
    long_ids[:, P : P + 4000] = 5
    import tracemalloc

    def host_bytes(i, m, width) -> int:
        s = row_spans(m, width, i)
        tracemalloc.start()
        pack_rows(i, m, width, None, s, shared_prompts=True)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    short, long = host_bytes(ids, mask, C), host_bytes(long_ids, long_mask, C + 4000)
    assert len(spans) == 8 and long < 2 * short + 20_000


def test_sdpa_in_half_precision_on_a_gpu_packs_through_torch_s_varlen_kernel():
    """sdpa on CUDA in bf16 or fp16, where this torch has `varlen_attn`: no dense mask; in float32 (no flash kernel),
    on a CPU, or with an attention soft cap, the dense mask."""
    from transformers import Qwen2Config

    from trl_grpo_ext.forward import attention

    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    available = attention.torch_varlen() is not None
    assert attention_kind(config, "cuda", torch.bfloat16) == ("varlen" if available else "dense")
    assert attention_kind(config, "cuda", torch.float32) == "dense"
    assert attention_kind(config, "cpu", torch.bfloat16) == "dense"
    assert attention_kind(config) == "dense"


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "packed"])
def test_the_sdpa_varlen_route_is_the_padded_forward(trainer, monkeypatch, shared):
    """The route of sdpa on a GPU (`attention.torch_varlen_attention`), run on the CPU with an exact stand-in for
    PyTorch's varlen kernel: the queries and gathered keys as the kernel takes them, grouped heads, the scale, the
    causal window; forward and gradient."""
    from benchmarks.emulation import torch_varlen_attn
    from trl_grpo_ext.forward import attention

    monkeypatch.setattr(attention, "torch_varlen", lambda: torch_varlen_attn)
    monkeypatch.setattr(type(trainer._packed_forward), "kind", lambda self, model: "varlen")
    trainer._packed_forward.shared_prompts, trainer._packed_forward.row_tokens = shared, 12
    ids, mask = padded_rows(10)
    completion = mask[:, P:].float()

    def forward(hook):
        trainer.model.zero_grad()
        logps, _, _ = hook(trainer.model, ids, mask, C)
        (logps * completion).sum().backward()
        return logps.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    padded, padded_gradient = forward(trainer._stock_logps_and_entropies)
    packed, packed_gradient = forward(trainer._get_per_token_logps_and_entropies)
    assert trainer._packed_forward.self_check.passed
    torch.testing.assert_close(packed[completion.bool()], padded[completion.bool()], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_gradient, padded_gradient, rtol=1e-4, atol=1e-5)
