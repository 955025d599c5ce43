"""Section `attention` of `python -m benchmarks gpu`: which attention kernel each forward runs, and what a dense mask
costs against a matrix product.

1. Kernels: one forward without gradient of each side (TRL's padded rows, packed, shared prompts) under sdpa and
   flash-attention 2, on the `exactness` batch, under `torch.profiler`: the device kernels (on a CPU, the operators)
   whose names say attention, classed as `flash`, `memory-efficient` (cutlass fmha), `cudnn` or `math` (no attention
   kernel: matrix products and a softmax), with the most time-consuming kernels of the forward.
2. Throughput, per row length `L` (`ForwardSizes.attention_lengths`), at the check model's head count and size, one
   row: sdpa with a dense `(1, 1, L, L)` bool mask (block-diagonal causal, four sequences: what a packed row with
   shared prompts passes), sdpa with `is_causal` and no mask (the flash kernel), and a matrix product of the masked
   attention's FLOPs (`(L, 2 h d) @ (2 h d, L)`: `4 L^2 h d`, the whole `L x L` that a masked kernel computes), forward
   and forward + backward, timed with CUDA events. `masked / GEMM` is the masked kernel's share of matrix-product
   throughput.
3. The decision it makes: `layout.place_units` prices a row's attention as if it ran at matrix-product throughput
   (`logprobs.attention_weight`: attention costs a token `w L` of its linear layers' cost in a row of `L`). At the
   measured share `r`, a token of the speed batch's padded width `W` pays `a = w W / r` for attention under a dense
   mask. Rows twice as long would at best remove every row's tail, the share `t` of the dense packed layout's tokens
   that fill rows (measured on the speed batch); they cost `1 + 2a` a token instead of `1 + a`, so they can pay only
   where `a < t / (1 - 2t)`. Else dense rows stay at the padded width (the default).
"""

from __future__ import annotations

import re
import statistics
import time
from typing import TYPE_CHECKING

import torch

from .gpu_packing import FLASH, bench, forward_sizes

if TYPE_CHECKING:
    from .gpu_setup import Context

__all__ = ["classify_kernels", "longer_rows_may_pay", "section_attention"]

SIDES = ("trl", "packed", "shared")
_ATTENTION_NAME = re.compile(r"attention|attn|sdpa|fmha|flash|softmax", re.IGNORECASE)


def classify_kernels(names: list[str]) -> list[str]:
    """The attention kernel classes among kernel (or operator) names: `cudnn`, `flash`, `memory-efficient`, or
    `math` where only a softmax says attention."""
    classes = set()
    for name in names:
        lower = name.lower()
        if "cudnn" in lower and ("attention" in lower or "sdpa" in lower or "fmha" in lower or "flash" in lower):
            classes.add("cudnn")
        elif "flash" in lower:
            classes.add("flash")
        elif "fmha" in lower or "efficient_attention" in lower or "mem_eff" in lower:
            classes.add("memory-efficient")
        elif "_attention_math" in lower:
            classes.add("math")
    if not classes and any("softmax" in name.lower() for name in names):
        classes.add("math")
    return sorted(classes)


def longer_rows_may_pay(attention_share: float, tail_share: float) -> bool:
    """Whether dense-mask rows twice the padded width can cost less than rows of the padded width (module docstring):
    at best they remove the tails (`tail_share` `t` of the tokens), and they double attention's share `a` of a
    token's cost: `(1 + 2a)(1 - t) < 1 + a`, i.e. `a (1 - 2t) < t`."""
    return attention_share * (1 - 2 * tail_share) < tail_share


def _profile(run, cuda: bool) -> dict:
    """The attention kernels (operators on a CPU) of `run()` and the forward's top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        run()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in profiler.key_averages():
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        if cuda != on_device:
            continue
        total = getattr(event, "self_device_time_total", None) if cuda else event.self_cpu_time_total
        if total is None:
            total = getattr(event, "self_cuda_time_total", 0.0)
        kernels[event.key] = kernels.get(event.key, 0.0) + float(total)
    attention = sorted(name for name in kernels if _ATTENTION_NAME.search(name))
    top = sorted(kernels.items(), key=lambda item: -item[1])[:6]
    return {
        "classes": classify_kernels(attention),
        "attention_kernels": [name[:160] for name in attention],
        "top": [[name[:160], us / 1e3] for name, us in top],
    }


def _timed(function, cuda: bool, repeats: int) -> float:
    """Median seconds of `function()` after one warm-up (CUDA events on a GPU)."""
    function()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            function()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _throughput(length: int, heads: int, head_dim: int, device, dtype, repeats: int) -> dict:
    """Masked sdpa, causal sdpa without a mask, and a matrix product of the masked one's FLOPs, at one row length."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    cuda = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator).requires_grad_(True)

    q, k, v = (tensor(1, heads, length, head_dim) for _ in range(3))
    segment = torch.arange(length, device=device) * 4 // length
    mask = (torch.ones(length, length, dtype=torch.bool, device=device).tril() & (segment[:, None] == segment))[
        None, None
    ]
    a, b = tensor(length, 2 * heads * head_dim), tensor(2 * heads * head_dim, length)
    cases = {
        "masked": lambda: sdpa(q, k, v, attn_mask=mask),
        "causal_no_mask": lambda: sdpa(q, k, v, is_causal=True),
        "gemm": lambda: a @ b,
    }
    flops = {"masked": 4 * length**2 * heads * head_dim, "gemm": 4 * length**2 * heads * head_dim}
    flops["causal_no_mask"] = flops["masked"] // 2  # the flash kernel skips the blocks above the diagonal
    out = {"length": length, "heads": heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch.")}
    for name, function in cases.items():

        def forward_backward(function=function):
            function().sum().backward()

        with torch.no_grad():
            forward = _timed(function, cuda, repeats)
        both = _timed(forward_backward, cuda, repeats)
        out[name] = {
            "forward_s": forward,
            "forward_backward_s": both,
            "forward_tflops": flops[name] / forward / 1e12,
            "forward_backward_tflops": 3 * flops[name] / both / 1e12,  # backward counted as twice the forward
        }
    for phase in ("forward", "forward_backward"):
        out[f"masked_over_gemm_{phase}"] = out["masked"][f"{phase}_tflops"] / out["gemm"][f"{phase}_tflops"]
        out[f"masked_time_over_causal_{phase}"] = out["masked"][f"{phase}_s"] / out["causal_no_mask"][f"{phase}_s"]
    return out


def section_attention(ctx: Context, allotted: float, result: dict) -> dict:
    """Kernels per side, masked-attention throughput and the dense rows' decision (module docstring)."""
    from trl_grpo_ext.forward.logprobs import attention_weight, linear_parameters

    b = bench(ctx)
    sizes = forward_sizes(ctx)
    begin = time.monotonic()
    result.update({"kernels": {}, "throughput": [], "checks": {}, "targets": {}, "skipped": {}, "errors": {}})
    if not b.flash["kernels"]:
        result["skipped"][FLASH] = b.flash["reason"]
    ids, mask, width = b.batch(sizes.exactness, seed=1)
    for attention in b.attentions():
        for side in SIDES:
            label = f"{side}/{attention}"
            with b.attention(attention), b.precision(True), torch.no_grad():
                result["kernels"][label] = _profile(lambda side=side: b.logps(side, ids, mask, width), ctx.cuda)
            result["kernels"][label]["kernels"] = b.kernels(attention)
            ctx.log(f"attention: {label}: {', '.join(result['kernels'][label]['classes']) or 'no attention kernel'}")
    ctx.save()

    config = b.model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = torch.bfloat16 if b.autocasts and ctx.cuda else torch.float32
    for length in sizes.attention_lengths:
        if result["throughput"] and time.monotonic() - begin > allotted * 0.8:
            result["skipped"][f"throughput L={length}"] = "time budget"
            continue
        case = _throughput(length, heads, head_dim, b.device, dtype, repeats=5 if ctx.cuda else 2)
        result["throughput"].append(case)
        ctx.log(
            f"attention: L={length}: masked sdpa at {case['masked_over_gemm_forward_backward']:.2f} of GEMM "
            f"throughput (forward + backward), {case['masked_time_over_causal_forward_backward']:.2f}x the causal "
            "kernel's time"
        )
        ctx.save()

    # The decision: the package's price of attention against the measured one, at the speed batch's padded width.
    speed_ids, speed_mask, speed_width = b.batch(sizes.speed, seed=2)
    layout = b.layout("packed", speed_ids, speed_mask, speed_width)  # sdpa: the dense rows' default budget
    tokens, real = layout.input_ids.numel(), int(speed_mask.sum())
    tail = (tokens - real) / tokens
    weight = attention_weight(config, linear_parameters(b.model))
    padded_width = speed_ids.size(1)
    longest = max(result["throughput"], key=lambda case: case["length"])
    share = longest["masked_over_gemm_forward_backward"]
    measured = weight * padded_width / share
    pays = longer_rows_may_pay(measured, tail)
    result["decision"] = {
        "padded_width": padded_width,
        "attention_weight": weight,
        "attention_share_at_gemm_throughput": weight * padded_width,
        "masked_over_gemm": share,
        "masked_over_gemm_at_length": longest["length"],
        "attention_share_measured": measured,
        "dense_layout_tail_share": tail,
        "dense_packed_rows": list(layout.input_ids.shape),
        "longer_dense_rows_may_pay": pays,
        "verdict": "a dense row longer than the padded width may pay"
        if pays
        else "dense rows stay at the padded width",
    }
    ctx.log(f"attention: {result['decision']['verdict']} (a = {measured:.3g}, tail {tail:.3g})")
    return result
