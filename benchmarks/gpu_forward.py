"""Section `forward` of `python -m benchmarks gpu`: TRL's padded log-prob forward against the padding-free ones.

`forward.py`'s micro-batch (prompts of 100-400 tokens, `G = 8` long-tailed completions, one per group cut at 1,024
tokens) on the device in bfloat16, once per attention implementation: `sdpa`, and `flash_attention_2` where the
`flash_attn` package is installed (transformers' varlen kernels read the packed `position_ids`). Per implementation:
the step time of the reference forward plus the policy forward and backward, the activation memory saved for the
backward, the peak allocated memory, and the self-check's difference. The targets are the default's
(`shared_prompt_forward=True`, which flash-attention runs packed without sharing). Without a CUDA device it runs
`forward.py`'s quick shapes with `sdpa` only.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .gpu_setup import Context

__all__ = ["attention_implementations", "section_forward"]

# The goals for the default forward against TRL's (reported, not enforced).
TIME_GOAL, MEMORY_GOAL = 0.5, 0.6


def attention_implementations(cuda: bool) -> tuple[str, ...]:
    """The attention implementations the section times: `sdpa`, and flash-attention 2 on a GPU that has it."""
    if cuda and importlib.util.find_spec("flash_attn") is not None:
        return ("sdpa", "flash_attention_2")
    return ("sdpa",)


def section_forward(ctx: Context, allotted: float, result: dict) -> dict:
    """Both forwards per attention implementation (module docstring); fills `result` as it goes."""
    from . import forward

    implementations = attention_implementations(ctx.cuda)
    quick = not ctx.cuda or ctx.sizes.label.startswith("quick")
    groups = 4 if not quick else 2
    result.update(
        {
            "config": {"groups": groups, "generations": 8, "quick": quick, "implementations": list(implementations)},
            "runs": {},
            "errors": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    if ctx.cuda and "flash_attention_2" not in implementations:
        result["skipped"]["flash_attention_2"] = "the flash_attn package is not installed"
    begin = time.monotonic()
    for attention in implementations:
        spent = time.monotonic() - begin
        if result["runs"] and spent + spent / len(result["runs"]) > allotted:
            result["skipped"][attention] = f"time budget: {allotted - spent:.0f} s left of {allotted:.0f} s"
            continue
        ctx.log(f"forward: {attention}")
        try:
            run = forward.run(steps=3, groups=groups, quick=quick, device=ctx.device, attn_implementation=attention)
        except Exception:  # noqa: BLE001 - recorded; the other implementation still runs
            result["errors"][attention] = traceback.format_exc()
            result["checks"][f"{attention}_ran"] = False
            continue
        result["runs"][attention] = run
        trl, ext = run["sides"]["trl"], run["sides"]["shared"]  # GRPOTrainerExt's default
        result["checks"][f"{attention}_self_check_passed"] = run["self_check"]["passed"]
        result["checks"][f"{attention}_fewer_tokens"] = ext["tokens_per_distinct"] < trl["tokens_per_distinct"]
        ratios = {
            "step_time": (ext["step_seconds"] / trl["step_seconds"], TIME_GOAL),
            "activation_memory": (ext["activation_bytes"] / trl["activation_bytes"], MEMORY_GOAL),
        }
        if trl["peak_bytes"]:
            ratios["peak_memory"] = (ext["peak_bytes"] / trl["peak_bytes"], MEMORY_GOAL)
        for name, (value, limit) in ratios.items():
            result["targets"][f"{attention}_{name}_ext_over_trl"] = {
                "value": value,
                "limit": limit,
                "met": value <= limit,
            }
        ctx.log(f"forward: {attention}: " + ", ".join(f"{name} {value:.3f}" for name, (value, _) in ratios.items()))
        ctx.save()
    result["table"] = "\n\n".join(f"{name}:\n\n{forward.table(run)}" for name, run in result["runs"].items())
    return result
