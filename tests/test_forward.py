"""The padding-free log-prob forward (`trl_grpo_ext.forward`): its layouts (packed, shared-prompt), the token counts,
equality with TRL's padded forward in the trainer, the self-check and the fallbacks."""

import logging

import pytest
import torch
from helpers import make_trainer, tiny_lora

from trl_grpo_ext.forward import forward_counts, logprobs, pack_rows, row_spans, run_fallback_reason, unpackable_reason
from trl_grpo_ext.forward import layout as layout_module
from trl_grpo_ext.forward.layout import first_of_prompt, place_units, prompt_leaders
from trl_grpo_ext.forward.logprobs import (
    attention_weight,
    default_row_tokens,
    dense_attention_weight,
    linear_parameters,
    shared_fallback_reason,
)

P, C = 7, 9
PROMPT_LENGTHS = [7, 3, 5, 7, 2, 4]
COMPLETION_LENGTHS = [9, 1, 4, 0, 9, 6]


def padded_rows(seed: int = 0, shared: bool = False):
    """Rows as TRL builds them: prompts left-padded to P, completions right-padded to C (one has no completion).
    `shared`: rows 0, 3 and 5 have one prompt, rows 1 and 4 another (out of TRL's order, as after a shuffle)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20, (len(PROMPT_LENGTHS), P + C), generator=generator)
    lengths = list(PROMPT_LENGTHS)
    if shared:
        for row, leader in SHARED_LEADERS.items():
            ids[row, :P], lengths[row] = ids[leader, :P], lengths[leader]
    mask = torch.ones_like(ids)
    for i, (prompt, completion) in enumerate(zip(lengths, COMPLETION_LENGTHS, strict=True)):
        mask[i, : P - prompt] = 0
        mask[i, P + completion :] = 0
    return ids * mask, mask


#: `padded_rows(shared=True)`: the rows that repeat an earlier row's prompt, and that row.
SHARED_LEADERS = {3: 0, 5: 0, 4: 1}


@pytest.mark.parametrize("row_tokens", [None, 10, 1])
def test_packing_keeps_each_sequence_s_tokens_positions_and_scored_tokens(row_tokens):
    ids, mask = padded_rows()
    layout = pack_rows(ids, mask, C, row_tokens)
    total = sum(PROMPT_LENGTHS) + sum(COMPLETION_LENGTHS)
    assert layout.num_sequences == 6
    if row_tokens is None:
        assert layout.input_ids.shape == (1, total)
    if row_tokens == 1:  # each sequence in a row of its own
        assert layout.input_ids.size(0) == 6
    # The real tokens (ids >= 3 here; a packed row's tail holds 0) are each row's, whole, at positions 0, 1, ...
    real = layout.input_ids != 0
    tokens, positions = layout.input_ids[real], layout.position_ids[real]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    sequences = [(tokens[a:b].tolist(), positions[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert sorted(sequence for sequence, _ in sequences) == sorted(ids[i][mask[i].bool()].tolist() for i in range(6))
    assert all(places == list(range(len(places))) for _, places in sequences)
    lengths = [p + c for p, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True)]
    if row_tokens is not None:
        assert all(int(row.sum()) <= max(row_tokens, max(lengths)) for row in real)
    # The scored tokens are exactly the completion tokens, put back where TRL has them.
    completion = mask[:, P:].bool()
    assert layout.targets.numel() == int(completion.sum())
    assert torch.equal(layout.unpack(layout.targets, (6, C)), ids[:, P:] * completion)
    keep_next = torch.zeros_like(layout.keep)
    keep_next[:, 1:] = layout.keep[:, :-1]
    assert torch.equal(layout.input_ids[keep_next], layout.targets)


@pytest.mark.parametrize("row_tokens", [None, 16, 1])
def test_the_shared_prompt_layout_forwards_each_prompt_once_and_each_completion_after_it(row_tokens):
    ids, mask = padded_rows(shared=True)
    layout = pack_rows(ids, mask, C, row_tokens, shared_prompts=True)
    leaders = [SHARED_LEADERS.get(i, i) for i in range(6)]
    assert prompt_leaders(ids[:, :P], mask[:, :P]).tolist() == leaders
    assert [span.leader for span in row_spans(mask, C, ids)] == leaders
    unit, branch = layout.units, layout.branches
    real = layout.input_ids != 0
    prompts = {i: ids[i, :P][mask[i, :P].bool()] for i in set(leaders)}
    if row_tokens is None:  # each prompt but its last token once, then per row its last prompt token and completion
        distinct = sum(len(prompt) - 1 for prompt in prompts.values()) + sum(1 + c for c in COMPLETION_LENGTHS)
        assert int(real.sum()) == distinct
    # Each branch is its row's last prompt token and completion, at the positions its padded row gives them.
    pairs = {(int(u), int(b)) for u, b in zip(unit.flatten(), branch.flatten(), strict=True) if b > 0}
    branches = [
        (layout.input_ids[(unit == u) & (branch == b)], layout.position_ids[(unit == u) & (branch == b)])
        for u, b in pairs
    ]
    assert len(branches) == 6
    for i in range(6):
        prompt, completion = prompts[leaders[i]], ids[i, P:][mask[i, P:].bool()]
        tokens = torch.cat([prompt[-1:], completion])
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion))
        assert any(torch.equal(t, tokens) and torch.equal(pos, positions) for t, pos in branches), f"row {i}"
    # A branch sees its unit's shared prompt and itself, never another branch or another unit.
    attention = layout.attention()[:, 0]
    for row in range(attention.size(0)):
        q, k = torch.nonzero(attention[row], as_tuple=True)
        assert (k <= q).all() and (unit[row][q] == unit[row][k]).all()
        assert ((branch[row][k] == 0) | (branch[row][k] == branch[row][q])).all()
    completion = mask[:, P:].bool()
    assert torch.equal(layout.unpack(layout.targets, (6, C)), ids[:, P:] * completion)
    keep_next = torch.zeros_like(layout.keep)
    keep_next[:, 1:] = layout.keep[:, :-1]
    assert torch.equal(layout.input_ids[keep_next], layout.targets)
    if row_tokens is not None:
        assert all(int(r.sum()) <= max(row_tokens, len(prompts[0]) + 1 + C) for r in real)


def test_rows_are_no_longer_than_the_padded_ones_under_a_dense_mask_and_one_row_where_attention_is_per_sequence():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, head_dim=16
    )
    untied = Qwen3ForCausalLM(Qwen3Config(**{**config.to_dict(), "tie_word_embeddings": False}))
    tied = Qwen3ForCausalLM(Qwen3Config(**{**config.to_dict(), "tie_word_embeddings": True}))
    total = sum(parameter.numel() for parameter in untied.parameters())
    assert linear_parameters(untied) == total - 1000 * 64  # the looked-up embeddings are no multiply-add
    assert linear_parameters(tied) == sum(parameter.numel() for parameter in tied.parameters())  # the head counts
    parameters = linear_parameters(untied)
    # A token's attention per attended token (2 h n multiply-adds) against its linear layers' (P).
    assert attention_weight(untied.config, parameters) == pytest.approx(2 * 4 * 16 * 3 / parameters)
    assert attention_weight(object(), parameters) == 0.0  # a config that does not say its attention's size
    assert default_row_tokens("dense", padded_width=77) == 77
    assert default_row_tokens(None, padded_width=77) == 77
    # Under a dense mask, longer than the padded rows only where a token's attention, at masked attention's cost,
    # stays at most half of its linear layers': for this model, rows of up to P / (2 * 8 * 2 h n) tokens.
    weight = dense_attention_weight(untied.config, parameters)
    assert weight == pytest.approx(8 * 2 * 4 * 16 * 3 / parameters)
    assert default_row_tokens("dense", padded_width=16, weight=weight) == int(0.5 / weight) > 16
    assert default_row_tokens("dense", padded_width=10**6, weight=weight) == 10**6
    assert default_row_tokens("varlen", padded_width=77) is None
    assert default_row_tokens("flex", padded_width=77) is None


def _sizes(units, placements):
    """The tokens of each packed row of a `place_units` answer."""
    rows = {}
    for unit, (row, _) in zip(units, placements, strict=True):
        rows[row] = rows.get(row, 0) + layout_module._unit_size(unit)
    return [rows[row] for row in sorted(rows)]


def test_units_are_placed_largest_first_where_they_fill_a_row_best():
    """Sequences of 6, 5, 5 and 4 tokens in rows of 10: in order, a new row at each overflow, they take 3 rows
    (6 | 5 5 | 4); placed largest first into the row each fills best, 2 (6 4 | 5 5)."""
    groups = [(None, [(i, 0, n, 0)]) for i, n in enumerate([6, 5, 5, 4])]
    units, placements = place_units(groups, row_tokens=10)
    assert sorted(_sizes(units, placements)) == [10, 10]
    assert sorted(branch[0] for _, branches in units for branch in branches) == [0, 1, 2, 3]  # each once
    assert placements == sorted(placements)  # in the packed rows' order, as the layout's index tensors need them
    # One row, in order, without a budget.
    units, placements = place_units(groups, row_tokens=None)
    assert units == groups and placements == [(0, 0), (0, 6), (0, 11), (0, 16)]


def test_a_prompt_s_completions_split_over_rows_only_as_the_budget_needs():
    """A prompt of 4 tokens with completions of 6, 5, 3 and 2 (branches): 20 tokens whole. In rows of 20 it stays
    one unit; in rows of 12 its completions split in two units, each with the prompt again, none in a row past 12."""
    prefix = (0, 0, 4)
    group = (prefix, [(i, 0, n, 0) for i, n in enumerate([6, 5, 3, 2])])
    units, placements = place_units([group], row_tokens=20)
    assert len(units) == 1 and _sizes(units, placements) == [20]
    units, placements = place_units([group], row_tokens=12)
    assert len(units) == 2 and all(unit[0] == prefix for unit in units)
    assert sorted(branch[2] for _, branches in units for branch in branches) == [2, 3, 5, 6]
    assert max(_sizes(units, placements)) <= 12


def test_attention_s_cost_chooses_more_shorter_rows():
    """Eight sequences of 10 tokens under a budget of 80: without attention's cost the fewest rows (one of 80);
    where attention over a row costs much (the weight of a token attending to 10 others equal to its linear layers),
    rows of one sequence each (8 x 10 tokens at cost 8 * 10 * 2 against 80 * 9)."""
    groups = [(None, [(i, 0, 10, 0)]) for i in range(8)]
    assert _sizes(*place_units(groups, row_tokens=80)) == [80]
    assert _sizes(*place_units(groups, row_tokens=80, attention_weight=0.1)) == [10] * 8


def test_the_benchmark_s_rows_pack_with_little_waste():
    """The forward benchmark's micro-batch (`benchmarks/forward.py`, 2 groups of 8, one completion of each cut at
    1,024), laid out as the default budgets lay it: TRL forwards 3.4 tokens per distinct token. Where attention runs
    within sequences (one packed row) the shared-prompt layout forwards at most 1.1 (a prompt's last token once per
    completion); under a dense mask (rows no longer than TRL's) at most 1.3 with shared prompts (docs/performance.md's
    table), at most 2 without (a prompt per completion)."""
    from benchmarks.forward import draw_rows

    ids, mask, width = draw_rows(2, 8, seed=0, vocab=32000, quick=False)
    distinct = int(forward_counts(ids[:, :-width], mask[:, :-width], mask[:, -width:]).distinct)
    weight = 8 / 5482  # 2 h n / P of the benchmark's model, at masked attention's cost
    padded_width = ids.size(1)

    def tokens(shared: bool, kind: str) -> float:
        budget = default_row_tokens(kind, padded_width, weight)
        layout = pack_rows(ids, mask, width, budget, shared_prompts=shared, attention_weight=weight)
        if budget is not None:
            assert layout.input_ids.size(1) <= padded_width
        return layout.input_ids.numel() / distinct

    assert ids.numel() / distinct > 3.3
    assert tokens(shared=True, kind="varlen") <= 1.1
    assert tokens(shared=True, kind="dense") <= 1.3
    assert tokens(shared=False, kind="dense") <= 2.0


def test_rows_that_cannot_pack_are_named():
    ids, mask = padded_rows()
    assert unpackable_reason(row_spans(mask, C), P) is None
    gap = mask.clone()
    gap[0, P + 2] = 0
    assert "gap" in unpackable_reason(row_spans(gap, C), P)
    no_prompt = mask.clone()
    no_prompt[1, :P] = 0
    assert "no prompt" in unpackable_reason(row_spans(no_prompt, C), P)


def test_counts_of_the_padded_forward():
    ids, mask = padded_rows()
    prompt_ids, prompt_mask = ids[:, :P].clone(), mask[:, :P]
    prompt_ids[3] = prompt_ids[0]  # row 3 repeats row 0's prompt (7 tokens); row 5 repeats row 2's after a shuffle
    prompt_ids[5], prompt_mask = prompt_ids[2], prompt_mask.clone()
    prompt_mask[5] = prompt_mask[2]
    counts = forward_counts(prompt_ids, prompt_mask, mask[:, P:])
    real = int(prompt_mask.sum()) + sum(COMPLETION_LENGTHS)
    assert first_of_prompt(prompt_ids, prompt_mask).tolist() == [True, True, True, False, True, False]
    assert counts.forwarded == 6 * (P + C)
    assert counts.padding == 6 * (P + C) - real
    assert counts.repeated_prompt == 7 + 5
    assert counts.distinct == real - 12
    metrics = counts.metrics()
    assert set(metrics) == {
        "forward/padding_fraction",
        "forward/repeated_prompt_fraction",
        "forward/tokens_per_distinct",
    }


@pytest.fixture
def trainer(tmp_path, tiny_model_path, prompt_dataset):
    return make_trainer(tmp_path, tiny_model_path, None, prompt_dataset)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "packed"])
@pytest.mark.parametrize("batch_size,row_tokens", [(None, 2048), (4, None), (None, 10)])
def test_the_packed_forward_is_trl_s_padded_forward_to_rounding(trainer, batch_size, row_tokens, shared):
    ids, mask = padded_rows(1, shared=True)
    trainer._packed_forward.row_tokens = row_tokens
    trainer._packed_forward.shared_prompts = shared
    model = trainer.model
    logps, entropies, _ = trainer._stock_logps_and_entropies(model, ids, mask, C, batch_size, compute_entropy=True)
    packed = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size, compute_entropy=True)
    check = trainer._packed_forward.self_check
    assert check.passed and check.shared_passed is (True if shared else None)
    completion = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][completion], logps[completion], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1][completion], entropies[completion], rtol=0, atol=1e-5)
    assert packed[0].shape == logps.shape and not packed[0][~completion].any()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "packed"])
def test_the_gradient_of_the_packed_forward_is_the_padded_one(trainer, shared):
    ids, mask = padded_rows(2, shared=True)
    trainer._packed_forward.shared_prompts = shared
    model = trainer.model
    completion = mask[:, P:].float()

    def gradient(hook):
        model.zero_grad()
        logps, _, _ = hook(model, ids, mask, C)
        (logps * completion).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    padded = gradient(trainer._stock_logps_and_entropies)
    packed = gradient(trainer._get_per_token_logps_and_entropies)
    torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-5)


def test_a_model_that_does_not_pack_falls_back_with_a_warning_that_names_it(trainer, monkeypatch, caplog):
    """A model whose attention ignores position_ids (stand-in: the positions are dropped before the model)."""
    forward = trainer.model.forward

    def ignores_positions(*args, position_ids=None, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", ignores_positions)
    ids, mask = padded_rows(3)
    with caplog.at_level(logging.WARNING):
        out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    check = trainer._packed_forward.self_check
    assert check.done and not check.passed and check.difference > 1e-3
    assert "differs from the padded one" in caplog.text
    monkeypatch.setattr(trainer.model, "forward", forward)
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    torch.testing.assert_close(out[0], padded)  # the fallback is TRL's padded forward


def test_a_model_that_ignores_the_4d_mask_packs_without_sharing_with_a_warning(trainer, monkeypatch, caplog):
    """Stand-in: a 4-D attention mask is dropped before the model, which then attends causally over the whole row."""
    forward = trainer.model.forward

    def ignores_mask(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:  # TRL's padded forward keeps its mask
            kwargs["attention_mask"] = attention_mask
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", ignores_mask)
    ids, mask = padded_rows(3, shared=True)
    with caplog.at_level(logging.WARNING):
        out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    check = trainer._packed_forward.self_check
    assert check.passed and check.shared_passed is False and check.shared_difference > 1e-3
    assert "does not keep a completion to its prompt and itself" in caplog.text
    monkeypatch.setattr(trainer.model, "forward", forward)
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    completion = mask[:, P:].bool()
    torch.testing.assert_close(out[0][completion], padded[completion], rtol=0, atol=1e-5)  # packed, not shared


def test_what_cannot_share_a_prompt_is_named_and_said_once(trainer, monkeypatch, caplog):
    config = trainer.model.config
    assert shared_fallback_reason(config, compute_aux_loss=False) is None
    assert "router loss" in shared_fallback_reason(config, compute_aux_loss=True)
    monkeypatch.setattr(config, "_attn_implementation", "flash_attention_2")  # boundaries per segment
    assert shared_fallback_reason(config, compute_aux_loss=False) is None
    monkeypatch.setattr(config, "_attn_implementation", "an_unknown_kernel")
    assert "an_unknown_kernel" in shared_fallback_reason(config, compute_aux_loss=False)
    monkeypatch.setattr(config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(config, "layer_types", ["full_attention", "sliding_attention"])
    assert "sliding-window" in shared_fallback_reason(config, compute_aux_loss=False)
    monkeypatch.undo()
    # A reason the model gives (here, one stood in for the run's config): the forward packs without sharing.
    monkeypatch.setattr(
        logprobs, "shared_fallback_reason", lambda config, compute_aux_loss, kind: "the stand-in reason"
    )
    ids, mask = padded_rows(shared=True)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert caplog.text.count("packs without sharing prompts: the stand-in reason") == 1
    padded, _, _ = trainer._stock_logps_and_entropies(trainer.model, ids, mask, C)
    completion = mask[:, P:].bool()
    torch.testing.assert_close(out[0][completion], padded[completion], rtol=0, atol=1e-5)


def test_options_that_cannot_pack_fall_back_with_one_line(trainer, caplog):
    ids, mask = padded_rows()
    trainer.args.pad_to_multiple_of = 8
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert caplog.text.count("pad_to_multiple_of=8 asks for padded shapes") == 1
    trainer.args.pad_to_multiple_of = None
    assert run_fallback_reason(trainer, {"pixel_values": None}) is None
    assert "vision-language inputs" in run_fallback_reason(trainer, {"pixel_values": torch.zeros(1)})
    trainer.args.use_liger_kernel = True
    assert "use_liger_kernel" in run_fallback_reason(trainer, {})


def test_training_logs_the_forward_metrics_and_matches_the_padded_run(tmp_path, tiny_model_path, prompt_dataset):
    runs = {}
    for padding_free in (True, False):
        trainer = make_trainer(
            tmp_path / str(padding_free), tiny_model_path, None, prompt_dataset, padding_free=padding_free
        )
        trainer.train()
        runs[padding_free] = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in runs[True] + runs[False]:  # logged with the option off too: what it would save
        assert 0 <= entry["forward/padding_fraction"] < 1
        assert entry["forward/tokens_per_distinct"] > 1
        assert 0 < entry["forward/repeated_prompt_fraction"] < 1  # 4 completions per prompt
    for key in ("loss", "grad_norm", "entropy", "forward/padding_fraction"):
        packed = torch.tensor([entry[key] for entry in runs[True]])
        padded = torch.tensor([entry[key] for entry in runs[False]])
        torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "setting",
    [{"loss_type": name} for name in ("bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")]
    + [{"gradient_checkpointing": True}, {"lora": True}, {"beta": 0.04, "num_iterations": 2}]
    + [{"skip_zero_advantage_rows": True}, {"dynamic_sampling": True}, {"selective_rollouts": True}],
    ids=lambda setting: "-".join(f"{key}={value}" for key, value in setting.items()),
)
def test_a_shared_prompt_run_trains_as_its_padded_twin(
    tmp_path, tiny_model_path, prompt_dataset, monkeypatch, setting
):
    """Every loss type, gradient checkpointing, LoRA (its reference the adapters-disabled model), the reference and
    old-policy forwards, row skipping, dynamic sampling, selective rollouts: the shared-prompt run logs its padded
    twin's losses and gradient norms to rounding."""
    branches = []  # the most completions after one copy of a prompt, per packed forward of the run

    def recording(*args, **kwargs):
        layout = pack_rows(*args, **kwargs)
        branches.append(int(layout.branches.max()))
        return layout

    monkeypatch.setattr(logprobs, "pack_rows", recording)
    # Rows filled whatever their attention costs: on this tiny model attention outweighs the linear layers, and the
    # layout of least cost would forward each completion with its own copy of the prompt.
    monkeypatch.setattr(logprobs, "MASKED_ATTENTION_COST", 0.0)
    setting = dict(setting)
    lora = setting.pop("lora", False)
    runs = {}
    for padding_free in (True, False):
        trainer = make_trainer(
            tmp_path / str(padding_free),
            tiny_model_path,
            None,
            prompt_dataset,
            peft_config=tiny_lora() if lora else None,
            padding_free=padding_free,
            padding_free_row_tokens=64,  # rows that hold a prompt's 4 completions (the default: the padded width)
            max_steps=2,
            **setting,
        )
        trainer.train()
        if padding_free:
            assert trainer._packed_forward.self_check.shared_passed
            # The self-check (packed, then shared), then each forward of the run: a prompt's 4 completions share it.
            assert branches[:2] == [0, 2] and set(branches[2:]) == {4}
        runs[padding_free] = [entry for entry in trainer.state.log_history if "loss" in entry]
    for key in ("loss", "grad_norm"):
        shared = torch.tensor([entry[key] for entry in runs[True]])
        padded = torch.tensor([entry[key] for entry in runs[False]])
        torch.testing.assert_close(shared, padded, rtol=1e-4, atol=1e-6)
