"""Where the tokens of a log-prob forward go: TRL's padded layout, counted, and the packed layout that replaces it.

TRL's `_get_per_token_logps_and_entropies` forwards `input_ids` of shape `(N, P + C)`: each row a prompt left-padded
to the longest prompt `P`, then its completion right-padded to the longest completion `C`, and each of a prompt's
`num_generations` rows repeats its prompt. For row `i` with `p_i` prompt and `c_i` completion tokens:

    forwarded  = N * (P + C)
    padding    = forwarded - sum_i (p_i + c_i)
    repeated   = sum_i p_i * [an earlier row of the chunk has the same prompt]
    distinct   = sum_i (p_i + c_i) - repeated

`forward_counts` computes these on the device (no host synchronisation: they are logged as `forward/*` for every
run, whatever the options). `pack_rows` builds the padding-free layout: each row's real tokens `[s_i, e_i)` (a
contiguous span of the padded row) laid end to end in as few packed rows as `row_tokens` allows, `position_ids`
restarting at 0 for each sequence, so that transformers' attention keeps the sequences apart (the packed-sequence
mask it derives from `position_ids` for sdpa, eager and flex attention, varlen kernels for flash-attention).

The logit that scores completion token `j` of row `i` (padded column `P + j`) is the one at the token before it,
padded column `P + j - 1`, packed position `o_i + P + j - 1 - s_i` in packed row `r_i`: `PackedLayout.keep` marks
these positions, in the order of the flattened `(i, j)` pairs of the completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORWARD_METRICS",
    "ForwardCounts",
    "PackedLayout",
    "forward_counts",
    "pack_rows",
    "row_spans",
    "unpackable_reason",
]


@dataclass(frozen=True)
class ForwardCounts:
    """Token counts of one padded forward (0-dim tensors on the input's device)."""

    forwarded: torch.Tensor  #: tokens TRL's padded layout forwards, `N * (P + C)`
    padding: torch.Tensor  #: of which padding
    repeated_prompt: torch.Tensor  #: of which prompt tokens already forwarded for an earlier row of the same prompt
    distinct: torch.Tensor  #: real tokens, each prompt counted once

    def metrics(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The `forward/*` metrics as `(sum, count)` pairs, so that a log step's value weighs every token once."""
        return {
            "forward/padding_fraction": (self.padding, self.forwarded),
            "forward/repeated_prompt_fraction": (self.repeated_prompt, self.forwarded),
            "forward/tokens_per_distinct": (self.forwarded, self.distinct),
        }


#: The metric names of `ForwardCounts.metrics`, in the order they are logged.
FORWARD_METRICS = ("forward/padding_fraction", "forward/repeated_prompt_fraction", "forward/tokens_per_distinct")


def first_of_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """`(N,)` bool: row `i` is the first of the rows with its prompt (its tokens compared, not its place).

    Args:
        prompt_ids (`torch.Tensor` of shape `(N, P)`), prompt_mask (`torch.Tensor` of shape `(N, P)`): left-padded.
    """
    tokens = prompt_ids.masked_fill(prompt_mask == 0, -1)
    same = (tokens[:, None, :] == tokens[None, :, :]).all(-1)  # (N, N)
    earlier = torch.ones_like(same).tril(-1)
    return ~(same & earlier).any(-1)


def forward_counts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor
) -> ForwardCounts:
    """The token counts of TRL's padded forward of these rows (module docstring), computed on their device.

    Args:
        prompt_ids (`torch.Tensor` of shape `(N, P)`), prompt_mask (`torch.Tensor` of shape `(N, P)`),
        completion_mask (`torch.Tensor` of shape `(N, C)`): the rows as TRL passes them to the forward.
    """
    prompt_tokens = prompt_mask.sum(-1)  # (N,)
    real = prompt_tokens.sum() + completion_mask.sum()
    forwarded = torch.tensor(prompt_mask.numel() + completion_mask.numel(), device=prompt_mask.device)
    repeated = (prompt_tokens * ~first_of_prompt(prompt_ids, prompt_mask)).sum()
    return ForwardCounts(
        forwarded=forwarded.float(),
        padding=(forwarded - real).float(),
        repeated_prompt=repeated.float(),
        distinct=(real - repeated).float(),
    )


def row_spans(attention_mask: torch.Tensor, logits_to_keep: int) -> list[tuple[int, int, int, int]]:
    """Each row's `(first real column, real tokens, completion tokens, last real column)`, read from the device in
    one host synchronisation (the only one of a packed forward's layout).

    Args:
        attention_mask (`torch.Tensor` of shape `(N, P + C)`), logits_to_keep (`int`): `C`.
    """
    mask = attention_mask.bool()
    width = mask.size(1)
    columns = torch.arange(width, device=mask.device)
    first = torch.where(mask, columns, width).amin(-1)
    last = torch.where(mask, columns, -1).amax(-1)
    spans = torch.stack([first, mask.sum(-1), mask[:, width - logits_to_keep :].sum(-1), last], dim=-1)
    return [tuple(span) for span in spans.tolist()]


def unpackable_reason(spans: list[tuple[int, int, int, int]], prompt_width: int) -> str | None:
    """Why rows with these `row_spans` cannot be packed exactly, `None` when they can.

    A row packs when its real tokens (mask 1) are one contiguous span that holds at least one prompt token: a gap
    inside a row (a token the padded forward hides from the ones after it) would move the positions of the tokens
    after it, and a completion without a prompt token before it has no logit to be scored from.

    Args:
        spans: `row_spans(attention_mask, C)`; prompt_width (`int`): `P`.
    """
    if any(count > 0 and last - first + 1 != count for first, count, _, last in spans):
        return "a row's attention mask has a gap between real tokens"
    if any(first >= prompt_width for first, _, _, _ in spans):
        return "a row has no prompt token"
    return None


@dataclass(frozen=True)
class PackedLayout:
    """The padding-free layout of `N` padded rows (`pack_rows`); index tensors live on the rows' device."""

    input_ids: torch.Tensor  #: `(B, L)` the real tokens end to end, 0 after the last sequence of a packed row
    position_ids: torch.Tensor  #: `(B, L)` restarting at 0 for each sequence (and for the tail after the last)
    keep: torch.Tensor  #: `(B, L)` bool: the positions whose logits score a completion token
    targets: torch.Tensor  #: `(K,)` the completion tokens these logits score, in `keep`'s row-major order
    rows: torch.Tensor  #: `(K,)` the padded row of each scored token
    columns: torch.Tensor  #: `(K,)` its column in the completion, `0 <= j < C`
    num_sequences: int  #: `N`

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """`values` `(K,)` placed at their `(row, column)` in a zero tensor of `shape` `(N, C)`."""
        out = values.new_zeros(shape)
        return out.index_put((self.rows, self.columns), values)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    row_tokens: int | None,
    spans: list[tuple[int, int, int, int]] | None = None,
) -> PackedLayout:
    """Lay the real tokens of padded rows end to end (module docstring), in order, a new packed row whenever the
    next sequence would take one past `row_tokens` tokens (`None`: one packed row). A sequence longer than
    `row_tokens` gets a row of its own. Rows must pack (`unpackable_reason` is `None`).

    One host synchronisation (`row_spans`, unless `spans` are given): the index tensors are built from them.

    Args:
        input_ids (`torch.Tensor` of shape `(N, P + C)`), attention_mask (`torch.Tensor` of shape `(N, P + C)`):
            prompts left-padded, completions right-padded, as TRL builds them.
        logits_to_keep (`int`): `C`, the completion width.
        row_tokens (`int` or `None`): the token budget of a packed row.
        spans: `row_spans(attention_mask, logits_to_keep)`, when already read.
    """
    device = input_ids.device
    width = attention_mask.size(1)
    prompt_width = width - logits_to_keep
    spans = row_spans(attention_mask, logits_to_keep) if spans is None else spans

    placements = []  # (packed row, offset) of each sequence
    row, used = 0, 0
    for _, length, _, _ in spans:
        if used and row_tokens is not None and used + length > row_tokens:
            row, used = row + 1, 0
        placements.append((row, used))
        used += length
    num_rows = row + 1
    row_length = max(offset + span[1] for (_, offset), span in zip(placements, spans, strict=True))

    src, dst, positions, keep_dst, rows, cols = [], [], [], [], [], []
    for i, ((start, length, completion, _), (packed_row, offset)) in enumerate(zip(spans, placements, strict=True)):
        base = packed_row * row_length + offset
        src.append(torch.arange(i * width + start, i * width + start + length))
        dst.append(torch.arange(base, base + length))
        positions.append(torch.arange(length))
        # Completion token j sits at padded column prompt_width + j; its logit at the column before it.
        keep_dst.append(torch.arange(base + prompt_width - 1 - start, base + prompt_width - 1 - start + completion))
        rows.append(torch.full((completion,), i))
        cols.append(torch.arange(completion))
    src, dst = torch.cat(src).to(device), torch.cat(dst).to(device)
    keep_dst = torch.cat(keep_dst).to(device)

    flat_ids = input_ids.new_zeros(num_rows * row_length)
    flat_ids[dst] = input_ids.reshape(-1)[src]
    # The tail of a packed row counts from 0 as a sequence of its own: it attends to nothing real.
    ends = [0] * num_rows
    for (packed_row, offset), span in zip(placements, spans, strict=True):
        ends[packed_row] = max(ends[packed_row], offset + span[1])
    tail = torch.arange(row_length, device=device)[None, :] - torch.tensor(ends, device=device)[:, None]
    flat_positions = tail.clamp(min=0).reshape(-1)
    flat_positions[dst] = torch.cat(positions).to(device)
    keep = torch.zeros(num_rows * row_length, dtype=torch.bool, device=device)
    keep[keep_dst] = True
    targets = flat_ids[keep_dst + 1]  # the token after each kept position: the completion token it scores
    return PackedLayout(
        input_ids=flat_ids.view(num_rows, row_length),
        position_ids=flat_positions.view(num_rows, row_length),
        keep=keep.view(num_rows, row_length),
        targets=targets,
        rows=torch.cat(rows).to(device),
        columns=torch.cat(cols).to(device),
        num_sequences=len(spans),
    )
