"""How a packed row's attention keeps its sequences apart, per attention implementation (`attention_kind`):

- `VARLEN` (flash-attention 2/3/4, hub kernels; sdpa on a CUDA device in half precision, through PyTorch's varlen
  flash kernel): explicit sequence boundaries over the flattened `(B * L)` tokens (transformers infers them from
  `position_ids` only for one row); a completion of a shared prompt is a query segment whose keys are the prompt's and
  its own, gathered per branch, aligned bottom-right. No mask.
- `FLEX`: a block mask (`PackedLayout.block_mask`).
- `DENSE` (sdpa, eager): transformers' packed-sequence mask from `position_ids`, or a 4-D mask for shared prompts.
- `None` (unknown): `position_ids` only, no sharing; the self-check decides.

The varlen route is a function registered under the model's own implementation name that wraps the registered one
(`install_packed_attention`); it changes nothing for a call without the `packed_attention` keyword, which only the
packed forward passes, and which transformers hands to every attention layer (again when gradient checkpointing
recomputes one).
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
    "sliding_window_layers",
    "torch_varlen",
    "torch_varlen_attention",
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


def torch_varlen():
    """PyTorch's varlen flash-attention kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA), `None` where this
    torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def torch_varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    """sdpa's attention of a packed forward through `torch_varlen()` (module docstring): `query` `(B, H, L, D)`,
    `key`, `value` `(B, Hkv, Lk, D)` (`Lk` the gathered keys' count, `B = 1`, where prompts are shared) ->
    `((B, L, H, D), None)`, as transformers' attention functions return."""
    segments: PackedAttention = kwargs[KEYWORD]
    if softcap is not None or (module.training and dropout):
        raise ValueError("the packed sdpa route has no attention soft cap or dropout (shared_fallback_reason)")
    batch, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k, v = (x.transpose(1, 2).reshape(-1, x.size(1), x.size(-1)) for x in (key, value))
    options = _torch_varlen_options(heads, k.size(1), sliding_window)
    if options.pop("repeat", 1) > 1:
        k, v = (x.repeat_interleave(heads // x.size(1), dim=1) for x in (k, v))
    out = torch_varlen()(
        q,
        k,
        v,
        segments.cu_seqlens_q,
        segments.cu_seqlens_k,
        segments.max_length_q,
        segments.max_length_k,
        scale=scaling,
        **options,
    )
    return out.view(batch, length, heads, -1), None


def _torch_varlen_options(heads: int, kv_heads: int, sliding_window: int | None) -> dict:
    """The causal window and grouped heads as this torch's `varlen_attn` takes them (its keywords changed)."""
    import inspect

    parameters = inspect.signature(torch_varlen()).parameters
    options = {}
    if "window_size" in parameters:
        options["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)  # causal: no key after the query
    else:
        if sliding_window:
            raise ValueError("this torch's varlen_attn has no sliding window")
        options["is_causal"] = True
    if heads != kv_heads:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            options["repeat"] = heads // kv_heads
    return options


def _registered(implementation: str | None):
    """The attention function registered for `implementation`, looked through this module's wrapper."""
    function = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation else None
    return getattr(function, "__wrapped__", function)


def attention_kind(config, device_type: str | None = None, dtype: torch.dtype | None = None) -> str | None:
    """`VARLEN`, `FLEX`, `DENSE` or `None` (module docstring) for a model with this `config`, computing in `dtype` on
    a device of `device_type`."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == "sdpa" and device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        plain = getattr(config, "attn_logit_softcapping", None) is None and not sliding_window_layers(config)
        if torch_varlen() is not None and plain:
            return VARLEN
    if implementation in ("sdpa", "eager"):
        return DENSE
    if implementation == "flex_attention":
        return FLEX
    if _registered(implementation) is flash_attention_forward:
        return VARLEN
    return None


def sliding_window_layers(config) -> bool:
    """Whether the model has sliding-window (or other not full) attention layers."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(kind != "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is not None


def install_packed_attention(implementation: str) -> None:
    """Register `packed_attention` around the attention function of `implementation` (a varlen one, or sdpa), once."""
    original = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if getattr(original, "__wrapped__", None) is not None:
        return

    def packed_attention(module, query, key, value, attention_mask, *args, packed_attention=None, **kwargs):
        if packed_attention is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if packed_attention.key_index is not None:
            key, value = packed_attention.gather(key), packed_attention.gather(value)
        if implementation == "sdpa":
            return torch_varlen_attention(
                module, query, key, value, None, *args, packed_attention=packed_attention, **kwargs
            )
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
