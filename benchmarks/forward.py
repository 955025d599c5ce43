"""The training forward on realistic shapes: TRL's padded log-prob forward against the padding-free ones.

A Qwen3-architecture model built locally with random weights (about 25M parameters at the default sizes, sdpa
attention), one micro-batch of `groups` groups of `G = 8` completions: prompts of 100-400 tokens, completion lengths
log-normal (mean about 300) with one completion per group cut at `max_completion_length = 1024`, drawn once with a
fixed seed; generation plays no part (the rows are given). Per step each side runs what a GRPO step runs through
`_get_per_token_logps_and_entropies`: the reference forward (no gradient) and the policy forward with entropies,
followed by the backward of the summed completion log-probs. Sides (`trl`: stock TRL's padded hook, `ext`: the
padding-free one of `GRPOTrainerExt` without shared prompts, `shared`: with them, `shared_prompt_forward=True`, the
default) alternate, step by step, in one process.

`attn_implementation`: `sdpa` (the default), `eager`, `flash_attention_2` (on a GPU with `flash_attn`), or
`flash-emulated`: transformers' flash-attention path with exact stand-ins for the kernels (`benchmarks.emulation`),
on a CPU: its times say nothing (the stand-ins attend one sequence at a time in Python), its log-prob differences and
tokens are what flash-attention gives.

Reported per side: the step time (median of `steps` after one warm-up, seconds), the activation memory of the
policy forward (bytes of the tensors autograd saves for the backward, counted by `saved_tensors_hooks`: deterministic,
unlike a CPU's resident memory), the tokens forwarded per distinct token (each packed row's tail included), the
largest log-prob difference from `trl`'s, and for the packed sides the host synchronisations and uploads of the
package's code per chunk (`benchmarks.syncs.SyncCounter`; one chunk: TRL's `batch_size` is the micro-batch).
Goals (issue: faster than TRL): time and activation memory of the default (`shared`) <= 0.5x and <= 0.6x `trl`'s.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time

import torch

from .common import format_table

MAX_COMPLETION = 1024


def draw_rows(groups: int, generations: int, seed: int, vocab: int, quick: bool):
    """`(input_ids, attention_mask, logits_to_keep)` of a micro-batch as TRL builds it (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    cut = 48 if quick else MAX_COMPLETION
    prompts, completions = [], []
    for _ in range(groups):
        length = int(torch.randint(10 if quick else 100, (40 if quick else 400) + 1, (1,), generator=generator))
        prompt = torch.randint(3, vocab, (length,), generator=generator)
        # Log-normal lengths, drawn from `generator` (the draw depends on the seed alone).
        lengths = torch.exp((5.5 if not quick else 2.5) + 0.6 * torch.randn(generations, generator=generator))
        lengths = lengths.clamp(1, cut).long()
        lengths[0] = cut  # one completion per group cut at max_completion_length
        for n in lengths.tolist():
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (n,), generator=generator))
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, width_p - len(p) : width_p], ids[i, width_p : width_p + len(c)] = p, c
        mask[i, width_p - len(p) : width_p + len(c)] = 1
    return ids, mask, width_c


def _trainer(quick: bool, tmp: str, device: str = "cpu", attn_implementation: str = "sdpa"):
    """The trainer of the benchmark's model; `flash-emulated` loads it with sdpa (the caller switches it)."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
    from trl_grpo_ext.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    vocab = 256 if quick else 32000
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32 if quick else 384,
        intermediate_size=64 if quick else 1536,
        num_hidden_layers=2 if quick else 6,
        num_attention_heads=4 if quick else 6,
        num_key_value_heads=2,
        head_dim=8 if quick else 64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(f"{tmp}/model")
    tokenizer.save_pretrained(f"{tmp}/model")
    cuda = device == "cuda"
    args = GRPOConfigExt(
        f"{tmp}/out",
        per_device_train_batch_size=8,
        num_generations=8,
        report_to="none",
        use_cpu=not cuda,
        bf16=cuda,
        max_steps=1,
        model_init_kwargs={
            "attn_implementation": "sdpa" if attn_implementation == "flash-emulated" else attn_implementation,
            **({"dtype": torch.bfloat16} if cuda else {}),
        },
    )
    trainer = GRPOTrainerExt(
        model=f"{tmp}/model",
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        processing_class=tokenizer,
    )
    return trainer, vocab, sum(p.numel() for p in trainer.model.parameters())


def _step(trainer, hook, ids, mask, width) -> tuple[float, int, int | None, torch.Tensor]:
    """One step of a side: (seconds, bytes saved for the backward by the policy forward, peak bytes, log-probs)."""
    model = trainer.model
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        hook(model, ids, mask, width)  # the reference forward
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, _, _ = hook(model, ids, mask, width, None, True)
    (logps * mask[:, -width:]).sum().backward()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return time.perf_counter() - start, saved[0], peak, logps.detach()


def _syncs(trainer, ids, mask, width) -> dict:
    """The package's host synchronisations and uploads in one packed policy forward (one chunk), on the device."""
    from .syncs import SyncCounter

    with SyncCounter(ids.device.type) as counter:
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, None, True)
    ours = {site: n for (owner, _, site), n in counter.sites.items() if owner == "trl_grpo_ext"}
    uploads = sum(n for site, n in ours.items() if site.endswith(" upload"))
    others = {f"{owner}": n for (owner, _), n in counter.counts.items() if owner not in ("trl_grpo_ext", "bench")}
    return {"package": sum(ours.values()) - uploads, "uploads": uploads, "sites": ours, "others": others}


def run(
    steps: int = 3,
    groups: int = 2,
    quick: bool = False,
    seed: int = 0,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> dict:
    """The three sides on the drawn micro-batch (module docstring); `device` `"cuda"` runs in bfloat16 and also
    reports each side's peak allocated memory (`peak_bytes`, `None` on the CPU)."""
    from trl_grpo_ext.forward import forward_counts, row_spans

    from .emulation import flash_attention_emulation, use_flash_attention

    emulated = attn_implementation == "flash-emulated"
    with tempfile.TemporaryDirectory() as tmp, flash_attention_emulation() if emulated else contextlib.nullcontext():
        trainer, vocab, parameters = _trainer(quick, tmp, device, attn_implementation)
        if emulated:
            use_flash_attention(trainer.model)
        ids, mask, width = draw_rows(groups, 8, seed, vocab, quick)
        counts = forward_counts(ids[:, :-width], mask[:, :-width], mask[:, -width:])
        ids, mask = ids.to(trainer.accelerator.device), mask.to(trainer.accelerator.device)
        packed_forward = trainer._packed_forward
        packed = trainer._get_per_token_logps_and_entropies
        sides = {"trl": (trainer._stock_logps_and_entropies, False), "ext": (packed, False), "shared": (packed, True)}
        times, memory, peaks, logps = {side: [] for side in sides}, {}, {}, {}
        for step in range(steps + 1):
            for side, (hook, shared) in sides.items():
                packed_forward.shared_prompts = shared
                seconds, saved, peaks[side], logps[side] = _step(trainer, hook, ids, mask, width)
                memory[side] = saved
                if step:  # the first is a warm-up
                    times[side].append(seconds)
        check = packed_forward.self_check
        shared = packed_forward._share(trainer.model, compute_aux_loss=False)
        syncs = {}
        for side, share in (("ext", False), ("shared", shared)):
            packed_forward.shared_prompts = share
            syncs[side] = _syncs(trainer, ids, mask, width)
        # What each side forwards: TRL's padded rows, the packed rows (their tails included) as the trainer packs them.
        forwarded = {"trl": int(counts.forwarded)}
        layouts = {}
        for side, share in (("ext", False), ("shared", shared)):
            spans = row_spans(mask, width, ids if share else None)
            layouts[side] = packed_forward.layout(trainer.model, ids, mask, width, spans, share)
            forwarded[side] = layouts[side].input_ids.numel()
        completion = mask[:, -width:].bool()
        difference = {
            side: float((values.float() - logps["trl"].float()).abs()[completion].max())
            for side, values in logps.items()
        }
    config = {"steps": steps, "groups": groups, "generations": 8, "quick": quick, "parameters": parameters}
    return {
        "config": {**config, "device": device, "attn_implementation": attn_implementation},
        "shape": {
            "rows": ids.size(0),
            "width": ids.size(1),
            "completion_width": width,
            "packed_rows": {side: list(layout.input_ids.shape) for side, layout in layouts.items()},
        },
        "tokens": {**forwarded, "distinct": int(counts.distinct)},
        "self_check": {
            "passed": check.passed,
            "difference": check.difference,
            "floor": check.floor,
            "tolerance": check.tolerance,
            "dtype": str(check.dtype),
            "shared_passed": check.shared_passed,
            "shared_difference": check.shared_difference,
        },
        "syncs_per_chunk": syncs,
        "sides": {
            side: {
                "step_seconds": statistics.median(times[side]),
                "activation_bytes": memory[side],
                "peak_bytes": peaks[side],
                "tokens_per_distinct": forwarded[side] / int(counts.distinct),
                "max_abs_logp_difference": difference[side],
            }
            for side in sides
        },
    }


def table(result: dict) -> str:
    trl = result["sides"]["trl"]
    exactness = all("max_abs_logp_difference" in values for values in result["sides"].values())
    rows = []
    for side, values in result["sides"].items():
        rows.append(
            [
                side,
                f"{values['step_seconds']:.2f}",
                f"{values['step_seconds'] / trl['step_seconds']:.2f}",
                f"{values['activation_bytes'] / 2**20:.0f}",
                f"{values['activation_bytes'] / trl['activation_bytes']:.2f}",
                f"{values['tokens_per_distinct']:.2f}",
            ]
            + ([f"{values['max_abs_logp_difference']:.1e}"] if exactness else [])
        )
    headers = ["side", "step s", "time / trl", "activations MiB", "memory / trl", "tokens / distinct"]
    return format_table(headers + (["max |dlogp| vs trl"] if exactness else []), rows)
