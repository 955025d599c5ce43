"""Padding-free log-probs (`GRPOConfigExt.padding_free`): TRL's log-prob forward without its padding.

`GRPOTrainerExt._get_per_token_logps_and_entropies` hands every log-prob forward of a step here (the policy's with
gradient, the old policy's, the reference's, LoRA's adapters-disabled reference included). Each of TRL's chunks
(`batch_size` rows) is packed (`layout.pack_rows`: real tokens only, `position_ids` restarting per sequence) and run
through the model as TRL runs it, with TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`: temperature, logit
scale and soft cap, FSDP's sharded head, the router loss), scoring exactly the completion tokens; the per-token
values are put back in TRL's `(N, C)` layout, zero where the completion mask is 0, as TRL's own are. The result is
TRL's to rounding: the same tokens, each sequence attending to itself only, at the same relative positions (rotary
embeddings see only differences of positions, so the left padding TRL adds changes nothing there).

Never silently wrong. The first forward of a run is checked against TRL's padded one (`SelfCheck`): a model whose
attention ignores `position_ids` or the packed-sequence mask (remote code, an architecture transformers does not
pack, learned absolute positions) differs, and the run falls back to TRL's padded forward with one warning naming the
model and the difference. What cannot pack falls back with one line saying why (`run_fallback_reason`,
`layout.unpackable_reason`): vision-language inputs, `use_liger_kernel`, an integer `pad_to_multiple_of` (padded
shapes asked for), TRL before 1.15 (no fused LM head), a row whose mask has a gap.

With the router loss on, a chunk is one packed row (the loss counts every token of the forward, so no tail padding
may enter it); otherwise a packed row holds at most `padding_free_row_tokens` tokens (a sequence longer than that
has a row of its own), by default `row_budget`: attention without varlen kernels (sdpa, eager) costs the square of a
row's length, so the budget is the longest row whose attention costs a token at most `ATTENTION_SHARE` of what the
model's linear layers cost it, and never less than the chunk's padded width (rows no longer than TRL's padded ones,
fewer of them, never cost more than those). A token's linear layers cost about one multiply-add per parameter
(`P`, the input embeddings left out unless tied to the LM head); its attention in a row of `L` tokens about `2 L h n`
(scores and values over `h = heads x head_dim` in each of `n` layers). Hence `L = ATTENTION_SHARE * P / (2 h n)`:
about 2,500 tokens for the 23M-parameter model of `benchmarks/forward.py`, 9,000 for Qwen2.5-1.5B. Within that
budget `layout.place_units` chooses the number and length of the packed rows (rows are padded to the longest) for
the least cost of tokens forwarded, `B * L`, plus their attention, `B * L^2 * 2 h n / P` (`attention_weight`; 0 for
varlen kernels, which attend within each sequence).

With `shared_prompt_forward` the rows of a chunk that share a prompt forward it once (`layout.pack_rows`,
`shared_prompts`), through a 4-D attention mask that keeps each completion to the prompt and itself. Where that mask
cannot be passed (`shared_fallback_reason`: flash or flex attention, sliding-window layers, the router loss, which
counts every forwarded token) the chunk packs without sharing, with one line saying why. The self-check covers the
shared layout too: a model whose attention ignores the 4-D mask packs without sharing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from .._compat import trl_has_fused_lm_head
from .layout import PackedLayout, pack_rows, row_spans, unpackable_reason

logger = logging.get_logger(__name__)

__all__ = [
    "PackedLogProbs",
    "SelfCheck",
    "attention_weight",
    "linear_parameters",
    "row_budget",
    "run_fallback_reason",
    "shared_fallback_reason",
]

#: The share of a token's linear-layer cost its attention may take in a packed row of the default budget.
ATTENTION_SHARE = 0.5

#: The attention implementations that take a prepared 4-D mask as transformers passes it (bool for sdpa, additive for
#: eager): the shared-prompt layout needs one.
MASKED_ATTENTION = ("sdpa", "eager")

#: The attention implementations (name prefixes) whose cost is each packed sequence's alone, not the packed row's.
VARLEN_ATTENTION = ("flash", "flex")


def run_fallback_reason(trainer, forward_inputs: dict[str, Any]) -> str | None:
    """Why this run's forwards cannot be packed, `None` when they can (the reasons of the module docstring that hold
    for the whole run, or for inputs with images)."""
    if getattr(trainer.args, "use_liger_kernel", False):
        return "use_liger_kernel=True replaces the model's forward"
    if isinstance(getattr(trainer.args, "pad_to_multiple_of", None), int):
        return f"pad_to_multiple_of={trainer.args.pad_to_multiple_of} asks for padded shapes"
    if any(value is not None for value in forward_inputs.values()):
        return "vision-language inputs are forwarded per row"
    if not trl_has_fused_lm_head():
        return "the installed TRL has no fused LM head (TRL 1.15 or newer packs)"
    return None


def linear_parameters(model) -> int:
    """The parameters a token's forward multiplies by (module docstring): all but the input embeddings, which are
    looked up (counted where the LM head shares them). ZeRO-3's partitioned parameters count whole (`ds_numel`)."""

    def numel(parameter) -> int:
        return getattr(parameter, "ds_numel", None) or parameter.numel()

    total = sum(numel(parameter) for parameter in model.parameters())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is not None and (head is None or head.weight is not embeddings.weight):
        total -= numel(embeddings.weight)
    return total


def attention_weight(config, parameters: int) -> float:
    """Attention's cost per attended token relative to a token's linear layers (module docstring): `2 h n / P` for a
    model with this `config` and `parameters` (`linear_parameters`); 0 where the config does not say its attention's
    size."""
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads, head_dim, parameters)):
        return 0.0
    return 2 * heads * head_dim * layers / parameters


def row_budget(config, parameters: int, padded_width: int) -> int:
    """The default token budget of a packed row (module docstring) for a model with this `config` and `parameters`
    (`linear_parameters`): `ATTENTION_SHARE / attention_weight`, at least `padded_width`; `padded_width` where the
    config does not say its attention's size."""
    weight = attention_weight(config, parameters)
    if weight == 0:
        return padded_width
    return max(padded_width, int(ATTENTION_SHARE / weight))


def shared_fallback_reason(config, compute_aux_loss: bool) -> str | None:
    """Why a forward of a model with this `config` cannot share prompts (it packs without), `None` when it can."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        return f"attn_implementation={implementation!r} takes no 4-D attention mask (sdpa and eager do)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return "the model has sliding-window or other non-full attention layers"
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return "the model has a sliding attention window"
    if compute_aux_loss:
        return "the router loss counts every forwarded token, a shared prompt once instead of once per completion"
    return None


@dataclass
class SelfCheck:
    """The packed forward against TRL's padded one, once per run, on a few rows of the first forward.

    The check rows (`check_rows`) are the first rows' real tokens, all in one packed row (so that a model whose
    attention crosses sequences differs), their padded copies with three extra columns of left padding (so that a
    model that reads absolute positions differs even where the batch has no padding). `tolerance` is on the largest
    absolute log-prob difference over the completion tokens: 1e-4 in float32, 0.1 in half precision.
    """

    rows: int = 3
    done: bool = False
    passed: bool = True
    difference: float = 0.0
    #: the shared-prompt layout's check (its rows add a completion of the first prompt): `None` when not checked
    shared_passed: bool | None = None
    shared_difference: float = 0.0

    @staticmethod
    def tolerance(dtype: torch.dtype) -> float:
        return 1e-4 if dtype == torch.float32 else 1e-1

    def check_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, pad_id: int):
        """`(input_ids, attention_mask, logits_to_keep)` of the check: each of the first `rows` rows' real tokens, the
        first as a prompt and the rest as a completion (at least one token each), then the first row's prompt with the
        last row's completion (so that a shared prompt has two completions), left-padded by three more columns than
        needed."""
        prompt_width = attention_mask.size(1) - logits_to_keep
        sequences = []
        for i in range(min(self.rows, input_ids.size(0))):
            real = input_ids[i][attention_mask[i].bool()]
            prompt = int(attention_mask[i, :prompt_width].sum())
            if real.numel() >= 2:
                prompt = min(max(prompt, 1), real.numel() - 1)
                sequences.append((real[:prompt], real[prompt:]))
        if not sequences:  # rows of fewer than 2 real tokens: any two tokens still tell packing from padding
            sequences = [(input_ids.new_tensor([pad_id]), input_ids.new_tensor([pad_id]))]
        sequences.append((sequences[0][0], sequences[-1][1]))
        prompt_width = max(len(p) for p, _ in sequences) + 3
        completion_width = max(len(c) for _, c in sequences)
        ids = input_ids.new_full((len(sequences), prompt_width + completion_width), pad_id)
        mask = torch.zeros_like(ids)
        for i, (prompt, completion) in enumerate(sequences):
            ids[i, prompt_width - len(prompt) : prompt_width] = prompt
            ids[i, prompt_width : prompt_width + len(completion)] = completion
            mask[i, prompt_width - len(prompt) : prompt_width + len(completion)] = 1
        return ids, mask, completion_width


class PackedLogProbs:
    """The padding-free log-prob forward of a trainer (module docstring).

    Args:
        trainer (`GRPOTrainerExt`): the trainer whose forwards this computes (its model, accelerator, TRL hook).
        enabled (`bool`): `padding_free`.
        row_tokens (`int` or `None`): `padding_free_row_tokens` (`None`: each chunk's padded width).
        shared_prompts (`bool`): `shared_prompt_forward`.
    """

    def __init__(self, trainer, enabled: bool, row_tokens: int | None, shared_prompts: bool = False):
        self.trainer = trainer
        self.enabled = enabled
        self.row_tokens = row_tokens
        self.shared_prompts = shared_prompts
        self._parameters: int | None = None  # linear_parameters of the model, for the default row budget
        self.self_check = SelfCheck()
        self._said: set[str] = set()

    def _fall_back(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            # The installed TRL is no mistake of the user's: said at info level; every other reason is a warning.
            say = logger.info if "installed TRL" in reason else logger.warning
            say(f"padding_free=True: this forward runs padded, as TRL runs it, because {reason}.")

    def _share(self, model, compute_aux_loss: bool) -> bool:
        """Whether this forward shares prompts (`shared_prompt_forward`, where the model allows it: said once)."""
        if not self.shared_prompts:
            return False
        config = getattr(self.trainer.accelerator.unwrap_model(model), "config", None)
        reason = shared_fallback_reason(config, compute_aux_loss)
        if reason is None and self.self_check.shared_passed is False:
            return False  # warned once by the self-check
        if reason is not None:
            if reason not in self._said:
                self._said.add(reason)
                logger.warning(f"shared_prompt_forward=True: this forward packs without sharing prompts: {reason}.")
            return False
        return True

    def __call__(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        forward_inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """Per-token log-probs `(N, C)`, entropies `(N, C)` (or `None`) and the router loss (0-dim, or `None`), as
        TRL's hook returns them; `None` where this forward must run padded (said once per reason)."""
        if not self.enabled:
            return None
        reason = run_fallback_reason(self.trainer, forward_inputs)
        if reason is None and not self.self_check.done:
            self._run_self_check(model, input_ids, attention_mask, logits_to_keep)
        if reason is None and not self.self_check.passed:
            return None  # warned once by the self-check
        share = reason is None and self._share(model, compute_aux_loss)
        batch_size = batch_size or input_ids.size(0)
        chunks = []
        for start in range(0, input_ids.size(0), batch_size):
            chunk = slice(start, start + batch_size)
            # One host synchronisation per chunk.
            spans = row_spans(attention_mask[chunk], logits_to_keep, input_ids[chunk] if share else None)
            reason = reason or unpackable_reason(spans, attention_mask.size(1) - logits_to_keep)
            chunks.append((chunk, spans))
        if reason is not None:
            self._fall_back(reason)
            return None
        logps, entropies, aux_losses = [], [], []
        for chunk, spans in chunks:
            out = self._forward_chunk(
                model,
                input_ids[chunk],
                attention_mask[chunk],
                logits_to_keep,
                compute_entropy,
                compute_aux_loss,
                spans,
                share,
            )
            logps.append(out[0])
            entropies.append(out[1])
            aux_losses.append(out[2])
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _forward_chunk(
        self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss, spans, share
    ):
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if self._parameters is None:  # counted once: the model's size does not change
            self._parameters = linear_parameters(unwrapped)
        config = getattr(unwrapped, "config", None)
        # Varlen kernels attend within each sequence: a packed row's length costs no attention there.
        varlen = str(getattr(config, "_attn_implementation", None)).startswith(VARLEN_ATTENTION)
        row_tokens = self.row_tokens
        if row_tokens is None:
            row_tokens = row_budget(config, self._parameters, input_ids.size(1))
        if compute_aux_loss:
            row_tokens = None
        layout = pack_rows(
            input_ids,
            attention_mask,
            logits_to_keep,
            row_tokens,
            spans,
            shared_prompts=share,
            attention_weight=0.0 if varlen else attention_weight(config, self._parameters),
        )
        outputs = self._model_forward(model, layout, compute_aux_loss)
        scored = layout.keep[:, :-1]  # the fused head scores token t + 1 at position t: (B, L - 1)
        shape = (input_ids.size(0), logits_to_keep)
        logps = layout.unpack(outputs.log_probs[scored], shape)
        entropies = None
        if compute_entropy:
            entropies = layout.unpack(outputs.entropy[scored], shape)
        return logps, entropies, outputs.aux_loss if compute_aux_loss else None

    def _model_forward(self, model, layout: PackedLayout, compute_aux_loss: bool):
        labels = torch.full_like(layout.input_ids, -100)
        labels[:, 1:][layout.keep[:, :-1]] = layout.targets
        inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids, "use_cache": False}
        if layout.branches is not None:
            inputs["attention_mask"] = self._attention_mask(model, layout)
        if compute_aux_loss:
            inputs["output_router_logits"] = True
        with self.trainer.accelerator.autocast():
            return model(**inputs, labels=labels, fused_lm_head=True)

    def _attention_mask(self, model, layout: PackedLayout) -> torch.Tensor:
        """`layout.attention()` as the model's attention takes a prepared 4-D mask: bool for sdpa; for eager, additive
        in the dtype of its embeddings (0 where attended, the dtype's lowest value elsewhere), as transformers builds
        its own."""
        mask = layout.attention()
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if unwrapped.config._attn_implementation == "sdpa":
            return mask
        dtype = unwrapped.get_input_embeddings().weight.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    def _run_self_check(self, model, input_ids, attention_mask, logits_to_keep) -> None:
        check = self.self_check
        check.done = True
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids, mask, width = check.check_rows(input_ids, attention_mask, logits_to_keep, pad_id)
        was_training = model.training
        model.eval()  # no dropout: both forwards see the same weights and the same computation
        try:
            with torch.no_grad():
                padded, _, _ = self.trainer._stock_logps_and_entropies(model, ids, mask, width)

                def difference(shared_prompts: bool) -> float:
                    layout = pack_rows(ids, mask, width, row_tokens=None, shared_prompts=shared_prompts)
                    outputs = self._model_forward(model, layout, compute_aux_loss=False)
                    packed = layout.unpack(outputs.log_probs[layout.keep[:, :-1]], padded.shape)
                    largest = (packed - padded).abs().masked_fill(~mask[:, -width:].bool(), 0).amax().float()
                    return float(largest) if torch.isfinite(largest) else float("inf")

                check.difference = difference(shared_prompts=False)
                share = (
                    self.shared_prompts
                    and shared_fallback_reason(
                        getattr(self.trainer.accelerator.unwrap_model(model), "config", None), compute_aux_loss=False
                    )
                    is None
                )
                if share:
                    check.shared_difference = difference(shared_prompts=True)
        finally:
            model.train(was_training)
        # Each process decides on its own rows, without a collective: either way its log-probs are exact, and every
        # path runs one model forward per chunk, so that sharded engines gather their parameters alike.
        dtype = getattr(self.trainer.model, "dtype", torch.float32)
        tolerance = SelfCheck.tolerance(dtype)
        check.passed = check.difference <= tolerance
        name = getattr(getattr(self.trainer.model, "config", None), "_name_or_path", "") or type(model).__name__
        if share and check.passed:
            check.shared_passed = check.shared_difference <= tolerance
            if not check.shared_passed:
                logger.warning(
                    f"shared_prompt_forward=True: the shared-prompt forward of {name} differs from the padded one by "
                    f"{check.shared_difference:.3g} in log-prob (tolerance {tolerance:g}); its attention probably "
                    "ignores the 4-D attention mask. This run packs without sharing prompts."
                )
        if check.passed:
            logger.info(f"padding_free=True: packed log-probs match the padded ones (to {check.difference:.2e}).")
        else:
            logger.warning(
                f"padding_free=True: the packed forward of {name} differs from the padded one by "
                f"{check.difference:.3g} in log-prob (tolerance {tolerance:g}); its attention "
                "probably ignores position_ids or the packed-sequence mask. This run forwards padded, as TRL does."
            )
