"""How a packed row's attention keeps its sequences apart, for each attention implementation.

A packed row holds several sequences (and, with shared prompts, a prompt followed by several completions that each
continue it). Each token must attend exactly to what it attends to in TRL's padded row: the earlier tokens of its own
sequence, and for a completion of a shared prompt, the prompt and its own earlier tokens. How that is told to the
model depends on its attention implementation (`attention_kind`):

- `VARLEN` (flash-attention 2, 3, 4 and hub kernels, which transformers runs through `flash_attention_forward`):
  the sequence boundaries are given explicitly, as transformers' varlen keywords (`cu_seq_lens_q`, `cu_seq_lens_k`,
  `max_length_q`, `max_length_k`) over the flattened `(B * L)` tokens, so that any number of packed rows is exact
  (transformers infers them from `position_ids` only for a batch of one row). A completion of a shared prompt is a
  query segment of its own whose keys are the prompt's and its own, gathered once per branch (`PackedAttention`):
  fewer queries than keys, which flash-attention aligns bottom-right (the last query sees every key). No mask.
- `FLEX` (flex attention): a block mask built from each token's unit and branch (`PackedLayout.block_mask`).
- `DENSE` (sdpa, eager): transformers' packed-sequence mask, which it derives from `position_ids`, or, for shared
  prompts, a 4-D boolean mask `(B, 1, L, L)` (`PackedLayout.attention`); its attention costs the square of a row's
  length, hence rows no longer than TRL's padded ones by default (`logprobs.default_row_tokens`).
- `None` (an implementation this module does not know): `position_ids` only, no sharing; the self-check decides.

The varlen route goes through transformers' attention interface: `install_packed_attention` registers, under the
model's own implementation name, a function that wraps the registered one (`packed_attention`). It changes nothing
for a call without the `packed_attention` keyword, which only `PackedLogProbs` passes, through the model's forward
keywords, as transformers passes its own varlen keywords down to every attention layer (and again when gradient
checkpointing recomputes a layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

__all__ = [
    "DENSE",
    "FLEX",
    "VARLEN",
    "PackedAttention",
    "attention_kind",
    "install_packed_attention",
    "length_dependent_rope",
]

VARLEN = "varlen"
FLEX = "flex"
DENSE = "dense"

#: The keyword of the model's forward that carries a packed forward's `PackedAttention` to the attention layers.
KEYWORD = "packed_attention"


@dataclass(frozen=True)
class PackedAttention:
    """The attention segments of a packed forward, in the flattened order of its `(B * L)` tokens, as varlen kernels
    take them: each query segment (a packed sequence, a shared prompt, a completion continuing it, a row's tail)
    attends causally, bottom-right aligned, to its key segment.

    Attributes:
        cu_seqlens_q (`torch.Tensor` of shape `(S + 1,)`, int32): where each query segment starts; the last entry is
            `B * L`.
        cu_seqlens_k (`torch.Tensor` of shape `(S + 1,)`, int32): the same for the key segments, in the keys that
            `key_index` gathers (the queries' own tokens where it is `None`).
        max_length_q (`int`), max_length_k (`int`): the longest query and key segment.
        key_index (`torch.Tensor` of shape `(K,)`, *optional*): the flattened token of each key, segment after
            segment: a shared prompt's tokens, then the completion's own, for each completion.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    key_index: torch.Tensor | None = None

    def varlen_keywords(self) -> dict:
        """The keywords of transformers' `_flash_attention_forward` that give it these boundaries."""
        return {
            "cu_seq_lens_q": self.cu_seqlens_q,
            "cu_seq_lens_k": self.cu_seqlens_k,
            "max_length_q": self.max_length_q,
            "max_length_k": self.max_length_k,
        }

    def gather(self, states: torch.Tensor) -> torch.Tensor:
        """Keys or values `(B, H, L, D)`, as the attention layers pass them, gathered into `(1, H, K, D)`."""
        batch, heads, length, dim = states.shape
        flat = states.transpose(1, 2).reshape(batch * length, heads, dim)
        return flat.index_select(0, self.key_index).unsqueeze(0).transpose(1, 2)


def _registered(implementation: str | None):
    """The attention function registered for `implementation`, looked through this module's wrapper."""
    function = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation else None
    return getattr(function, "__wrapped__", function)


def attention_kind(config) -> str | None:
    """`VARLEN`, `FLEX`, `DENSE` or `None` (module docstring) for a model with this `config`."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation in ("sdpa", "eager"):
        return DENSE
    if implementation == "flex_attention":
        return FLEX
    if _registered(implementation) is flash_attention_forward:
        return VARLEN
    return None


def install_packed_attention(implementation: str) -> None:
    """Register `packed_attention` around the attention function of `implementation` (a varlen one), once."""
    original = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if getattr(original, "__wrapped__", None) is not None:
        return

    def packed_attention(module, query, key, value, attention_mask, *args, packed_attention=None, **kwargs):
        if packed_attention is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if packed_attention.key_index is not None:
            key, value = packed_attention.gather(key), packed_attention.gather(value)
        # The boundaries are the segments': no padding mask, and transformers' own inference from position_ids
        # (which it makes only for one row) is not needed.
        kwargs.update(packed_attention.varlen_keywords())
        return original(module, query, key, value, None, *args, **kwargs)

    packed_attention.__wrapped__ = original
    AttentionInterface.register(implementation, packed_attention)


def _rope_types(config) -> set[str]:
    types = set()
    for name in ("rope_parameters", "rope_scaling"):
        parameters = getattr(config, name, None)
        if not isinstance(parameters, dict):
            continue
        nested = [value for value in parameters.values() if isinstance(value, dict)]
        for entry in nested or [parameters]:
            kind = entry.get("rope_type", entry.get("type"))
            if isinstance(kind, str):
                types.add(kind)
    return types


def length_dependent_rope(config) -> bool:
    """Whether the model's rotary embeddings depend on the forward's largest position, not on positions alone
    (transformers' `dynamic_rope_update`: "longrope", as Phi-3 and Phi-4-mini, and the "dynamic" types): the padded
    forward's largest position is its width minus one, which the packed layout then includes (`pack_rows`'s
    `anchor_position`)."""
    return any(kind == "longrope" or "dynamic" in kind for kind in _rope_types(config))
