"""Padding-free log-probs (`GRPOConfigExt.padding_free`): every log-prob forward of a step (policy, old policy,
reference) as TRL runs it, on packed rows without padding (`layout.pack_rows`), prompts shared where
`shared_prompt_forward` allows (`shared_fallback_reason`), each attention implementation told how to keep the packed
sequences apart (`attention`), through TRL's fused LM head, the values put back in TRL's `(N, C)` layout.

Never silently wrong: the first forward of a run is checked against TRL's padded one (`SelfCheck`), and what cannot
pack falls back to TRL's padded forward with one line saying why (`run_fallback_reason`, `layout.unpackable_reason`).
Rows: one per chunk where attention runs within sequences, no longer than TRL's padded ones under a dense mask unless
their attention is a small part of the cost (`default_row_tokens`). The router loss counts every forwarded token: a
forward that computes it is one packed row without a tail, or padded. docs/performance.md, "The log-prob forward".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from .._compat import trl_has_fused_lm_head
from .attention import (
    DENSE,
    FLEX,
    KEYWORD,
    VARLEN,
    attention_kind,
    install_packed_attention,
    length_dependent_rope,
    sliding_window_layers,
)
from .layout import PackedLayout, RowSpan, pack_rows, row_spans, unpackable_reason

logger = logging.get_logger(__name__)

__all__ = [
    "PackedLogProbs",
    "SelfCheck",
    "attention_weight",
    "default_row_tokens",
    "dense_attention_weight",
    "linear_parameters",
    "run_fallback_reason",
    "shared_fallback_reason",
]


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
    """The parameters a token's forward multiplies by: all but the input embeddings, which are looked up (counted
    where the LM head shares them). ZeRO-3's partitioned parameters count whole (`ds_numel`)."""

    def numel(parameter) -> int:
        return getattr(parameter, "ds_numel", None) or parameter.numel()

    total = sum(numel(parameter) for parameter in model.parameters())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is not None and (head is None or head.weight is not embeddings.weight):
        total -= numel(embeddings.weight)
    return total


def attention_weight(config, parameters: int) -> float:
    """Attention's cost per attended token relative to a token's linear layers, `2 h n / P` (scores and values over
    `h = heads x head_dim` in each of `n` layers, against about one multiply-add per parameter `P`,
    `linear_parameters`), for a model with this `config`; 0 where the config does not say its attention's size.
    `layout.place_units` weighs a dense mask's rows with it."""
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads, head_dim, parameters)):
        return 0.0
    return 2 * heads * head_dim * layers / parameters


def dense_attention_weight(config, parameters: int) -> float:
    """`attention_weight` over a dense mask, at its measured-slower speed (`MASKED_ATTENTION_COST`)."""
    return MASKED_ATTENTION_COST * attention_weight(config, parameters)


#: What an attended token over a dense mask costs, in multiples of its multiply-adds at the linear layers' speed:
#: masked attention kernels (sdpa's with a mask, eager) run far below a matrix product's throughput (the GPU check's
#: `attention` section measures the ratio). Conservative, so that a longer row than the padded one is chosen only
#: where its attention is a small part of the work (short sequences, as in the demo).
MASKED_ATTENTION_COST = 8.0
#: The share of a token's linear-layer cost its dense-mask attention may take in a row longer than the padded one.
ATTENTION_SHARE = 0.5


def default_row_tokens(kind: str | None, padded_width: int, weight: float = 0.0) -> int | None:
    """The default token budget of a packed row (module docstring): `None` (one row) where attention runs within
    sequences (`VARLEN`, `FLEX`); over a dense mask, the chunk's padded width, or the longest row whose attention
    costs a token at most `ATTENTION_SHARE` of its linear layers where that is longer (`weight`: the attention's cost
    per attended token relative to the linear layers', `dense_attention_weight`)."""
    if kind in (VARLEN, FLEX):
        return None
    return max(padded_width, int(ATTENTION_SHARE / weight)) if weight > 0 else padded_width


_FROM_CONFIG = object()


def shared_fallback_reason(config, compute_aux_loss: bool, kind=_FROM_CONFIG) -> str | None:
    """Why a forward of a model with this `config`, whose attention is of `kind` (`attention.attention_kind`; by
    default read from the config alone), cannot share prompts (it packs without), `None` when it can."""
    if kind is _FROM_CONFIG:
        kind = attention_kind(config)
    implementation = getattr(config, "_attn_implementation", None)
    if kind is None:
        return f"attn_implementation={implementation!r} is not one this package shares prompts with"
    if compute_aux_loss:
        return "the router loss counts every forwarded token, a shared prompt once instead of once per completion"
    if kind == VARLEN:
        return None  # boundaries per segment: sliding windows and router logits apply per sequence
    if sliding_window_layers(config):
        return f"the model has sliding-window layers, which a {implementation} mask of shared prompts would not keep"
    if getattr(config, "output_router_logits", False):
        return f"the model computes its router loss from the attention mask, which {implementation} would get as 4-D"
    return None


#: The smallest tolerance of the self-check, on the largest absolute log-prob difference, per computing dtype: above
#: what rounding alone gives on the tests' tiny model (1e-3 in bfloat16, 5e-7 in float32), below what that random
#: model differs by where a completion attends to its siblings (about 0.018 at either precision; the demo's trained
#: model, by about 4). Where the padded forward's own noise is larger, the tolerance follows it (`FLOOR_FACTOR`).
MINIMUM_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: The tolerance as a multiple of the padded forward's own noise (`SelfCheck.floor`).
FLOOR_FACTOR = 4.0
#: The most the padded forward may move with its left padding alone, per computing dtype: beyond it the model reads
#: absolute positions (learned position embeddings), which the packed layout restarts at 0 for every sequence.
MAXIMUM_FLOOR = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


@dataclass
class SelfCheck:
    """The packed forward against TRL's padded one, once per run, on a few rows of the first forward (module
    docstring).

    The check rows (`check_sequences`): two prompts with two completions each, truncated to at most `tokens` tokens
    each, left-padded by three more columns than needed (`padded`). The packed side runs through the training path,
    in at least two packed rows. `floor` is the padded forward's own noise: the same rows without the three columns
    (rounding moves with the positions, as it does in the packed rows, which start each sequence at 0). The
    `tolerance` is `FLOOR_FACTOR` times it, at least `MINIMUM_TOLERANCE` of the dtype the forward computes in (`dtype`:
    autocast's where it is on, else the weights'); a floor above `MAXIMUM_FLOOR` is a model that reads absolute
    positions, which no packed layout reproduces.
    """

    tokens: int = 32
    done: bool = False
    passed: bool = True
    difference: float = 0.0
    floor: float = 0.0
    tolerance: float = 0.0
    dtype: torch.dtype | None = None
    #: why the check failed, for the warning
    cause: str = ""
    #: the shared-prompt layout's check: `None` when not checked
    shared_passed: bool | None = None
    shared_difference: float = 0.0

    def check_sequences(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, pad_id: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (prompt, completion) pairs of the check (class docstring), from the first rows' real tokens: the first
        row's prompt and another (the first that differs, else the first reversed), each with the first and last
        rows' completions."""
        prompt_width = attention_mask.size(1) - logits_to_keep
        found = []
        for i in range(min(4, input_ids.size(0))):
            real = input_ids[i][attention_mask[i].bool()]
            prompt = int(attention_mask[i, :prompt_width].sum())
            if real.numel() >= 2:
                prompt = min(max(prompt, 1), real.numel() - 1)
                found.append((real[:prompt][-self.tokens :], real[prompt:][: self.tokens]))
        if not found:  # rows of fewer than 2 real tokens: any tokens still tell packing from padding
            found = [(input_ids.new_tensor([pad_id, pad_id]), input_ids.new_tensor([pad_id]))]
        first = found[0]
        other = next((p for p, _ in found if not torch.equal(p, first[0])), first[0].flip(0))
        completions = (first[1], found[-1][1] if len(found) > 1 else first[1].flip(0))
        return [
            (first[0], completions[0]),
            (first[0], completions[1]),
            (other, completions[1]),
            (other, completions[0]),
        ]

    @staticmethod
    def padded(sequences, pad_id: int, extra: int):
        """`(input_ids, attention_mask, logits_to_keep)` of `sequences` as TRL pads them, with `extra` more columns
        of left padding."""
        prompt_width = max(len(p) for p, _ in sequences) + extra
        completion_width = max(len(c) for _, c in sequences)
        ids = sequences[0][0].new_full((len(sequences), prompt_width + completion_width), pad_id)
        mask = torch.zeros_like(ids)
        for i, (prompt, completion) in enumerate(sequences):
            ids[i, prompt_width - len(prompt) : prompt_width] = prompt
            ids[i, prompt_width : prompt_width + len(completion)] = completion
            mask[i, prompt_width - len(prompt) : prompt_width + len(completion)] = 1
        return ids, mask, completion_width

    def judge(self, dtype: torch.dtype) -> None:
        """Set `tolerance`, `passed` and `cause` from `difference` and `floor` at `dtype`."""
        self.dtype = dtype
        minimum = MINIMUM_TOLERANCE.get(dtype, MINIMUM_TOLERANCE[torch.bfloat16])
        self.tolerance = max(minimum, FLOOR_FACTOR * self.floor)
        if self.floor > MAXIMUM_FLOOR.get(dtype, MAXIMUM_FLOOR[torch.bfloat16]):
            self.passed = False
            self.cause = (
                f"its padded log-probs move by {self.floor:.3g} with three columns of left padding alone: the model "
                "reads absolute positions, which a packed row restarts at 0 for every sequence"
            )
        else:
            self.passed = self.difference <= self.tolerance
            self.cause = "its attention does not keep packed sequences apart, or its positions are not relative"
        if self.shared_passed is not None:
            self.shared_passed = self.passed and self.shared_difference <= self.tolerance

    def describe(self) -> str:
        precision = str(self.dtype).removeprefix("torch.")
        return (
            f"tolerance {self.tolerance:.2g} at {precision}: {FLOOR_FACTOR:g} times the padded forward's own noise "
            f"under other left padding, {self.floor:.2g}, at least {MINIMUM_TOLERANCE.get(self.dtype, 0):.2g}"
        )


def _largest_difference(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    largest = (a.float() - b.float()).abs().masked_fill(~mask.bool(), 0).amax()
    return float(largest) if torch.isfinite(largest) else float("inf")


class PackedLogProbs:
    """The padding-free log-prob forward of a trainer (module docstring).

    Args:
        trainer (`GRPOTrainerExt`): the trainer whose forwards this computes (its model, accelerator, TRL hook).
        enabled (`bool`): `padding_free`.
        row_tokens (`int` or `None`): `padding_free_row_tokens` (`None`: `default_row_tokens`).
        shared_prompts (`bool`): `shared_prompt_forward`.
    """

    def __init__(self, trainer, enabled: bool, row_tokens: int | None, shared_prompts: bool = False):
        self.trainer = trainer
        self.enabled = enabled
        self.row_tokens = row_tokens
        self.shared_prompts = shared_prompts
        self._parameters: int | None = None  # linear_parameters of the model, for place_units' cost of attention
        self.self_check = SelfCheck()
        self._said: set[str] = set()
        self._kinds: dict[tuple, str | None] = {}  # attention kind per model (`kind`)

    def _say(self, message: str, warn: bool = True) -> None:
        if message not in self._said:
            self._said.add(message)
            (logger.warning if warn else logger.info)(message)

    def _fall_back(self, reason: str) -> None:
        # The installed TRL is no mistake of the user's: said at info level; every other reason is a warning.
        message = f"padding_free=True: this forward runs padded, as TRL runs it, because {reason}."
        self._say(message, warn="installed TRL" not in reason)

    def _config(self, model):
        return getattr(self.trainer.accelerator.unwrap_model(model), "config", None)

    def _share(self, model, compute_aux_loss: bool) -> bool:
        """Whether this forward shares prompts (`shared_prompt_forward`, where the model allows it: said once)."""
        if not self.shared_prompts:
            return False
        reason = shared_fallback_reason(self._config(model), compute_aux_loss, self.kind(model))
        if reason is not None:
            self._say(f"shared_prompt_forward=True: this forward packs without sharing prompts: {reason}.")
            return False
        return self.self_check.shared_passed is not False  # a failed check warned once

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
            self._run_self_check(input_ids, attention_mask, logits_to_keep)
        if reason is None and not self.self_check.passed:
            return None  # warned once by the self-check
        share = reason is None and self._share(model, compute_aux_loss)
        batch_size = batch_size or input_ids.size(0)
        chunks = []
        for start in range(0, input_ids.size(0), batch_size):
            chunk = slice(start, start + batch_size)
            # The one host synchronisation of a chunk: each row's span (and prompt leader).
            spans = row_spans(attention_mask[chunk], logits_to_keep, input_ids[chunk] if share else None)
            reason = reason or unpackable_reason(spans, attention_mask.size(1) - logits_to_keep)
            if reason is None and compute_aux_loss:
                reason = self._router_loss_reason(model, spans, attention_mask.size(1))
            chunks.append((chunk, spans))
        if reason is not None:
            self._fall_back(reason)
            return None
        logps, entropies, aux_losses = [], [], []
        for chunk, spans in chunks:
            # With the router loss: one row without a tail (`_router_loss_reason` bounded it).
            row_tokens = 0 if compute_aux_loss else -1
            layout = self.layout(
                model, input_ids[chunk], attention_mask[chunk], logits_to_keep, spans, share, row_tokens
            )
            outputs = self._model_forward(model, layout, compute_aux_loss)
            shape = (input_ids[chunk].size(0), logits_to_keep)
            logps.append(layout.unpack(layout.scores(outputs.log_probs), shape))
            if compute_entropy:
                entropies.append(layout.unpack(layout.scores(outputs.entropy), shape))
            aux_losses.append(outputs.aux_loss)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _router_loss_reason(self, model, spans: list[RowSpan], padded_width: int) -> str | None:
        """Why a forward that computes the router loss cannot pack these rows: one row without a tail, no longer than
        a dense mask's budget (module docstring)."""
        config = self._config(model)
        if length_dependent_rope(config):
            return "the router loss would count the token that gives the rotary embeddings the padded width"
        kind = self.kind(model)
        tokens = sum(span.tokens for span in spans)
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if self._parameters is None:
            self._parameters = linear_parameters(unwrapped)
        weight = 0.0 if kind in (VARLEN, FLEX) else dense_attention_weight(config, self._parameters)
        budget = self.row_tokens or default_row_tokens(kind, padded_width, weight)
        if budget is not None and tokens > budget:
            return (
                f"the router loss needs a chunk's {tokens} tokens in one packed row, longer than the "
                f"{budget} tokens a row of {kind or 'this'} attention may hold"
            )
        return None

    def layout(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        spans: list[RowSpan],
        share: bool,
        row_tokens: int | None = -1,
        fill: bool = False,
    ) -> PackedLayout:
        """The packed layout of a chunk for `model`: `row_tokens` `-1` for the run's budget
        (`padding_free_row_tokens` or `default_row_tokens`), `None` or `0` for one row; `fill`: rows filled up to it
        whatever their attention costs (the self-check's several sequences per row)."""
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        kind = self.kind(model)
        width = attention_mask.size(1)
        weight = 0.0
        if kind not in (VARLEN, FLEX):
            if self._parameters is None:  # counted once: the model's size does not change
                self._parameters = linear_parameters(unwrapped)
            weight = dense_attention_weight(config, self._parameters)
        if row_tokens == -1:
            row_tokens = self.row_tokens or default_row_tokens(kind, width, weight)
        return pack_rows(
            input_ids,
            attention_mask,
            logits_to_keep,
            row_tokens or None,
            spans,
            shared_prompts=share,
            attention_weight=0.0 if fill else weight,
            anchor_position=width - 1 if length_dependent_rope(config) else None,
        )

    def _model_forward(self, model, layout: PackedLayout, compute_aux_loss: bool):
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        kind = self.kind(model)
        inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids, "use_cache": False}
        if kind == VARLEN:
            install_packed_attention(unwrapped.config._attn_implementation)
            inputs[KEYWORD] = layout.segments
        elif kind == FLEX:
            inputs["attention_mask"] = layout.block_mask()
        elif kind == DENSE and layout.shared_prompts:
            inputs["attention_mask"] = self._dense_mask(unwrapped, layout)
        if compute_aux_loss:
            inputs["output_router_logits"] = True
        with self.trainer.accelerator.autocast():
            return model(**inputs, labels=layout.labels(), fused_lm_head=True)

    @staticmethod
    def _dense_mask(unwrapped, layout: PackedLayout) -> torch.Tensor:
        """`layout.attention()` as the model's attention takes a prepared 4-D mask: bool for sdpa; for eager, additive
        in the dtype of its embeddings (0 where attended, the dtype's lowest value elsewhere), as transformers builds
        its own."""
        mask = layout.attention()
        if unwrapped.config._attn_implementation == "sdpa":
            return mask
        dtype = unwrapped.get_input_embeddings().weight.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    def compute_dtype(self, model) -> torch.dtype:
        """The dtype `model`'s forward computes in: autocast's where the accelerator turns it on, else the weights'."""
        device = self.trainer.accelerator.device.type
        with self.trainer.accelerator.autocast():
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
        parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
        return parameter.dtype if parameter is not None else torch.float32

    def kind(self, model) -> str | None:
        """The attention kind of `model`'s packed forwards (`attention.attention_kind`), found once per model."""
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        key = id(unwrapped), getattr(getattr(unwrapped, "config", None), "_attn_implementation", None)
        if key not in self._kinds:
            device = self.trainer.accelerator.device.type
            self._kinds[key] = attention_kind(getattr(unwrapped, "config", None), device, self.compute_dtype(model))
        return self._kinds[key]

    def _run_self_check(self, input_ids, attention_mask, logits_to_keep) -> None:
        check = self.self_check
        check.done = True
        model = self.trainer.model  # the policy, whichever model the first forward is for
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        sequences = check.check_sequences(input_ids, attention_mask, logits_to_keep, pad_id)
        ids, mask, width = check.padded(sequences, pad_id, extra=3)
        completion = mask[:, -width:]
        # Two rows or more, several sequences in each: the training layout's boundaries between rows and within them.
        two_rows = -(-int(mask.sum()) // 2)
        share = self.shared_prompts and shared_fallback_reason(self._config(model), False, self.kind(model)) is None
        was_training = model.training
        model.eval()  # no dropout: both forwards see the same weights and the same computation
        try:
            with torch.no_grad():
                padded, _, _ = self.trainer._stock_logps_and_entropies(model, ids, mask, width)
                tight, _, _ = self.trainer._stock_logps_and_entropies(model, *check.padded(sequences, pad_id, 0))
                check.floor = _largest_difference(tight, padded, completion)

                def difference(share: bool) -> float:
                    spans = row_spans(mask, width, ids if share else None)
                    layout = self.layout(model, ids, mask, width, spans, share, row_tokens=two_rows, fill=True)
                    outputs = self._model_forward(model, layout, compute_aux_loss=False)
                    packed = layout.unpack(layout.scores(outputs.log_probs), padded.shape)
                    return _largest_difference(packed, padded, completion)

                check.difference = difference(share=False)
                if share:
                    check.shared_passed = True  # judged below
                    check.shared_difference = difference(share=True)
        finally:
            model.train(was_training)
        # Each process decides on its own rows, without a collective: either way its log-probs are exact, and every
        # path runs one model forward per chunk, so that sharded engines gather their parameters alike.
        check.judge(self.compute_dtype(model))
        self._report_self_check(model)

    def _report_self_check(self, model) -> None:
        check = self.self_check
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        implementation = getattr(self._config(model), "_attn_implementation", None)
        if not check.passed:
            logger.warning(
                f"padding_free=True: the packed forward of {name} ({implementation} attention) differs from the "
                f"padded one by {check.difference:.3g} in log-prob ({check.describe()}): {check.cause}. This run "
                "forwards padded, as TRL does."
            )
        elif check.shared_passed is False:
            logger.warning(
                f"shared_prompt_forward=True: the shared-prompt forward of {name} ({implementation} attention) "
                f"differs from the padded one by {check.shared_difference:.3g} in log-prob ({check.describe()}): "
                "its attention does not keep a completion to its prompt and itself. This run packs without sharing "
                "prompts."
            )
        else:
            shared = f", shared prompts {check.shared_difference:.2g}" if check.shared_passed else ""
            logger.info(
                f"padding_free=True: packed log-probs of {name} ({implementation} attention) match the padded ones: "
                f"largest difference {check.difference:.2g}{shared} ({check.describe()})."
            )
