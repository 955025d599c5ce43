"""Sections `memory`, `speed`, `host` and `truncation` of `python -m benchmarks gpu`: what the log-prob forward costs.

All four run on `gpu_packing.Bench` (the default setup: float32 weights, bf16 autocast), on the `speed` batch: 2 x 8
completions of log-normal length up to 8,192 tokens on the Qwen2.5-1.5B-shaped model (quick: tiny). A step is what
the policy's log-prob forward costs in training: TRL's hook with entropies, then the backward of the summed
completion log-probs. The sides (`SIDES`): TRL's padded forward, the packed one and the one with shared prompts,
each under sdpa and flash-attention 2 (`gpu_packing.flash_kernels` says which kernels; without them the flash rows
are skipped with the reason).

- `memory`: each side's peak allocated memory in a step (and above what was allocated before it), gradient
  checkpointing on and off; a side that runs out of memory is a result ("out of memory"), not an error. Then the
  step-1 self-check alone on the speed batch (`PackedLogProbs._run_self_check`): its peak above what was allocated.
  On a CPU: the bytes autograd saves for the backward (deterministic), no peak.
- `speed`: each side's step time, gradient checkpointing on (TRL's default, and what 8K completions need), median
  of `ForwardSizes.timed_steps` after a warm-up (the memory section's step counts as one), CUDA events; the ratios
  to TRL's padded sdpa forward; the tokens each forwards. Targets (reported): the default (`shared/sdpa`) and
  `packed/flash_attention_2` at most TRL's time with the same attention.
- `host`: for each side, a forward without gradient stopped at the model's first module: the host time from the
  hook's entry to the model's first kernel (the layout built on the host and the device), and on a GPU the device
  time between them with the device kept busy before the call, as training keeps it (what the device idles while
  the host builds the layout: the one host synchronisation per chunk waits for the queue to drain). Then one whole
  forward per side under `benchmarks.syncs.SyncCounter` (`torch.cuda.set_sync_debug_mode("warn")` on a GPU): the
  package's host synchronisations per chunk (target: at most one) and their sites.
- `truncation`: `match_sampler_truncation`'s cost at the check model's 152K vocabulary: the public functions
  `trl_grpo_ext.extras.vllm.truncation_match.trainer_logps` (one padded forward without gradient, what TRL runs for
  the old
  log-probs) and `trainer_truncated_logps` (the same forward with the truncated log-probs projected chunk by chunk,
  what `TruncationMatch.apply` computes) under `top_p=0.9`, on the `truncation` batch, under the trainer's autocast;
  the match over one forward, and its extra time per 1,000 completion positions, extrapolated to a 64 x 8,192
  generation batch. A changed signature is recorded as the section's `error`, not raised.
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import TYPE_CHECKING

import torch

from .common import summarize
from .gpu_packing import FLASH, bench, forward_sizes
from .gpu_setup import free_memory

if TYPE_CHECKING:
    from .gpu_packing import Bench
    from .gpu_setup import Context

__all__ = ["SIDES", "section_host", "section_memory", "section_speed", "section_truncation"]

#: `(side, attention)` in the order they are measured: what decides first, first.
SIDES = (
    ("trl", "sdpa"),
    ("shared", "sdpa"),
    ("trl", FLASH),
    ("packed", FLASH),
    ("shared", FLASH),
    ("packed", "sdpa"),
)
BASELINE = "trl/sdpa"


def _sides(b: Bench, result: dict) -> list[tuple[str, str]]:
    if not b.flash["kernels"]:
        result["skipped"][FLASH] = b.flash["reason"]
    return [(side, attention) for side, attention in SIDES if attention in b.attentions()]


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def step(b: Bench, side: str, attention: str, ids, mask, width: int) -> dict:
    """One policy step of a side (module docstring): seconds, peak memory (GPU), bytes saved for the backward."""
    cuda = ids.is_cuda
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    begin = time.perf_counter()
    with b.attention(attention), b.precision(True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logps = b.logps(side, ids, mask, width, entropy=True)
        (logps * mask[:, -width:]).sum().backward()
    b.model.zero_grad(set_to_none=True)
    out = {"seconds": time.perf_counter() - begin, "saved_bytes": saved[0]}
    if cuda:
        end.record()
        end.synchronize()
        out["seconds"] = start.elapsed_time(end) / 1e3
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_above_start_bytes"] = out["peak_bytes"] - before
    return out


def _guarded_step(b: Bench, side: str, attention: str, batch) -> dict:
    """`step`, with running out of memory recorded as the result."""
    try:
        return step(b, side, attention, *batch)
    except RuntimeError as error:
        if not _is_out_of_memory(error):
            raise
        message = str(error).split("\n")[0][:300]
    # Out of the `except` block: the error's frames, which hold the step's tensors, are released first.
    b.model.zero_grad(set_to_none=True)
    free_memory()
    return {"out_of_memory": message}


def section_memory(ctx: Context, allotted: float, result: dict) -> dict:
    """Peak memory per side, gradient checkpointing on and off, and the self-check alone (module docstring)."""
    from trl_grpo_ext.forward import SelfCheck

    b = bench(ctx)
    sizes = forward_sizes(ctx)
    batch = b.batch(sizes.speed, seed=2)
    begin = time.monotonic()
    result.update(
        {
            "batch": {"label": sizes.speed.label, "rows": batch[0].size(0), "width": batch[0].size(1)},
            "runs": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    sides = _sides(b, result)
    warm = ctx.estimates.setdefault("warm_sides", {})
    for checkpointing in (True, False):
        b.checkpointing(checkpointing)
        key = "checkpointing_on" if checkpointing else "checkpointing_off"
        for side, attention in sides:
            label = f"{side}/{attention}"
            spent = time.monotonic() - begin
            estimate = warm.get(label, 0.0) * (1.0 if checkpointing else 0.8)
            if result["runs"] and spent + estimate > allotted:
                result["skipped"][f"{label} {key}"] = f"time budget: {allotted - spent:.0f} s left of {allotted:.0f} s"
                continue
            run = _guarded_step(b, side, attention, batch)
            result["runs"].setdefault(label, {})[key] = run
            if checkpointing and "seconds" in run:
                warm[label] = run["seconds"]  # the speed section's warm-up, and its estimate
            ctx.log(f"memory: {label}, {key}: " + _describe(run))
            ctx.save()
    b.checkpointing(True)

    # The step-1 self-check alone, on the speed batch's rows, as the first forward of a run would meet it.
    forward = b.forward
    kept, forward.self_check = forward.self_check, SelfCheck()
    try:
        cuda = ctx.cuda
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with b.attention("sdpa"), b.precision(True):
            forward._run_self_check(*batch)
        check = {"seconds": time.perf_counter() - start, "passed": forward.self_check.passed}
        if cuda:
            torch.cuda.synchronize()
            check["peak_above_start_bytes"] = torch.cuda.max_memory_allocated() - before
    finally:
        forward.self_check = kept
    result["self_check"] = check
    ctx.log("memory: the self-check alone: " + _describe(check))
    return result


def _describe(run: dict) -> str:
    if "out_of_memory" in run:
        return "out of memory"
    parts = [f"{run['seconds']:.2f} s"]
    if "peak_bytes" in run:
        parts.append(f"peak {run['peak_bytes'] / 2**30:.1f} GiB")
    if "peak_above_start_bytes" in run:
        parts.append(f"{run['peak_above_start_bytes'] / 2**30:.2f} GiB above the start")
    if "saved_bytes" in run:
        parts.append(f"saved for backward {run['saved_bytes'] / 2**20:.0f} MiB")
    return ", ".join(parts)


def section_speed(ctx: Context, allotted: float, result: dict) -> dict:
    """Step time per side, gradient checkpointing on (module docstring)."""
    b = bench(ctx)
    sizes = forward_sizes(ctx)
    batch = b.batch(sizes.speed, seed=2)
    ids, mask, width = batch
    real = int(mask.sum())
    begin = time.monotonic()
    result.update(
        {
            "batch": {
                "label": sizes.speed.label,
                "rows": ids.size(0),
                "width": ids.size(1),
                "completion_width": width,
                "real_tokens": real,
            },
            "gradient_checkpointing": True,
            "precision": "float32 weights, bf16 autocast" if b.autocasts else "float32",
            "sides": {},
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    sides = _sides(b, result)
    warm = ctx.estimates.setdefault("warm_sides", {})
    b.checkpointing(True)
    for side, attention in sides:
        label = f"{side}/{attention}"
        spent = time.monotonic() - begin
        estimate = warm.get(label) or (statistics.mean(warm.values()) if warm else 0.0)
        steps = sizes.timed_steps + (0 if label in warm else 1)
        if result["sides"] and spent + steps * estimate > allotted:
            result["skipped"][label] = f"time budget: {allotted - spent:.0f} s left of {allotted:.0f} s"
            continue
        if label not in warm:
            first = _guarded_step(b, side, attention, batch)
            if "out_of_memory" in first:
                result["sides"][label] = first
                continue
            warm[label] = first["seconds"]
        runs = [_guarded_step(b, side, attention, batch) for _ in range(sizes.timed_steps)]
        if any("out_of_memory" in run for run in runs):
            result["sides"][label] = runs[0]
            continue
        with b.attention(attention):
            layout = b.layout(side, ids, mask, width)
        tokens = ids.numel() if layout is None else layout.input_ids.numel()
        entry = {
            "seconds": summarize([run["seconds"] for run in runs]),
            "peak_bytes": runs[-1].get("peak_bytes"),
            "tokens_forwarded": tokens,
            "tokens_per_real_token": tokens / real,
            "kernels": b.kernels(attention),
        }
        result["sides"][label] = entry
        ctx.log(f"speed: {label}: {entry['seconds']['median']:.3f} s, {tokens} tokens forwarded")
        ctx.save()
    baseline = result["sides"].get(BASELINE, {}).get("seconds")
    for entry in result["sides"].values():
        if baseline and "seconds" in entry:
            entry["time_over_trl_sdpa"] = entry["seconds"]["median"] / baseline["median"]
    for label, reference in (("shared/sdpa", BASELINE), (f"packed/{FLASH}", f"trl/{FLASH}")):
        ours, theirs = result["sides"].get(label, {}), result["sides"].get(reference, {})
        if "seconds" in ours and "seconds" in theirs:
            value = ours["seconds"]["median"] / theirs["seconds"]["median"]
            result["targets"][f"{label}_time_over_{reference}"] = {"value": value, "limit": 1.0, "met": value <= 1.0}
    return result


class _Reached(Exception):
    """Raised by the first module's pre-hook: the measurement ends where the model's first kernel would start."""


def _time_to_model(b: Bench, side: str, ids, mask, width: int) -> dict:
    """Host (and device) time from the hook's entry to the model's first module (module docstring)."""
    cuda = ids.is_cuda
    marks = {}

    def reached(module, args, kwargs=None):
        marks["host"] = time.perf_counter()
        if cuda:
            marks["event"] = torch.cuda.Event(enable_timing=True)
            marks["event"].record()
        raise _Reached

    handle = b.model.get_input_embeddings().register_forward_pre_hook(reached)
    try:
        if cuda:  # keep the device busy for about 0.1 s, as the previous step keeps it in training
            busy = torch.randn(4096, 4096, device=ids.device)
            torch.cuda.synchronize()
            with torch.autocast("cuda", enabled=False):  # float32 products: slow enough
                for _ in range(40):
                    busy = busy @ busy
                    busy = busy / busy.norm()
            entry = torch.cuda.Event(enable_timing=True)
            entry.record()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                b.logps(side, ids, mask, width)
        except _Reached:
            pass
    finally:
        handle.remove()
    out = {"host_s": marks["host"] - start}
    if cuda:
        marks["event"].synchronize()
        out["device_gap_s"] = entry.elapsed_time(marks["event"]) / 1e3
    return out


def section_host(ctx: Context, allotted: float, result: dict) -> dict:
    """Host time before each forward and the package's host synchronisations per chunk (module docstring)."""
    from .syncs import SyncCounter

    b = bench(ctx)
    sizes = forward_sizes(ctx)
    ids, mask, width = b.batch(sizes.speed, seed=2)
    result.update({"sides": {}, "checks": {}, "targets": {}, "skipped": {}})
    for side, attention in _sides(b, result):
        label = f"{side}/{attention}"
        with b.attention(attention), b.precision(True):
            with torch.no_grad():  # a whole forward first: the run's self-check, registrations, caches
                b.logps(side, ids, mask, width)
            times = [_time_to_model(b, side, ids, mask, width) for _ in range(3)]
            with SyncCounter(ctx.device) as counter, torch.no_grad():
                b.logps(side, ids, mask, width)
        ours = {site: n for (owner, _, site), n in counter.sites.items() if owner == "trl_grpo_ext"}
        uploads = sum(n for site, n in ours.items() if site.endswith(" upload"))
        entry = {
            "host_s": statistics.median(t["host_s"] for t in times),
            "package_syncs_per_chunk": sum(ours.values()) - (uploads if not ctx.cuda else 0),
            "sync_sites": ours,
            "syncs_by_owner": {owner: n for (owner, _), n in counter.counts.items()},
            "method": counter.method,
        }
        if ctx.cuda:
            entry["device_gap_s"] = statistics.median(t["device_gap_s"] for t in times)
        result["sides"][label] = entry
        if side != "trl":
            syncs = entry["package_syncs_per_chunk"]
            result["targets"][f"{label}_syncs_per_chunk"] = {"value": syncs, "limit": 1, "met": syncs <= 1}
        ctx.log(
            f"host: {label}: {entry['host_s'] * 1e3:.1f} ms on the host before the model"
            + (f", device gap {entry['device_gap_s'] * 1e3:.1f} ms" if ctx.cuda else "")
            + f", {entry['package_syncs_per_chunk']} package syncs"
        )
        ctx.save()
    return result


def section_truncation(ctx: Context, allotted: float, result: dict) -> dict:
    """The truncation match against one forward (module docstring); an API it cannot call is recorded, not raised."""
    b = bench(ctx)
    sizes = forward_sizes(ctx)
    ids, mask, width = b.batch(sizes.truncation, seed=3)
    output = {
        "prompt_ids": ids[:, :-width],
        "prompt_mask": mask[:, :-width],
        "completion_ids": ids[:, -width:],
        "completion_mask": mask[:, -width:],
    }
    positions = ids.size(0) * width
    result.update(
        {
            "batch": {"label": sizes.truncation.label, "rows": ids.size(0), "completion_width": width},
            "positions": positions,
            "vocab": b.vocab,
            "cuts": "top_p=0.9",
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    try:
        from trl_grpo_ext.extras.vllm.sampler_cuts import SamplerCuts
        from trl_grpo_ext.extras.vllm.truncation_match import trainer_logps, trainer_truncated_logps

        cuts = SamplerCuts(top_p=0.9)
        calls = {
            "forward": lambda: trainer_logps(b.trainer, output),
            "match": lambda: trainer_truncated_logps(b.trainer, output, cuts),
        }
        seconds = {}
        with b.attention("sdpa"), b.precision(True):
            for name, call in calls.items():
                call()  # warm-up
                if ctx.cuda:
                    torch.cuda.synchronize()
                begin = time.perf_counter()
                call()
                if ctx.cuda:
                    torch.cuda.synchronize()
                seconds[name] = time.perf_counter() - begin
    except Exception as error:  # noqa: BLE001 - the match's API is being reworked: recorded, the run goes on
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
        ctx.log(f"truncation: could not time the match: {result['error']}")
        return result
    extra = seconds["match"] - seconds["forward"]
    result.update(
        {
            "forward_s": seconds["forward"],
            "match_s": seconds["match"],
            "match_over_forward": seconds["match"] / seconds["forward"],
            "extra_s_per_1000_positions": extra / positions * 1000,
            "extra_s_at_64x8192": extra / positions * 64 * 8192,
        }
    )
    ctx.log(
        f"truncation: match {seconds['match']:.3f} s, one forward {seconds['forward']:.3f} s "
        f"({result['match_over_forward']:.2f}x) over {positions} positions"
    )
    return result
