"""The trainer's log-probs under the sampler's truncation, `log p_trunc(t) = log p(t) - log S`, in chunks (torch only).

With tempered logits `z` and `p = softmax(z)` at a position, vLLM 0.31's sampler keeps, in this order:

    min_p:  the tokens with p(t) >= min_p * max p                             (off: min_p <= 0)
    top_k:  of those, the tokens whose logit is >= the k-th largest           (ties kept; off: k <= 0)
    top_p:  of those, in decreasing order of q (p renormalised over them), each token whose predecessors' mass is
            < top_p                                                           (the first always; off: >= 1)

and `S` is `p`'s mass over the kept tokens. A sampled token outside the trainer's own cut (a boundary token on which
the engine's precision and the trainer's disagree) counts as kept: `S + p(t)`, and `kept` is False there. The top-p
cut reads the nucleus off the `K` largest `q` (`torch.topk`, `TOP_P_BOUNDS`) where their mass reaches `top_p`, and
sorts in full only the rows where no bound does: the same result as a full sort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "SORT_ELEMENTS",
    "TOP_P_BOUNDS",
    "SamplerCuts",
    "TruncatedLogProbs",
    "truncated_log_probs",
    "truncated_log_probs_from_hidden",
]

#: Logit elements per chunk: 64 MiB of float32 per `(R, V)` intermediate. The LM head is read once per chunk, so a
#: chunk must be wide enough that reading it costs no more than the passes over the chunk's logits.
CHUNK_ELEMENTS = 1 << 24
#: The widths of the top-k bounds tried, in turn, on the top-p cut before a position's row is sorted in full.
TOP_P_BOUNDS = (256, 4096)
#: Logit elements per full sort: a sort holds its values, int64 indices and cumulative sums at once (24 bytes each).
SORT_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SamplerCuts:
    """The cuts of the sampling distribution, with vLLM's meanings (`top_k <= 0`, `top_p >= 1`, `min_p <= 0`: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not 0.0 < self.top_p:
            raise ValueError(f"`top_p` must be > 0, got {self.top_p}.")
        if not self.min_p <= 1.0:
            raise ValueError(f"`min_p` must be <= 1, got {self.min_p}.")

    @property
    def truncates(self) -> bool:
        """Whether any cut is on."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class TruncatedLogProbs(NamedTuple):
    """Per position: `logps` (log p(t) over the whole vocabulary), `log_kept_mass` (log S, <= 0) and `kept` (the cut
    kept `t` itself)."""

    logps: torch.Tensor
    log_kept_mass: torch.Tensor
    kept: torch.Tensor

    @property
    def truncated(self) -> torch.Tensor:
        """log p_trunc(t) = log p(t) - log S."""
        return self.logps - self.log_kept_mass


class _Nucleus(NamedTuple):
    """The top-p cut over a prefix of `q` in decreasing order, per row: the kept mass, the least likely kept `q`, and
    whether the prefix holds the whole nucleus (its mass is already `>= top_p`)."""

    mass: torch.Tensor
    smallest: torch.Tensor
    covered: torch.Tensor


def _nucleus(ordered: torch.Tensor, top_p: float) -> _Nucleus:
    """`ordered` `(R, K)`: the `K` largest `q` of each row, in decreasing order (a whole row sorted when `K = V`)."""
    total = ordered.cumsum(dim=-1)
    # Token i is kept where its predecessors' mass, total[i - 1], is < top_p; the first always (top_p > 0).
    size = 1 + (total[:, :-1] < top_p).sum(dim=-1, keepdim=True)
    return _Nucleus(total.gather(-1, size - 1)[:, 0], ordered.gather(-1, size - 1)[:, 0], total[:, -1] >= top_p)


def _top_p_cut(q: torch.Tensor, top_p: float, bounds: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept mass and the least likely kept `q` of each row of `q` `(R, V)` under top-p: through the top-k bounds
    first, then the full sort of the rows that none covers."""
    rows, vocab = q.shape
    mass, smallest = q.new_empty(rows), q.new_empty(rows)
    group = max(1, SORT_ELEMENTS // vocab)
    pending = torch.arange(rows, device=q.device)
    for width in [width for width in bounds if width < vocab] + [vocab]:
        full = width == vocab
        if pending.numel() == rows and (not full or rows <= group):  # every row: no copy of the chunk
            parts = [(pending, q)]
        else:  # a copy of the rows left, a group at a time
            parts = ((index, q[index]) for index in pending.split(group))
        left = []
        for index, values in parts:
            if full:
                ordered = torch.sort(values, dim=-1, descending=True).values
            else:
                ordered = torch.topk(values, width, dim=-1).values
            cut = _nucleus(ordered, top_p)
            done = torch.ones_like(cut.covered) if full else cut.covered
            mass[index[done]], smallest[index[done]] = cut.mass[done], cut.smallest[done]
            left.append(index[~done])  # one host synchronisation per bound and group
        pending = torch.cat(left)
        if pending.numel() == 0:
            break
    return mass, smallest


def _kept_mass(
    z: torch.Tensor, targets: torch.Tensor, cuts: SamplerCuts, bounds: tuple[int, ...]
) -> TruncatedLogProbs:
    """One chunk: `z` `(R, V)` float32 tempered logits, `targets` `(R,)`."""
    log_total = torch.logsumexp(z, dim=-1)
    target_logit = z.gather(-1, targets[:, None])[:, 0]
    logps = target_logit - log_total
    vocab = z.shape[-1]
    if cuts.min_p > 0.0 or 0 < cuts.top_k < vocab:
        allowed = torch.ones_like(z, dtype=torch.bool)
        if cuts.min_p > 0.0:
            # p(t) / max p = exp(z_t - max z)
            allowed = torch.exp(z - z.amax(dim=-1, keepdim=True)) >= cuts.min_p
        if 0 < cuts.top_k < vocab:
            survivors = z.masked_fill(~allowed, -math.inf)
            kth = survivors.topk(cuts.top_k, dim=-1).values[:, -1:]
            allowed = allowed & (survivors >= kth)
        survivors = z.masked_fill(~allowed, -math.inf)
        log_mass = torch.logsumexp(survivors, dim=-1) - log_total  # log of p's mass after min_p and top_k
        kept = allowed.gather(-1, targets[:, None])[:, 0]
    else:  # every token survives: the mass is 1 (two passes over the logits saved)
        survivors, log_mass, kept = z, torch.zeros_like(logps), torch.ones_like(targets, dtype=torch.bool)
    if cuts.top_p < 1.0:
        q = torch.softmax(survivors, dim=-1)
        mass, smallest = _top_p_cut(q, cuts.top_p, bounds)
        log_mass = log_mass + torch.log(mass)
        kept = kept & (q.gather(-1, targets[:, None])[:, 0] >= smallest)
    # A sampled token outside the trainer's cut joins the kept set: S + p(t).
    log_mass = torch.where(kept, log_mass, torch.logaddexp(log_mass, logps))
    return TruncatedLogProbs(logps, log_mass, kept)


def _over_chunks(
    count: int, step: int, tempered_logits, targets: torch.Tensor, cuts: SamplerCuts, bounds: tuple[int, ...]
):
    """`_kept_mass` over positions `[0, count)` in chunks of `step`; `tempered_logits(start, stop)` builds a chunk."""
    parts = [
        _kept_mass(tempered_logits(start, min(start + step, count)), targets[start : start + step], cuts, bounds)
        for start in range(0, count, step)
    ]
    if not parts:
        empty = targets.new_zeros(targets.shape, dtype=torch.float32)
        return TruncatedLogProbs(empty, empty.clone(), targets.new_ones(targets.shape, dtype=torch.bool))
    return TruncatedLogProbs(*(torch.cat(field) for field in zip(*parts, strict=True)))


def truncated_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    cuts: SamplerCuts,
    *,
    chunk_size: int | None = None,
    top_p_bounds: tuple[int, ...] = TOP_P_BOUNDS,
) -> TruncatedLogProbs:
    """[`TruncatedLogProbs`] of `targets` `(...)` under `cuts`, each `(...)`, float32, from tempered logits `(..., V)`.

    Args:
        chunk_size (`int`, *optional*): positions per chunk; default `CHUNK_ELEMENTS // V`.
        top_p_bounds (`tuple[int, ...]`): the widths of the top-k bounds tried on the top-p cut before a full sort,
            increasing; `()` sorts every position (the same result).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"`targets` must have shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}.")
    flat = logits.reshape(-1, logits.shape[-1])
    step = chunk_size or max(1, CHUNK_ELEMENTS // logits.shape[-1])
    out = _over_chunks(
        flat.shape[0], step, lambda start, stop: flat[start:stop].float(), targets.reshape(-1), cuts, top_p_bounds
    )
    return TruncatedLogProbs(*(field.reshape(targets.shape) for field in out))


def truncated_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    cuts: SamplerCuts,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    top_p_bounds: tuple[int, ...] = TOP_P_BOUNDS,
) -> TruncatedLogProbs:
    """`truncated_log_probs` from final hidden states `(..., H)` and the LM head (`weight` `(V, H)`, `bias` `(V,)`),
    the logits of TRL's fused head built a chunk at a time: `z = softcap * tanh(logit_scale * (h W^T + b) / softcap) /
    temperature` (no cap without `softcap`; the matmul in the inputs' dtype, the rest in float32)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"`targets` must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}.")
    flat = hidden.reshape(-1, hidden.shape[-1])
    inverse_temperature = 1.0 / temperature

    def tempered_logits(start: int, stop: int) -> torch.Tensor:
        y = torch.nn.functional.linear(flat[start:stop], weight, bias).float() * logit_scale
        if softcap is not None:
            y = softcap * torch.tanh(y / softcap)
        return y * inverse_temperature

    step = chunk_size or max(1, CHUNK_ELEMENTS // weight.shape[0])
    out = _over_chunks(flat.shape[0], step, tempered_logits, targets.reshape(-1), cuts, top_p_bounds)
    return TruncatedLogProbs(*(field.reshape(targets.shape) for field in out))
