"""A GPU's attention on a CPU: transformers' flash-attention code path with its kernels replaced by exact stand-ins.

`flash_attention_emulation()` makes transformers' `flash_attention_forward` (what `attn_implementation=
"flash_attention_2"`, `"flash_attention_3"` and hub kernels run) call `varlen_attention` and `dense_attention`
instead of the `flash_attn` package's `flash_attn_varlen_func` and `flash_attn_func`, and `use_flash_attention(model)`
sets a model's attention implementation to it without the package's availability checks. Everything transformers
does around the kernels (unpadding TRL's padded rows, the varlen keywords, inferring packed sequences from
`position_ids` for a batch of one row and only then) runs as it runs on a GPU. The stand-ins compute each sequence's
attention with `torch.nn.functional.scaled_dot_product_attention`, causal bottom-right aligned as flash-attention 2.1
and newer align it when a sequence has fewer queries than keys: exact, one sequence at a time.

Used by the tests (`tests/test_forward_attention.py`) and `python -m benchmarks forward --attention flash-emulated`.

`torch_flash_attention()` does the same with real kernels on a CUDA device without the `flash_attn` package: torch's
own flash-attention 2 kernel, through `torch.nn.attention.varlen.varlen_attn` (`torch_varlen_available`), for both
contracts (a dense batch is one varlen call over equal segments). `python -m benchmarks gpu` times and checks
transformers' flash-attention path with it where `flash_attn` is missing, and says so.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch

__all__ = [
    "dense_attention",
    "flash_attention_emulation",
    "torch_varlen_attn",
    "torch_dense_attention",
    "torch_flash_attention",
    "torch_varlen_attention",
    "torch_varlen_available",
    "use_flash_attention",
    "varlen_attention",
]


def _attend(q, k, v, softmax_scale, causal, window_size, softcap):
    """One sequence: `q` `(Lq, H, D)`, `k`, `v` `(Lk, Hkv, D)` -> `(Lq, H, D)`."""
    lq, lk = q.size(0), k.size(0)
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    heads, kv_heads = q.size(1), k.size(1)
    k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    query = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right: the last query sees every key
    key = torch.arange(lk, device=q.device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= key <= query
    left, right = window_size if window_size is not None else (-1, -1)
    if left >= 0:
        allowed &= key >= query - left
    if right >= 0 and not causal:
        allowed &= key <= query + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key: 0, as the kernels give
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    """`flash_attn_varlen_func`'s contract: `q` `(total_q, H, D)`, `k`, `v` `(total_k, Hkv, D)`, sequence `i` the
    rows `cu_seqlens[i]:cu_seqlens[i + 1]` of each."""
    if dropout_p:
        raise ValueError("the flash-attention stand-in has no dropout")
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for a, b, c, d in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        if b > a:
            out[a:b] = _attend(q[a:b], k[c:d], v[c:d], softmax_scale, causal, window_size, softcap)
    return out


def dense_attention(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
):
    """`flash_attn_func`'s contract: `q` `(B, L, H, D)`, `k`, `v` `(B, L, Hkv, D)`, every row one sequence."""
    if dropout_p:
        raise ValueError("the flash-attention stand-in has no dropout")
    rows = [_attend(q[i], k[i], v[i], softmax_scale, causal, window_size, softcap) for i in range(q.size(0))]
    return torch.stack(rows)


def torch_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """`torch.nn.attention.varlen.varlen_attn`'s contract (a CUDA kernel) on the CPU: `window_size` `(-1, 0)` is
    causal, bottom-right aligned."""
    if key.size(1) != query.size(1) and not enable_gqa:
        raise ValueError("grouped heads need enable_gqa=True")
    causal = window_size[1] == 0
    return varlen_attention(
        query, key, value, cu_seq_q, cu_seq_k, softmax_scale=scale, causal=causal, window_size=(window_size[0], -1)
    )


def torch_varlen_available() -> bool:
    """Whether torch has its own varlen flash-attention entry point (`torch.nn.attention.varlen.varlen_attn`) and a
    CUDA device to run it on."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    """`flash_attn_varlen_func`'s contract on torch's own flash kernel (`varlen_attn`; its keywords moved between
    torch releases: a causal flag or a window, grouped-query heads natively or not, so they are read from its
    signature). Causal attention with fewer queries than keys is bottom-right aligned as flash-attention 2.1 and newer
    align it, torch's kernel among them (`python -m benchmarks gpu`'s exactness section checks it with shared prompts).
    """
    from torch.nn.attention.varlen import varlen_attn

    if dropout_p:
        raise ValueError("torch's varlen attention has no dropout")
    if softcap:
        raise ValueError("torch's varlen attention has no soft cap")
    parameters = inspect.signature(varlen_attn).parameters
    left, right = window_size if window_size is not None else (-1, -1)
    keywords = {}
    if "scale" in parameters:
        keywords["scale"] = softmax_scale
    elif softmax_scale is not None and not math.isclose(softmax_scale, q.size(-1) ** -0.5):
        raise ValueError("this torch's varlen attention takes no scale")
    if "window_size" in parameters:
        keywords["window_size"] = (left, 0 if causal else right)
    elif left >= 0 or right >= 0:
        raise ValueError("this torch's varlen attention has no sliding window")
    else:
        keywords["is_causal"] = causal
    if q.size(1) != k.size(1):
        if "enable_gqa" in parameters:
            keywords["enable_gqa"] = True
        else:  # the same arithmetic with the key and value heads repeated
            k, v = (x.repeat_interleave(q.size(1) // k.size(1), dim=1) for x in (k, v))
    return varlen_attn(
        q,
        k,
        v,
        cu_seqlens_q.to(torch.int32),
        cu_seqlens_k.to(torch.int32),
        int(max_seqlen_q),
        int(max_seqlen_k),
        **keywords,
    )


def torch_dense_attention(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
):
    """`flash_attn_func`'s contract on torch's varlen kernel: the batch's rows as equal segments."""
    batch, length_q, length_k = q.size(0), q.size(1), k.size(1)

    def bounds(length: int) -> torch.Tensor:
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)

    out = torch_varlen_attention(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        bounds(length_q),
        bounds(length_k),
        length_q,
        length_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        deterministic,
    )
    return out.view(batch, length_q, *out.shape[-2:])


@contextlib.contextmanager
def _flash_kernels(dense, varlen):
    """Within the context, transformers' flash-attention path calls `dense` and `varlen` as its kernels."""
    import transformers.modeling_flash_attention_utils as flash

    imports = flash._lazy_imports

    def stand_ins(implementation, attention_wrapper=None, allow_all_kernels=False):
        return dense, varlen, None, flash._pad_input, flash._unpad_input

    flash._lazy_imports, flash._loaded_implementation = stand_ins, None
    try:
        yield
    finally:
        flash._lazy_imports, flash._loaded_implementation = imports, None


def flash_attention_emulation():
    """Within the context, transformers' flash-attention path runs the exact stand-ins (module docstring)."""
    return _flash_kernels(dense_attention, varlen_attention)


def torch_flash_attention():
    """Within the context, transformers' flash-attention path runs torch's own flash kernel (module docstring)."""
    return _flash_kernels(torch_dense_attention, torch_varlen_attention)


def use_flash_attention(*models, implementation: str = "flash_attention_2") -> None:
    """Set each model's attention implementation to `implementation` (under `flash_attention_emulation`)."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = implementation
