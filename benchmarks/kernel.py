"""The loss kernel: forward + backward of `grpo_loss` against two eager baselines, at realistic shapes.

Sides, all on the same inputs (log-probs `(N, T)` near policy, a right-padded integer mask as TRL builds it):

- `seed000`: the source lesson's `compute_grpo_loss` (token-level mean over the batch), eager;
- `trl_inline`: the same objective written the way TRL 1.16's `_compute_loss` writes it inline for
  `loss_type="grpo"` (multiply by the mask, per-sequence mean), eager;
- `reference`: DeepSeekMath's objective, `grpo_loss(..., implementation="reference")`, the formula with autograd: what
  trains by default (it also returns the per-token ratios, KL terms and clip masks the diagnostics read);
- `fused`, `compiled`: the same through the opt-in kernel (`implementation="fused"` or `"compiled"`);
- `reference+diagnostics`: the formula and the ratio statistics the trainer computes beside it while it logs its
  diagnostics (`diagnostics.histogram.ratio_sums`).

Each repeat times every side once, in an order that alternates between repeats. On a CPU the timer is
`time.perf_counter`; on a GPU, CUDA events. Extra peak memory is what the call allocates beyond its inputs, at its
peak: from the profiler's allocation events on a CPU, `torch.cuda.max_memory_allocated` on a GPU. The roofline is
the time to move the bytes the loss must touch at the memory bandwidth measured in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from trl_grpo_ext.diagnostics.histogram import ratio_sums
from trl_grpo_ext.ops import grpo_loss

from .common import child_env, format_table, summarize

SIDES = ("seed000", "trl_inline", "reference", "fused", "compiled", "reference+diagnostics")


def seed000_loss(log_probs, old_log_probs, ref_log_probs, advantages, completion_mask, epsilon=0.2, beta=0.04):
    """Seed 000's `compute_grpo_loss`, as the lesson writes it."""
    advantages_per_token = advantages.unsqueeze(-1)
    ratio = torch.exp(log_probs - old_log_probs)
    policy_loss_unclipped = ratio * advantages_per_token
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon)
    policy_loss_clipped = clipped_ratio * advantages_per_token
    surrogate_loss = -torch.min(policy_loss_unclipped, policy_loss_clipped)
    log_r_kl = ref_log_probs - log_probs
    r_kl = torch.exp(log_r_kl)
    kl_penalty = r_kl - log_r_kl - 1
    per_token_loss = surrogate_loss + beta * kl_penalty
    masked_loss = per_token_loss * completion_mask
    return masked_loss.sum() / completion_mask.sum()


def trl_inline_loss(logps, old_logps, ref_logps, advantages, mask, epsilon=0.2, beta=0.04):
    """The objective as TRL 1.16 computes it inline (`loss_type="grpo"`, no bias correction): eager ops, the mask
    multiplied in, a per-sequence mean."""
    advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages
    per_token = -torch.min(unclipped, clipped)
    kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    per_token = per_token + beta * kl
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def make_inputs(rows: int, tokens: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, tokens, generator=generator) * 3
    old = logps + 0.05 * torch.randn(rows, tokens, generator=generator)
    ref = logps + 0.05 * torch.randn(rows, tokens, generator=generator)
    advantages = torch.randn(rows, generator=generator)
    lengths = torch.randint(tokens // 4, tokens + 1, (rows, 1), generator=generator)
    mask = (torch.arange(tokens)[None] < lengths).long()
    tensors = {"logps": logps, "old": old, "ref": ref, "advantages": advantages, "mask": mask}
    return {
        name: tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        for name, tensor in tensors.items()
    }


def side_function(side: str, inputs: dict):
    """A closure that runs forward + backward of one side on a fresh leaf copy of `logps`."""
    old, ref, advantages, mask = inputs["old"], inputs["ref"], inputs["advantages"], inputs["mask"]
    float_mask = mask.to(inputs["logps"].dtype)  # the baselines multiply by the mask

    def run(logps):
        if side == "seed000":
            loss = seed000_loss(logps, old, ref, advantages, float_mask)
        elif side == "trl_inline":
            loss = trl_inline_loss(logps, old, ref, advantages, float_mask)
        elif side == "reference+diagnostics":
            out = grpo_loss(logps, old, ref, advantages, mask)
            ratio_sums(out.log_ratio, out.mask, torch.float64, out.ratio)
            loss = out.loss
        else:
            loss = grpo_loss(logps, old, ref, advantages, mask, implementation=side).loss
        loss.backward()

    return run


def _timed(run, inputs, cuda: bool) -> float:
    logps = inputs["logps"].detach().clone().requires_grad_(True)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run(logps)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    run(logps)
    return time.perf_counter() - begin


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_bytes(side: str, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Peak bytes one forward + backward allocates beyond its inputs and the leaf copy of `logps`.

    On a GPU: `torch.cuda.max_memory_allocated`. On a CPU (Linux), in a fresh process whose allocator maps every
    block of 64 KiB or more from the system and returns it on free (`MALLOC_MMAP_THRESHOLD_`), so that the
    resident-set high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`) follows the live buffers; a
    difference below zero (page-sized noise of the kernel's counters) is recorded as 0.
    """
    if torch.cuda.is_available():
        inputs = make_inputs(rows, tokens, dtype, "cuda")
        run = side_function(side, inputs)
        run(inputs["logps"].detach().clone().requires_grad_(True))  # warm-up (compilation)
        logps = inputs["logps"].detach().clone().requires_grad_(True)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(logps)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline
    import subprocess
    import sys

    env = child_env(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    dtype_name = str(dtype).replace("torch.", "")
    command = [sys.executable, "-m", "benchmarks.kernel", "--memory", side, str(rows), str(tokens), dtype_name]
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"memory measurement of {side} failed:\n{completed.stderr[-2000:]}")
    return int(completed.stdout.strip().splitlines()[-1])


def _measure_memory_here(side: str, rows: int, tokens: int, dtype_name: str) -> int:
    torch.set_num_threads(1)
    inputs = make_inputs(rows, tokens, getattr(torch, dtype_name), "cpu")
    run = side_function(side, inputs)
    for _ in range(2):  # warm-up: compilation, lazy initialisations
        run(inputs["logps"].detach().clone().requires_grad_(True))
    logps = inputs["logps"].detach().clone().requires_grad_(True)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    before = _rss_bytes("VmHWM")
    run(logps)
    # The kernel's resident-set counters are approximate to a few pages (per-CPU counts folded in late): a call that
    # allocates nothing beyond its inputs can read a page below the mark it started from. That is no allocation.
    return max(0, _rss_bytes("VmHWM") - before)


def memory_bandwidth(device: str, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second of `c = a + b` on buffers far larger than the caches (read 2, write 1)."""
    count = megabytes * 2**20 // 4 // 3
    a, b = torch.rand(count, device=device), torch.rand(count, device=device)
    c = torch.empty_like(a)
    cuda = device != "cpu"
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        torch.add(a, b, out=c)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - begin)
    return 3 * a.numel() * a.element_size() / best


def minimal_bytes(inputs: dict) -> int:
    """Bytes forward + backward must move at least: read logps, old, ref, mask and advantages, write the gradient."""
    logps = inputs["logps"]
    reads = sum(inputs[name].numel() * inputs[name].element_size() for name in ("logps", "old", "ref", "mask"))
    reads += inputs["advantages"].numel() * inputs["advantages"].element_size()
    return reads + logps.numel() * logps.element_size()


def run(
    shapes=((64, 1024), (64, 4096)),
    dtypes=(torch.float32, torch.bfloat16),
    repeats: int = 30,
    warmup: int = 3,
    sides=SIDES,
) -> dict:
    """Time every side at every shape and dtype; returns the results (what `--json` writes)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    bandwidth = memory_bandwidth(device)
    results = {"device": device, "bandwidth_bytes_per_s": bandwidth, "cases": []}
    for rows, tokens in shapes:
        for dtype in dtypes:
            inputs = make_inputs(rows, tokens, dtype, device)
            runs = {side: side_function(side, inputs) for side in sides}
            for _ in range(warmup):  # includes torch.compile's first call
                for side in sides:
                    _timed(runs[side], inputs, cuda)
            times = {side: [] for side in sides}
            for repeat in range(repeats):
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    times[side].append(_timed(runs[side], inputs, cuda))
            buffer_bytes = rows * tokens * 4
            roofline = minimal_bytes(inputs) / bandwidth
            case = {"shape": [rows, tokens], "dtype": str(dtype).replace("torch.", ""), "sides": {}}
            for side in sides:
                ratios = [seed / ours for seed, ours in zip(times["seed000"], times[side], strict=True)]
                extra = extra_peak_bytes(side, rows, tokens, dtype)
                case["sides"][side] = {
                    "time_s": summarize(times[side]),
                    "speedup_vs_seed000": summarize(ratios) if "seed000" in times else None,
                    "extra_peak_bytes": extra,
                    "extra_peak_fp32_buffers": extra / buffer_bytes,
                    "roofline_fraction": roofline / statistics.median(times[side]),
                }
            case["roofline_s"] = roofline
            results["cases"].append(case)
    return results


def table(results: dict) -> str:
    rows = []
    for case in results["cases"]:
        for side, stats in case["sides"].items():
            time_stats, speedup = stats["time_s"], stats["speedup_vs_seed000"]
            rows.append(
                [
                    f"{case['shape'][0]}x{case['shape'][1]}",
                    case["dtype"],
                    side,
                    f"{time_stats['median'] * 1e3:.2f} [{time_stats['min'] * 1e3:.2f}, {time_stats['max'] * 1e3:.2f}]",
                    f"{speedup['median']:.2f} [{speedup['min']:.2f}, {speedup['max']:.2f}]" if speedup else "",
                    f"{stats['extra_peak_fp32_buffers']:.2f}",
                    f"{stats['roofline_fraction']:.1%}",
                ]
            )
    headers = [
        "N x T",
        "dtype",
        "side",
        "fwd+bwd ms, median [min, max]",
        "speed-up vs seed000",
        "extra peak, (N,T) fp32 buffers",
        "of roofline",
    ]
    bandwidth = f"memory bandwidth {results['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({results['device']})"
    return bandwidth + "\n" + format_table(headers, rows)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--memory"]:
        side, rows, tokens, dtype_name = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(_measure_memory_here(side, rows, tokens, dtype_name))
