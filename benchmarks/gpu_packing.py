"""Sections `engagement` and `exactness` of `python -m benchmarks gpu`, and what the log-prob forward's sections share.

`engagement`: does the packed forward engage where users train? Two trainers as the README's first example builds
them, a model given by name (`Sizes.check_model`, saved in bfloat16; TRL loads it in float32) with `GRPOConfigExt`'s
defaults (bf16 autocast on a GPU that has it; on a CPU `bf16=True, use_cpu=True` gives the same precision through
CPU autocast), and the same with bfloat16 weights (`model_init_kwargs={"dtype": "bfloat16"}`), each trained for one
step with short completions. Per setup: the self-check's `passed`, `difference`, `floor`, `tolerance`, `dtype` (and
the shared-prompt layout's), how many log-prob forwards packed and whether any fell back to TRL's padded one, and
the package's messages. A fallback in either setup fails the run.

`exactness`: max, p99.9 and mean of |packed - padded| per-token log-prob on a multi-row batch (`Sizes`'s
`exactness` batch, `padding_free_row_tokens` set so that it packs into three rows or more), packed and with shared
prompts, for sdpa and flash-attention 2, against the noise floor of TRL's padded forward itself (the same rows with
seven more columns of left padding). A side passes within the self-check's rule: `FLOOR_FACTOR` times the floor, at
least `MINIMUM_TOLERANCE` of the dtype it computes in. Under bf16 autocast (what trains) and, where the kernels take
it, in float32 (the sharp test: a boundary error of 0.03 hides in bf16 noise, not in float32's).

Flash-attention 2 (`flash_kernels`): the `flash_attn` package where installed; else on a CUDA device torch's own
flash-attention 2 kernel in transformers' `flash_attention_2` path (`benchmarks.emulation.torch_flash_attention`);
on a CPU the exact stand-ins (`benchmarks.emulation.flash_attention_emulation`: the layout and boundaries are
flash-attention's, the times say nothing). Each flash row names its kernels.

The later sections (`gpu_costs`, `gpu_attention`) reuse one `Bench`: the default setup's trainer, with `beta=0` (no
reference model to hold) and not trained: its calls run under the trainer's autocast, as a prepared model's forward
does in training.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .gpu_setup import QUICK, free_memory, prompts, text_hash_reward

if TYPE_CHECKING:
    from .gpu_setup import Context

__all__ = [
    "Bench",
    "FORWARD_GPU",
    "FORWARD_QUICK",
    "Batch",
    "ForwardSizes",
    "bench",
    "differences",
    "draw_batch",
    "flash_kernels",
    "section_engagement",
    "section_exactness",
]

LOGGER = "trl_grpo_ext.forward.logprobs"
FLASH = "flash_attention_2"


@dataclass(frozen=True)
class Batch:
    """One micro-batch as TRL builds it: `groups` prompts of `generations` completions each, prompt lengths uniform
    in `prompt_lengths`, completion lengths log-normal (`median`, `sigma`) cut at `cap`, one per group at the cap."""

    groups: int
    generations: int
    prompt_lengths: tuple[int, int]
    median: float
    sigma: float
    cap: int

    @property
    def label(self) -> str:
        return (
            f"{self.groups} x {self.generations} completions, log-normal (median {self.median:g}, sigma "
            f"{self.sigma:g}) up to {self.cap}, prompts {self.prompt_lengths[0]}-{self.prompt_lengths[1]} tokens"
        )


@dataclass(frozen=True)
class ForwardSizes:
    """Sizes of the log-prob forward's sections."""

    train_completion: int  # max_completion_length of the engagement runs' one training step
    exactness: Batch
    speed: Batch  # also memory's and host's
    truncation: Batch
    attention_lengths: tuple[int, ...]  # row lengths of the masked-attention throughput
    timed_steps: int  # timed forward + backward steps per side


FORWARD_GPU = ForwardSizes(
    train_completion=32,
    exactness=Batch(2, 8, (100, 400), 600.0, 0.8, 2048),
    speed=Batch(2, 8, (100, 400), 2048.0, 0.8, 8192),
    truncation=Batch(1, 8, (100, 400), 1024.0, 0.8, 2048),
    attention_lengths=(2048, 8192),
    timed_steps=2,
)
FORWARD_QUICK = ForwardSizes(
    train_completion=8,
    exactness=Batch(2, 8, (10, 40), 12.0, 0.6, 48),
    speed=Batch(2, 8, (10, 40), 16.0, 0.6, 64),
    truncation=Batch(1, 8, (10, 40), 12.0, 0.6, 32),
    attention_lengths=(64, 128),
    timed_steps=1,
)


def forward_sizes(ctx: Context) -> ForwardSizes:
    return FORWARD_QUICK if ctx.sizes is QUICK else FORWARD_GPU


def draw_batch(batch: Batch, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(input_ids, attention_mask, logits_to_keep)` of `batch` as TRL builds it: prompts left-padded, completions
    right-padded, each prompt repeated for its completions; drawn from `seed` alone, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    low, high = batch.prompt_lengths
    prompts_, completions = [], []
    for _ in range(batch.groups):
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        prompt = torch.randint(3, vocab, (length,), generator=generator)
        lengths = torch.exp(math.log(batch.median) + batch.sigma * torch.randn(batch.generations, generator=generator))
        lengths = lengths.clamp(1, batch.cap).long()
        lengths[0] = batch.cap
        for length in lengths.tolist():
            prompts_.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=generator))
    width_p, width_c = max(map(len, prompts_)), max(map(len, completions))
    ids = torch.zeros(len(prompts_), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompts_, completions, strict=True)):
        ids[i, width_p - len(prompt) : width_p] = prompt
        ids[i, width_p : width_p + len(completion)] = completion
        mask[i, width_p - len(prompt) : width_p + len(completion)] = 1
    return ids, mask, width_c


def left_padded(ids: torch.Tensor, mask: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows with `extra` more columns of left padding (pad id 0)."""
    return torch.nn.functional.pad(ids, (extra, 0)), torch.nn.functional.pad(mask, (extra, 0))


def differences(values: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> dict:
    """max, p99.9 and mean of |values - reference| over the tokens where `mask` is set."""
    delta = (values.double() - reference.double()).abs()[mask.bool()]
    return {
        "max": delta.max().item(),
        "p99.9": torch.quantile(delta, 0.999).item(),
        "mean": delta.mean().item(),
        "tokens": delta.numel(),
    }


def flash_kernels(cuda: bool) -> dict:
    """Which kernels run flash-attention 2 here: `{"kernels": name, "description": ...}`, or `{"kernels": None,
    "reason": ...}` (module docstring)."""
    from .emulation import torch_varlen_available

    if cuda and importlib.util.find_spec("flash_attn") is not None:
        from importlib.metadata import version

        return {"kernels": "flash_attn", "description": f"the flash_attn package {version('flash_attn')}"}
    if cuda and torch_varlen_available():
        return {
            "kernels": "torch",
            "description": "torch's own flash-attention 2 kernel (torch.nn.attention.varlen.varlen_attn) in "
            "transformers' flash_attention_2 path: the flash_attn package is not installed",
        }
    if not cuda:
        return {
            "kernels": "emulated",
            "description": "exact stand-ins in transformers' flash_attention_2 path (benchmarks/emulation.py): "
            "flash-attention's layout and boundaries, times that say nothing",
        }
    return {"kernels": None, "reason": "the flash_attn package is not installed and this torch has no varlen_attn"}


@contextlib.contextmanager
def _messages():
    """The package's forward messages (info and warnings) while the context is open."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(LOGGER)
    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Recorder:
    """Stands in for a trainer's `_packed_forward`: records whether each call packed (`None`: it fell back)."""

    def __init__(self, inner):
        self.inner, self.packed = inner, []

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.packed.append(out is not None)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build_trainer(ctx: Context, output: str, bf16_weights: bool = False, **overrides):
    """`GRPOTrainerExt` on the check model as the README builds it: the model by name, `GRPOConfigExt`'s defaults
    (module docstring); `overrides` change the config."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    model_path, tokenizer_path = ctx.model("check_model")
    sizes = forward_sizes(ctx)
    args = dict(
        output_dir=os.path.join(ctx.workdir, output),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=sizes.train_completion,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    if not ctx.cuda:  # CPU autocast in bf16: the precision of a GPU's default
        args.update(use_cpu=True, bf16=True)
    if bf16_weights:
        args["model_init_kwargs"] = {"dtype": "bfloat16"}
    args.update(overrides)
    return GRPOTrainerExt(
        model=model_path,
        reward_funcs=text_hash_reward,
        args=GRPOConfigExt(**args),
        train_dataset=Dataset.from_dict({"prompt": prompts(64)}),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
    )


def _self_check(check) -> dict:
    return {
        "passed": check.passed,
        "difference": check.difference,
        "floor": check.floor,
        "tolerance": check.tolerance,
        "dtype": str(check.dtype).removeprefix("torch."),
        "shared_passed": check.shared_passed,
        "shared_difference": check.shared_difference,
        "cause": check.cause if not check.passed else "",
    }


SETUPS = {
    "default": "float32 weights loaded by name, GRPOConfigExt's defaults (bf16 autocast)",
    "bf16_weights": "bfloat16 weights (model_init_kwargs dtype), GRPOConfigExt's defaults",
}


def section_engagement(ctx: Context, allotted: float, result: dict) -> dict:
    """One training step per setup (module docstring); fills `result` as it goes."""
    result.update({"setups": {}, "checks": {}, "targets": {}, "skipped": {}})
    for setup, description in SETUPS.items():
        begin = time.monotonic()
        ctx.log(f"engagement: {setup}: {description}")
        trainer = build_trainer(ctx, f"engagement-{setup}", bf16_weights=setup == "bf16_weights")
        recorder = trainer._packed_forward = _Recorder(trainer._packed_forward)
        model = trainer.model
        entry = {
            "description": description,
            "weights": str(next(model.parameters()).dtype).removeprefix("torch."),
            "bf16": trainer.args.bf16,
            "attn_implementation": model.config._attn_implementation,
        }
        with _messages() as messages:
            trainer.train()
        check = recorder.inner.self_check
        entry.update(
            {
                "self_check": _self_check(check),
                "forwards": len(recorder.packed),
                "packed_forwards": sum(recorder.packed),
                "fell_back": not all(recorder.packed) or not recorder.packed,
                "messages": messages,
                "seconds": time.monotonic() - begin,
            }
        )
        result["setups"][setup] = entry
        engaged = check.done and check.passed and bool(recorder.packed) and all(recorder.packed)
        result["checks"][f"{setup}_packs"] = engaged
        # Judged at the precision the forward computes in: autocast's where the run turns it on, else the weights'.
        computes_in = "bfloat16" if trainer.args.bf16 else "float16" if trainer.args.fp16 else entry["weights"]
        result["checks"][f"{setup}_self_check_at_the_compute_precision"] = entry["self_check"]["dtype"] == computes_in
        ctx.log(
            f"engagement: {setup}: packed {entry['packed_forwards']} of {entry['forwards']} forwards; self-check "
            f"passed {check.passed}, difference {check.difference:.3g}, tolerance {check.tolerance:.3g} at "
            f"{entry['self_check']['dtype']}"
        )
        del trainer, recorder, model
        free_memory()
        if ctx.cuda:  # what the trainer left behind: the next sections need the memory
            entry["allocated_after_release_bytes"] = torch.cuda.memory_allocated()
        ctx.save()
    return result


class FellBack(RuntimeError):
    """The packed forward returned `None`: it ran padded (the engagement section says why)."""


class Bench:
    """The log-prob forward's sections' trainer and what they do with it (module docstring).

    Args:
        trainer (`GRPOTrainerExt`): the default setup's trainer, `beta=0`.
        flash (`dict`): `flash_kernels`.
    """

    def __init__(self, trainer, flash: dict):
        self.trainer = trainer
        self.model = trainer.model
        self.forward = trainer._packed_forward
        self.flash = flash
        self.device = trainer.accelerator.device
        self.vocab = self.model.config.vocab_size

    @property
    def autocasts(self) -> bool:
        return bool(self.trainer.accelerator.native_amp)

    def attentions(self) -> tuple[str, ...]:
        return ("sdpa", FLASH) if self.flash["kernels"] else ("sdpa",)

    def kernels(self, attention: str) -> str:
        return "torch sdpa" if attention == "sdpa" else self.flash["description"]

    @contextlib.contextmanager
    def attention(self, name: str):
        """The model runs attention `name` (`"sdpa"` or flash-attention 2 on `flash_kernels`) in the context."""
        if name == "sdpa":
            yield
            return
        from .emulation import flash_attention_emulation, torch_flash_attention, use_flash_attention

        kernels = {
            "flash_attn": contextlib.nullcontext,
            "torch": torch_flash_attention,
            "emulated": flash_attention_emulation,
        }[self.flash["kernels"]]
        with kernels():
            use_flash_attention(self.model, implementation=FLASH)
            try:
                yield
            finally:
                use_flash_attention(self.model, implementation="sdpa")

    @contextlib.contextmanager
    def precision(self, autocast: bool):
        """Calls in the context run as training runs them (under the trainer's autocast, as accelerate wraps a
        prepared model's forward) or, with `autocast=False`, in the weights' dtype (the packed forward enters the
        trainer's autocast itself: switched off meanwhile)."""
        accelerator = self.trainer.accelerator
        amp = accelerator.native_amp
        accelerator.native_amp = amp and autocast
        try:
            with accelerator.autocast():
                yield
        finally:
            accelerator.native_amp = amp

    @contextlib.contextmanager
    def row_tokens(self, tokens: int | None):
        """`padding_free_row_tokens` in the context."""
        before, self.forward.row_tokens = self.forward.row_tokens, tokens
        try:
            yield
        finally:
            self.forward.row_tokens = before

    def batch(self, batch: Batch, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids, mask, width = draw_batch(batch, self.vocab, seed)
        return ids.to(self.device), mask.to(self.device), width

    def logps(self, side: str, ids, mask, width: int, entropy: bool = False) -> torch.Tensor:
        """`(N, C)` log-probs of TRL's padded forward (`side="trl"`) or the packed one (`"packed"`, `"shared"`),
        through the hooks training calls; raises `FellBack` where the packed forward ran padded."""
        if side == "trl":
            return self.trainer._stock_logps_and_entropies(self.model, ids, mask, width, compute_entropy=entropy)[0]
        shared, self.forward.shared_prompts = self.forward.shared_prompts, side == "shared"
        try:
            out = self.forward(self.model, ids, mask, width, None, entropy, False, {})
        finally:
            self.forward.shared_prompts = shared
        if out is None:
            raise FellBack(f"the {side} forward ran padded (see the engagement section)")
        return out[0]

    def layout(self, side: str, ids, mask, width: int):
        """The packed layout the `side` forward uses for these rows (`None` for TRL's padded one)."""
        from trl_grpo_ext.forward import row_spans

        if side == "trl":
            return None
        share = side == "shared" and self.forward._share(self.model, compute_aux_loss=False)
        spans = row_spans(mask, width, ids if share else None)
        return self.forward.layout(self.model, ids, mask, width, spans, share)

    def checkpointing(self, on: bool) -> None:
        """Gradient checkpointing on or off (non-reentrant, as TRL's default), the model in training mode."""
        model = self.model
        self.model.train()
        if on:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()


def bench(ctx: Context) -> Bench:
    """The forward sections' `Bench`, built on first use and kept in `ctx.state`."""
    if "bench" not in ctx.state:
        begin = time.monotonic()
        trainer = build_trainer(ctx, "bench", beta=0.0)
        ctx.state["bench"] = Bench(trainer, flash_kernels(ctx.cuda))
        ctx.log(f"built the forward sections' trainer in {time.monotonic() - begin:.1f} s")
    return ctx.state["bench"]


def _packed_rows(bench_: Bench, side: str, ids, mask, width: int) -> int:
    layout = bench_.layout(side, ids, mask, width)
    return int(layout.input_ids.size(0))


def section_exactness(ctx: Context, allotted: float, result: dict) -> dict:
    """|packed - padded| against the padded forward's own noise (module docstring); fills `result` as it goes."""
    from trl_grpo_ext.forward.logprobs import FLOOR_FACTOR, MINIMUM_TOLERANCE

    b = bench(ctx)
    sizes = forward_sizes(ctx)
    ids, mask, width = b.batch(sizes.exactness, seed=1)
    completion = mask[:, -width:]
    real = int(mask.sum())
    longest = int(mask.sum(-1).max())
    # Three rows' worth of tokens per row, or the longest sequence: at least two packed rows either way.
    budget = max(longest + 1, -(-real // 3))
    shifted = left_padded(ids, mask, 7)
    result.update(
        {
            "batch": {
                "label": sizes.exactness.label,
                "rows": ids.size(0),
                "width": ids.size(1),
                "completion_width": width,
                "real_tokens": real,
                "padding_free_row_tokens": budget,
            },
            "floor_factor": FLOOR_FACTOR,
            "runs": [],
            "checks": {},
            "targets": {},
            "skipped": {},
        }
    )
    if not b.flash["kernels"]:
        result["skipped"][FLASH] = b.flash["reason"]
    padded_by = {}
    for attention in b.attentions():
        precisions = [True, False] if b.autocasts else [False]
        if attention == FLASH and b.flash["kernels"] != "emulated":
            precisions = [True] if b.autocasts else []  # flash kernels take 16-bit inputs only
            if not b.autocasts:
                result["skipped"][FLASH] = "flash-attention kernels take bf16 or fp16; this trainer does not autocast"
        for autocast in precisions:
            dtype = torch.bfloat16 if autocast else next(b.model.parameters()).dtype
            run = {
                "attention": attention,
                "kernels": b.kernels(attention),
                "precision": "bf16 autocast" if autocast else str(dtype).removeprefix("torch."),
                "sides": {},
            }
            with b.attention(attention), b.precision(autocast), b.row_tokens(budget), torch.no_grad():
                padded = b.logps("trl", ids, mask, width)
                padded_by[(attention, autocast)] = padded
                run["floor"] = differences(b.logps("trl", *shifted, width), padded, completion)
                tolerance = max(MINIMUM_TOLERANCE.get(dtype, 1e-2), FLOOR_FACTOR * run["floor"]["max"])
                run["tolerance"] = tolerance
                for side in ("packed", "shared"):
                    try:
                        entry = differences(b.logps(side, ids, mask, width), padded, completion)
                        entry["within_tolerance"] = entry["max"] <= tolerance
                    except Exception as error:  # noqa: BLE001 - a forward that raises is a wrong result too
                        entry = {"error": f"{type(error).__name__}: {error}"[:500], "within_tolerance": False}
                        entry.update({"max": math.inf, "p99.9": math.inf, "mean": math.inf})
                    entry["packed_rows"] = _packed_rows(b, side, ids, mask, width)
                    if side == "shared":
                        entry["shares_prompts"] = b.forward._share(b.model, compute_aux_loss=False)
                    run["sides"][side] = entry
                    name = f"{attention}_{run['precision'].replace(' ', '_')}_{side}"
                    result["checks"][f"{name}_within_tolerance"] = entry["within_tolerance"]
                    result["checks"][f"{name}_packed_rows_at_least_2"] = entry["packed_rows"] >= 2
            if attention == FLASH and ("sdpa", autocast) in padded_by:
                run["padded_against_sdpa_padded"] = differences(padded, padded_by[("sdpa", autocast)], completion)
            result["runs"].append(run)
            ctx.log(
                f"exactness: {attention}, {run['precision']}: floor {run['floor']['max']:.3g}, packed "
                f"{run['sides']['packed']['max']:.3g}, shared {run['sides']['shared']['max']:.3g} "
                f"(tolerance {tolerance:.3g})"
            )
            ctx.save()
    return result
