"""`ops.sampler_cuts`: the trainer's log-probs under vLLM's cuts against a brute-force reference (full softmax, the
kept set built token by token), for top_k, top_p, min_p, their combinations, temperature, the logit transform and
ties; the top-p cut through top-k bounds against the full sort, on rows built around the bounds' edges, and the sorts
it leaves."""

import math

import pytest
import torch

from trl_grpo_ext.extras.vllm.sampler_cuts import SamplerCuts, truncated_log_probs, truncated_log_probs_from_hidden


def reference(logits: torch.Tensor, target: int, cuts: SamplerCuts) -> tuple[float, bool]:
    """log p_trunc(target) for one position, in float64, and whether the cut kept the target.

    The kept set as vLLM 0.31 builds it, written out: min_p on the probabilities, then the k largest logits with every
    tie of the k-th, then top-p over the survivors renormalised, in decreasing order, keeping a token while the mass
    before it is below top_p; a token as likely as the least likely kept one counts as kept (its mass is not added:
    which of the tied tokens the sort puts first does not change S)."""
    z = logits.double()
    p = z.softmax(-1)
    vocab = z.numel()
    keep = [True] * vocab
    if cuts.min_p > 0:
        keep = [keep[i] and p[i] >= cuts.min_p * p.max() for i in range(vocab)]
    if cuts.top_k > 0:
        survivors = sorted((z[i].item() for i in range(vocab) if keep[i]), reverse=True)
        kth = survivors[min(cuts.top_k, len(survivors)) - 1]
        keep = [keep[i] and z[i].item() >= kth for i in range(vocab)]
    if cuts.top_p < 1:
        total = sum(p[i].item() for i in range(vocab) if keep[i])
        q = {i: p[i].item() / total for i in range(vocab) if keep[i]}
        mass, kept_top_p = 0.0, set()
        for i in sorted(q, key=q.get, reverse=True):
            if mass < cuts.top_p:
                kept_top_p.add(i)
            mass += q[i]
        smallest = min(q[i] for i in kept_top_p)
        # A tie of the least likely kept token counts as kept when sampled, its mass stays out of S.
        was_kept = keep[target] and (target in kept_top_p or math.isclose(q[target], smallest, rel_tol=1e-9))
        keep = [keep[i] and i in kept_top_p for i in range(vocab)]
    else:
        was_kept = keep[target]
    keep[target] = keep[target] or not was_kept  # a sampled token outside the cut joins the kept set
    kept_mass = sum(p[i].item() for i in range(vocab) if keep[i])
    return math.log(p[target].item()) - math.log(kept_mass), was_kept


CUTS = {
    "top_k=1": SamplerCuts(top_k=1),
    "top_k=3": SamplerCuts(top_k=3),
    "top_k=vocab": SamplerCuts(top_k=40),
    "top_p=0.5": SamplerCuts(top_p=0.5),
    "top_p=0.9": SamplerCuts(top_p=0.9),
    "min_p=0.1": SamplerCuts(min_p=0.1),
    "min_p=0.3": SamplerCuts(min_p=0.3),
    "top_k=4,top_p=0.6": SamplerCuts(top_k=4, top_p=0.6),
    "min_p=0.05,top_p=0.8": SamplerCuts(top_p=0.8, min_p=0.05),
    "top_k=6,top_p=0.7,min_p=0.02": SamplerCuts(top_k=6, top_p=0.7, min_p=0.02),
}


@pytest.mark.parametrize("name", CUTS)
def test_truncated_log_probs_are_the_brute_force_ones(name):
    cuts = CUTS[name]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=generator) * 2.5
    targets = torch.randint(0, 40, (64,), generator=generator)
    out = truncated_log_probs(logits, targets, cuts, chunk_size=5)
    expected = [reference(row, int(target), cuts) for row, target in zip(logits, targets, strict=True)]
    want = torch.tensor([e[0] for e in expected], dtype=torch.float64)
    torch.testing.assert_close(out.truncated.double(), want, rtol=0, atol=2e-6)
    assert out.kept.tolist() == [e[1] for e in expected]
    torch.testing.assert_close(out.logps, logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0])
    if cuts.truncates and name != "top_k=vocab":
        assert (out.log_kept_mass < -1e-3).any() and not out.kept.all()  # the cut acted, also on sampled tokens
    else:
        torch.testing.assert_close(out.log_kept_mass, torch.zeros(64), rtol=0, atol=1e-6)


def test_without_a_cut_the_log_probs_are_the_whole_vocabulary_s():
    logits = torch.randn(8, 5, 30)
    targets = torch.randint(0, 30, (8, 5))
    out = truncated_log_probs(logits, targets, SamplerCuts())
    assert not SamplerCuts().truncates and SamplerCuts(top_k=-1).truncates is False
    torch.testing.assert_close(out.truncated, logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0])
    assert out.kept.all()


def test_ties_at_the_top_k_threshold_are_all_kept():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    out = truncated_log_probs(logits.expand(6, 6), torch.arange(6), SamplerCuts(top_k=2))
    p = logits.softmax(-1)[0]
    kept_mass = p[:4].sum()
    torch.testing.assert_close(out.truncated[:4], (p[:4] / kept_mass).log())
    assert out.kept.tolist() == [True, True, True, True, False, False]


def test_every_token_of_a_tie_at_the_top_p_boundary_counts_as_kept_and_the_mass_does_not_depend_on_the_order():
    """Four equally likely tokens, top_p=0.6: three of them fill the nucleus (0, 0.25, 0.5 < 0.6); which three is the
    sort's choice, so each of the four gets log(0.25 / 0.75)."""
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, -30.0]])
    out = truncated_log_probs(logits.expand(5, 5), torch.arange(5), SamplerCuts(top_p=0.6))
    p = logits.softmax(-1)[0]
    torch.testing.assert_close(out.truncated[:4], torch.full((4,), math.log(p[0] / (3 * p[0]))))
    assert out.kept.tolist() == [True] * 4 + [False]
    # the unlikely token joins the kept set as the sampled one: p / (0.75 + p)
    torch.testing.assert_close(out.truncated[4], (p[4] / (3 * p[0] + p[4])).log())


def test_the_most_likely_token_is_always_kept_by_top_p():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    out = truncated_log_probs(logits, torch.tensor([0]), SamplerCuts(top_p=0.01))
    torch.testing.assert_close(out.truncated, torch.zeros(1))


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_most_likely():
    p = torch.tensor([0.5, 0.22, 0.03, 0.25])
    out = truncated_log_probs(p.log()[None].expand(4, 4), torch.arange(4), SamplerCuts(min_p=0.4))
    kept = p[[0, 1, 3]].sum()  # 0.22 and 0.25 are >= 0.4 * 0.5, 0.03 is not
    torch.testing.assert_close(out.truncated[[0, 1, 3]], (p[[0, 1, 3]] / kept).log())
    assert out.kept.tolist() == [True, True, False, True]


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_from_hidden_states_is_the_transformed_logits_cut_in_chunks(softcap, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator)
    bias = torch.randn(50, generator=generator)
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    cuts = SamplerCuts(top_k=8, top_p=0.75)
    y = (hidden @ weight.T + bias) * 0.5
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    expected = truncated_log_probs(y / 0.7, targets, cuts)
    rows = []
    linear = torch.nn.functional.linear

    def counted(input, *args):
        rows.append(input.shape[0])
        return linear(input, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    out = truncated_log_probs_from_hidden(
        hidden, weight, bias, targets, cuts, temperature=0.7, logit_scale=0.5, softcap=softcap, chunk_size=4
    )
    assert rows == [4, 4, 4, 4, 4, 1]  # 21 positions, never more than a chunk of logits at once
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert out.truncated.shape == (3, 7)


def test_empty_inputs_and_wrong_shapes():
    out = truncated_log_probs_from_hidden(
        torch.zeros(2, 0, 4), torch.zeros(9, 4), None, torch.zeros(2, 0, dtype=torch.long), SamplerCuts(top_k=2)
    )
    assert out.truncated.shape == (2, 0)
    with pytest.raises(ValueError, match="targets"):
        truncated_log_probs(torch.zeros(3, 9), torch.zeros(4, dtype=torch.long), SamplerCuts(top_k=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplerCuts(top_p=0.0)


# The top-p cut through top-k bounds: the same result as the full sort, and the sort only where a bound falls short.

BOUNDS = (8, 32)  # small bounds, so that a 96-token vocabulary has nuclei inside, between and beyond them
VOCAB = 96


def nucleus_row(size: int, top_p: float, generator: torch.Generator, tied: int = 0) -> torch.Tensor:
    """Log-probabilities whose top-p nucleus holds exactly `size` tokens, in a random vocabulary order.

    Without `tied`: `size` equal tokens of mass `m`, `(size - 1) * m < top_p < size * m`. With `tied`: `size - 1`
    tokens of mass `b`, then `1 + tied` equal tokens of mass `t < b`, the mass before the first of them `t / 2` short
    of `top_p` (the cut falls inside the tie). The rest of the mass is spread unevenly, each token below the kept ones.
    """
    if tied:
        smallest = top_p / (size + 1)
        big = (top_p - smallest / 2) / (size - 1)
        head = torch.tensor([big] * (size - 1) + [smallest] * (1 + tied), dtype=torch.float64)
    else:
        smallest = top_p / (size - 0.5) if size > 1 else 0.9
        head = torch.full((size,), smallest, dtype=torch.float64)
    rest = torch.rand(VOCAB - len(head), generator=generator, dtype=torch.float64) + 0.5
    rest = rest / rest.sum() * (1 - head.sum())
    assert 0 < rest.min() and rest.max() < smallest <= head.min()
    return torch.cat([head, rest])[torch.randperm(VOCAB, generator=generator)].log().float()


def adversarial_rows(top_p: float) -> torch.Tensor:
    """Rows around each bound's edge (nuclei of `K - 1`, `K`, `K + 1`, `K + 2` tokens), ties across the edges,
    flat rows (top-p needs most of the vocabulary), rows with `-inf` logits and peaked random rows."""
    generator = torch.Generator().manual_seed(7)
    rows = [nucleus_row(size, top_p, generator) for size in (1, 2, 7, 8, 9, 10, 31, 32, 33, 34, 50)]
    rows += [nucleus_row(size, top_p, generator, tied=2) for size in (7, 8, 9, 32, 33)]
    rows += [torch.zeros(VOCAB), torch.zeros(VOCAB).index_fill(0, torch.tensor([5]), 1e-3)]  # flat
    few = torch.full((VOCAB,), -math.inf)
    few[[3, 40, 77]] = torch.tensor([0.5, 0.0, -0.5])
    one = torch.full((VOCAB,), -math.inf).index_fill(0, torch.tensor([11]), 2.0)
    half = torch.rand(VOCAB, generator=generator) < 0.5
    masked = torch.randn(VOCAB, generator=generator).masked_fill(half, -math.inf)
    rows += [few, one, masked]
    scales = torch.tensor([[0.3], [1.0], [2.0], [4.0], [8.0], [16.0]])
    rows += list(torch.randn(6, VOCAB, generator=generator) * scales)
    return torch.stack(rows)


BOUNDED_CUTS = {
    "top_p=0.7": SamplerCuts(top_p=0.7),
    "top_p=0.95": SamplerCuts(top_p=0.95),
    "top_k=20,top_p=0.7": SamplerCuts(top_k=20, top_p=0.7),
    "top_k=50,top_p=0.7": SamplerCuts(top_k=50, top_p=0.7),
    "min_p=0.2,top_p=0.7": SamplerCuts(top_p=0.7, min_p=0.2),
    "min_p=0.01,top_k=40,top_p=0.95": SamplerCuts(top_k=40, top_p=0.95, min_p=0.01),
}


@pytest.mark.parametrize("name", BOUNDED_CUTS)
def test_the_top_k_bounds_give_the_full_sort_s_cut_bit_for_bit(name):
    """Every sampled token of every adversarial row: `kept` and the log kept mass equal to the full sort's
    (`top_p_bounds=()`) bit for bit on the CPU, and both equal to the brute-force reference. A bound that trusted
    `K` tokens for a nucleus of `K + 1` would lose the `K + 1`-th token's mass (at least 2% here)."""
    cuts = BOUNDED_CUTS[name]
    rows = adversarial_rows(0.7)
    logits = rows[:, None, :].expand(-1, 4, -1)
    generator = torch.Generator().manual_seed(3)
    likely = rows.softmax(-1).multinomial(2, replacement=True, generator=generator)  # sampled, mostly in the nucleus
    unlikely = rows.isfinite().float().multinomial(2, replacement=True, generator=generator)  # anywhere finite
    targets = torch.cat([likely, unlikely], dim=1)
    bounded = truncated_log_probs(logits, targets, cuts, chunk_size=7, top_p_bounds=BOUNDS)
    full = truncated_log_probs(logits, targets, cuts, chunk_size=7, top_p_bounds=())
    assert torch.equal(bounded.kept, full.kept)
    assert torch.equal(bounded.log_kept_mass, full.log_kept_mass)
    assert torch.equal(bounded.logps, full.logps)
    for row, row_targets, got, kept in zip(rows, targets, bounded.truncated, bounded.kept, strict=True):
        expected = [reference(row, int(target), cuts) for target in row_targets]
        want = torch.tensor([e[0] for e in expected], dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
        assert kept.tolist() == [e[1] for e in expected]


def test_nucleus_rows_hold_the_sizes_they_are_built_with():
    """The adversarial rows' premise: each nucleus has the size its row was built with (brute force, float64)."""
    generator = torch.Generator().manual_seed(0)
    for size, tied in [(1, 0), (2, 0), (8, 0), (9, 0), (50, 0), (7, 2), (9, 2), (33, 2)]:
        q = nucleus_row(size, 0.7, generator, tied=tied).double().softmax(-1).sort(descending=True).values
        before = q.cumsum(0) - q
        assert int((before < 0.7).sum()) == size
        assert (q[size - 1 : size + tied] == q[size - 1]).all() and q[size + tied] < q[size - 1]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_from_hidden_states_the_bounds_change_nothing_at_any_temperature(temperature):
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 16, generator=generator) * torch.linspace(0.05, 3.0, 40)[:, None]
    weight = torch.randn(VOCAB, 16, generator=generator)
    targets = torch.randint(0, VOCAB, (40,), generator=generator)
    for cuts in BOUNDED_CUTS.values():
        common = dict(temperature=temperature, logit_scale=0.8, softcap=5.0, chunk_size=9)
        bounded = truncated_log_probs_from_hidden(hidden, weight, None, targets, cuts, top_p_bounds=BOUNDS, **common)
        full = truncated_log_probs_from_hidden(hidden, weight, None, targets, cuts, top_p_bounds=(), **common)
        for got, want in zip(bounded, full, strict=True):
            assert torch.equal(got, want)


def counting(monkeypatch, name: str) -> list[int]:
    """The rows each call of `torch.<name>` receives."""
    rows: list[int] = []
    original = getattr(torch, name)

    def counted(input, *args, **kwargs):
        rows.append(input.shape[0])
        return original(input, *args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    return rows


def test_only_the_positions_no_bound_covers_are_sorted(monkeypatch):
    """Nuclei of 1 to 8 tokens end at the first bound, 9 to 32 at the second; only larger ones (flat rows) are
    sorted over the whole vocabulary, and without bounds every position is."""
    generator = torch.Generator().manual_seed(5)
    sizes = [1, 5, 8, 9, 20, 32, 33, 50, 8, 2]
    logits = torch.stack([nucleus_row(size, 0.7, generator) for size in sizes] + [torch.zeros(VOCAB)] * 2)
    targets = torch.zeros(len(logits), dtype=torch.long)
    topk, sort = counting(monkeypatch, "topk"), counting(monkeypatch, "sort")
    truncated_log_probs(logits, targets, SamplerCuts(top_p=0.7), top_p_bounds=BOUNDS)
    assert topk == [12, 7] and sort == [4]  # 12 positions; 7 past 8 tokens; 4 past 32 (two sizes and two flat)
    topk.clear(), sort.clear()
    truncated_log_probs(logits, targets, SamplerCuts(top_p=0.7), top_p_bounds=())
    assert topk == [] and sort == [12]
    topk.clear(), sort.clear()
    truncated_log_probs(logits, targets, SamplerCuts(top_k=3))  # no top-p: nothing sorted, no bound taken
    assert topk == [] and sort == []


def test_the_rows_left_by_the_first_bound_are_copied_and_sorted_a_group_at_a_time(monkeypatch):
    """A full sort holds 24 bytes per logit: past the first bound (which reads the chunk in place), rows go through
    the next bound and the sort in groups of `SORT_ELEMENTS // V` rows, with the same result."""
    import trl_grpo_ext.extras.vllm.sampler_cuts as module

    generator = torch.Generator().manual_seed(5)
    sizes = [1, 9, 20, 33, 50, 40, 12, 2, 35, 36, 37, 3]
    logits = torch.stack([nucleus_row(size, 0.7, generator) for size in sizes])
    targets = torch.arange(len(logits))
    expected = truncated_log_probs(logits, targets, SamplerCuts(top_p=0.7), top_p_bounds=())
    monkeypatch.setattr(module, "SORT_ELEMENTS", 4 * VOCAB)
    topk, sort = counting(monkeypatch, "topk"), counting(monkeypatch, "sort")
    out = truncated_log_probs(logits, targets, SamplerCuts(top_p=0.7), top_p_bounds=BOUNDS)
    assert topk == [12, 4, 4, 1] and sort == [4, 2]  # 9 rows past 8 tokens, 6 of them past 32
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got, want)


def test_at_qwen_s_vocabulary_the_head_is_read_once_per_110_positions(monkeypatch):
    vocab = 151_936
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(vocab, 4, generator=generator)
    hidden = torch.randn(230, 4, generator=generator)
    targets = torch.randint(0, vocab, (230,), generator=generator)
    rows = []
    linear = torch.nn.functional.linear

    def counted(input, *args):
        rows.append(input.shape[0])
        return linear(input, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    truncated_log_probs_from_hidden(hidden, weight, None, targets, SamplerCuts(top_k=5))
    assert rows == [110, 110, 10]  # CHUNK_ELEMENTS // 151,936 positions per chunk
