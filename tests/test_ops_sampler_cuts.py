"""`ops.sampler_cuts`: the trainer's log-probs under vLLM's cuts against a brute-force reference (full softmax, the
kept set built token by token), for top_k, top_p, min_p, their combinations, temperature, the logit transform and
ties."""

import math

import pytest
import torch

from trl_grpo_ext.ops.sampler_cuts import SamplerCuts, truncated_log_probs, truncated_log_probs_from_hidden


def reference(logits: torch.Tensor, target: int, cuts: SamplerCuts) -> tuple[float, bool]:
    """log p_trunc(target) for one position, in float64, and whether the cut kept the target.

    The kept set as vLLM 0.31 builds it, written out: min_p on the probabilities, then the k largest logits with every
    tie of the k-th, then top-p over the survivors renormalised, in decreasing order, keeping a token while the mass
    before it is below top_p; a token as likely as the least likely kept one counts as kept."""
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
        keep = [keep[i] and (i in kept_top_p or math.isclose(q[i], smallest, rel_tol=1e-9)) for i in range(vocab)]
    was_kept = keep[target]
    keep[target] = True  # a sampled token outside the cut joins the kept set
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
