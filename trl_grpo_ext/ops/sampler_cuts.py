"""The trainer's log-probs under the sampler's truncation: `log p_trunc(t) = log p(t) - log S`, computed in chunks.

vLLM samples (and reports `processed_logprobs`) from the distribution left after its cuts, renormalised over the
tokens they keep. At one position, with tempered logits `z = scale(h W^T + b) / T` and `p = softmax(z)` over the
whole vocabulary, vLLM 0.31's sampler (`vllm/v1/sample/sampler.py`: temperature, then the argmax-invariant logits
processors, of which `min_p`, then `apply_top_k_top_p`) keeps:

    min_p:  the tokens with p(t) >= min_p * max_u p(u)                    (off: min_p <= 0)
    top_k:  of those, the tokens whose logit is >= the k-th largest logit  (ties at the k-th are all kept; off: k <= 0)
    top_p:  of those, with q = p renormalised over them and sorted in decreasing order, each token whose
            predecessors' mass sum_{j before i} q_j is < top_p             (the most likely is always kept; off: >= 1)

and the kept mass is `S = sum of p over the kept tokens` (in `(0, 1]`). A kept token has `p_trunc(t) = p(t) / S`;
the others `0`. Where the sampled token `t` is not kept by the trainer's own cut (the engine computed its logits at
another precision and the two disagree about a token at the boundary), it is counted as kept: `S` becomes
`S + p(t)`, so that the log-prob stays finite (`kept` says where this happened).

Ties at the top-p boundary: vLLM sorts without a tie order, so which of several equally likely tokens at the boundary
it keeps is arbitrary; their mass is not, and `S` does not depend on it. A sampled token whose probability equals
the smallest kept one counts as kept.

Nothing here imports TRL or transformers; the full `(N, V)` logits are built `chunk_size` positions at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["SamplerCuts", "TruncatedLogProbs", "truncated_log_probs", "truncated_log_probs_from_hidden"]

#: Logit elements per chunk when no `chunk_size` is given (16 MiB of float32 per intermediate tensor).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SamplerCuts:
    """The cuts of the sampling distribution, with vLLM's meanings: `top_k <= 0`, `top_p >= 1` and `min_p <= 0`
    each switch one off."""

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
    """Per position: `logps` (log p(t) over the whole vocabulary), `log_kept_mass` (log S, <= 0) and `kept` (bool:
    the cut kept `t` itself). `logps - log_kept_mass` is log p_trunc(t)."""

    logps: torch.Tensor
    log_kept_mass: torch.Tensor
    kept: torch.Tensor

    @property
    def truncated(self) -> torch.Tensor:
        """log p_trunc(t) = log p(t) - log S."""
        return self.logps - self.log_kept_mass


def _kept_mass(z: torch.Tensor, targets: torch.Tensor, cuts: SamplerCuts) -> TruncatedLogProbs:
    """One chunk: `z` `(R, V)` float32 tempered logits, `targets` `(R,)`."""
    log_total = torch.logsumexp(z, dim=-1)
    target_logit = z.gather(-1, targets[:, None])[:, 0]
    logps = target_logit - log_total
    vocab = z.shape[-1]
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
    if cuts.top_p < 1.0:
        q = torch.softmax(survivors, dim=-1)
        ordered = q.sort(dim=-1, descending=True).values
        before = ordered.cumsum(dim=-1) - ordered  # the mass of each token's predecessors
        keep = before < cuts.top_p
        keep[:, 0] = True
        log_mass = log_mass + torch.log((ordered * keep).sum(dim=-1))
        smallest_kept = ordered.gather(-1, (keep.sum(dim=-1, keepdim=True) - 1))[:, 0]
        kept = kept & (q.gather(-1, targets[:, None])[:, 0] >= smallest_kept)
    # A sampled token outside the trainer's cut joins the kept set: S + p(t).
    log_mass = torch.where(kept, log_mass, torch.logaddexp(log_mass, logps))
    return TruncatedLogProbs(logps, log_mass, kept)


def _over_chunks(count: int, step: int, tempered_logits, targets: torch.Tensor, cuts: SamplerCuts):
    """`_kept_mass` over positions `[0, count)` in chunks of `step`; `tempered_logits(start, stop)` builds a chunk."""
    parts = [
        _kept_mass(tempered_logits(start, min(start + step, count)), targets[start : start + step], cuts)
        for start in range(0, count, step)
    ]
    if not parts:
        empty = targets.new_zeros(targets.shape, dtype=torch.float32)
        return TruncatedLogProbs(empty, empty.clone(), targets.new_ones(targets.shape, dtype=torch.bool))
    return TruncatedLogProbs(*(torch.cat(field) for field in zip(*parts, strict=True)))


def truncated_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, cuts: SamplerCuts, *, chunk_size: int | None = None
) -> TruncatedLogProbs:
    """log p(t), log S and whether the cut kept `t`, from full tempered logits (see the module docstring).

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): the logits after temperature (and any scaling), any float dtype
            (computed in float32).
        targets (`torch.Tensor` of shape `(...)`): the token ids whose log-probs are wanted (the sampled ones).
        cuts (`SamplerCuts`): the sampler's cuts.
        chunk_size (`int`, *optional*): positions per chunk; default `CHUNK_ELEMENTS // V` (at least 1).

    Returns:
        [`TruncatedLogProbs`], each of shape `(...)`, float32 (`kept` bool).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"`targets` must have shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}.")
    flat = logits.reshape(-1, logits.shape[-1])
    step = chunk_size or max(1, CHUNK_ELEMENTS // logits.shape[-1])
    out = _over_chunks(flat.shape[0], step, lambda start, stop: flat[start:stop].float(), targets.reshape(-1), cuts)
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
) -> TruncatedLogProbs:
    """`truncated_log_probs` from hidden states and the LM head, without building the `(N, V)` logits at once.

    Per chunk of positions, the logits of TRL's fused LM head: `y = logit_scale * (h W^T + b)` (the matmul in the
    dtype of `hidden` and `weight`, the rest in float32), `y = softcap * tanh(y / softcap)` when `softcap` is set, and
    `z = y * (1 / temperature)`.

    Args:
        hidden (`torch.Tensor` of shape `(..., H)`): final hidden states at the positions that predict `targets`.
        weight (`torch.Tensor` of shape `(V, H)`), bias (`(V,)` or `None`): the LM head.
        targets (`torch.Tensor` of shape `(...)`): the predicted token ids.
        cuts, chunk_size: see `truncated_log_probs`.
        temperature, logit_scale, softcap: the logit transform.

    Returns:
        [`TruncatedLogProbs`], each of shape `(...)`.
    """
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
    out = _over_chunks(flat.shape[0], step, tempered_logits, targets.reshape(-1), cuts)
    return TruncatedLogProbs(*(field.reshape(targets.shape) for field in out))
