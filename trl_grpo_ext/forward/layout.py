"""Where the tokens of a log-prob forward go: TRL's padded layout, counted (`forward_counts`), and the packed layout
that replaces it (`pack_rows`). TRL forwards `(N, P + C)` rows, prompts left-padded, completions right-padded, a
prompt repeated for each of its completions; the packed layout lays each row's real tokens end to end, `position_ids`
restarting per sequence, a shared prompt once for its completions (docs/performance.md, "The packed layout").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..metrics import FORWARD_PADDING_FRACTION, FORWARD_REPEATED_PROMPT_FRACTION, FORWARD_TOKENS_PER_DISTINCT
from .attention import PackedAttention

__all__ = [
    "FORWARD_METRICS",
    "ForwardCounts",
    "PackedLayout",
    "RowSpan",
    "forward_counts",
    "pack_rows",
    "prompt_leaders",
    "row_spans",
    "unpackable_reason",
    "upload",
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
            FORWARD_PADDING_FRACTION: (self.padding, self.forwarded),
            FORWARD_REPEATED_PROMPT_FRACTION: (self.repeated_prompt, self.forwarded),
            FORWARD_TOKENS_PER_DISTINCT: (self.forwarded, self.distinct),
        }


#: The metric names of `ForwardCounts.metrics`, in the order they are logged.
FORWARD_METRICS = (FORWARD_PADDING_FRACTION, FORWARD_REPEATED_PROMPT_FRACTION, FORWARD_TOKENS_PER_DISTINCT)


def prompt_leaders(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """`(N,)`: for each row, the first row whose prompt tokens are the same (the tokens compared, not the places).

    Args:
        prompt_ids (`torch.Tensor` of shape `(N, P)`), prompt_mask (`torch.Tensor` of shape `(N, P)`): left-padded.
    """
    tokens = prompt_ids.masked_fill(prompt_mask == 0, -1)
    same = (tokens[:, None, :] == tokens[None, :, :]).all(-1)  # (N, N), true on the diagonal
    return same.int().argmax(-1)  # the first true column


def first_of_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """`(N,)` bool: row `i` is the first of the rows with its prompt (`prompt_leaders`)."""
    return prompt_leaders(prompt_ids, prompt_mask) == torch.arange(prompt_ids.size(0), device=prompt_ids.device)


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
    # Filled on the device from a Python number: a tensor made from host data would be a blocking copy on a GPU.
    forwarded = torch.full((), prompt_mask.numel() + completion_mask.numel(), device=prompt_mask.device)
    repeated = (prompt_tokens * ~first_of_prompt(prompt_ids, prompt_mask)).sum()
    return ForwardCounts(
        forwarded=forwarded.float(),
        padding=(forwarded - real).float(),
        repeated_prompt=repeated.float(),
        distinct=(real - repeated).float(),
    )


class RowSpan(NamedTuple):
    """Where a padded row's real tokens are (`row_spans`)."""

    first: int  #: its first real column
    tokens: int  #: its real tokens
    completion: int  #: of which completion tokens
    last: int  #: its last real column
    leader: int  #: the first row of the chunk with the same prompt tokens (itself when it is the first)


def row_spans(
    attention_mask: torch.Tensor, logits_to_keep: int, input_ids: torch.Tensor | None = None
) -> list[RowSpan]:
    """Each row's `RowSpan`, read from the device in one host synchronisation (the only one of a packed forward's
    layout). Without `input_ids` each row is its own leader.

    Args:
        attention_mask (`torch.Tensor` of shape `(N, P + C)`), logits_to_keep (`int`): `C`.
        input_ids (`torch.Tensor` of shape `(N, P + C)`, *optional*): to find the rows that share a prompt.
    """
    mask = attention_mask.bool()
    width = mask.size(1)
    columns = torch.arange(width, device=mask.device)
    first = torch.where(mask, columns, width).amin(-1)
    last = torch.where(mask, columns, -1).amax(-1)
    if input_ids is None:
        leader = torch.arange(mask.size(0), device=mask.device)
    else:
        prompt_width = width - logits_to_keep
        leader = prompt_leaders(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    spans = torch.stack([first, mask.sum(-1), mask[:, width - logits_to_keep :].sum(-1), last, leader], dim=-1)
    return [RowSpan(*span) for span in spans.tolist()]


def unpackable_reason(spans: list[RowSpan], prompt_width: int) -> str | None:
    """Why rows with these `row_spans` cannot be packed exactly, `None` when they can.

    A row packs when its real tokens (mask 1) are one contiguous span that holds at least one prompt token: a gap
    inside a row (a token the padded forward hides from the ones after it) would move the positions of the tokens
    after it, and a completion without a prompt token before it has no logit to be scored from.

    Args:
        spans: `row_spans(attention_mask, C)`; prompt_width (`int`): `P`.
    """
    if any(span.tokens > 0 and span.last - span.first + 1 != span.tokens for span in spans):
        return "a row's attention mask has a gap between real tokens"
    if any(span.first >= prompt_width for span in spans):
        return "a row has no prompt token"
    return None


@dataclass(frozen=True)
class PackedLayout:
    """The packed layout of `N` padded rows (`pack_rows`); its tensors live on the rows' device.

    `K` is the number of completion tokens, `B` and `L` the packed rows' number and length.
    """

    input_ids: torch.Tensor  #: `(B, L)` the forwarded tokens end to end, 0 in a packed row's tail
    position_ids: torch.Tensor  #: `(B, L)` each token's position in its own sequence
    scored_rows: torch.Tensor  #: `(K,)` the packed row of the logit that scores each completion token
    scored_columns: torch.Tensor  #: `(K,)` its column: the token it scores sits in the next one
    rows: torch.Tensor  #: `(K,)` the padded row of each completion token
    columns: torch.Tensor  #: `(K,)` its column in the completion, `0 <= j < C`
    units: torch.Tensor  #: `(B, L)` each token's unit (a row's tail is a unit of its own)
    branches: torch.Tensor  #: `(B, L)` its branch in the unit: 0 for a shared prompt or a sequence of its own
    segments: PackedAttention  #: the attention's segments, for varlen kernels
    num_sequences: int  #: `N`
    shared_prompts: bool  #: whether the rows that share a prompt forward it once

    @property
    def targets(self) -> torch.Tensor:
        """`(K,)` the completion tokens, in the order of the scored logits."""
        return self.input_ids[self.scored_rows, self.scored_columns + 1]

    @property
    def keep(self) -> torch.Tensor:
        """`(B, L)` bool: the positions whose logits score a completion token."""
        keep = torch.zeros_like(self.input_ids, dtype=torch.bool)
        return keep.index_put((self.scored_rows, self.scored_columns), torch.ones_like(self.rows, dtype=torch.bool))

    def labels(self) -> torch.Tensor:
        """`(B, L)` the labels of a fused LM head: each completion token where it is scored, -100 elsewhere."""
        labels = torch.full_like(self.input_ids, -100)
        return labels.index_put((self.scored_rows, self.scored_columns + 1), self.targets)

    def scores(self, values: torch.Tensor) -> torch.Tensor:
        """`(K,)`: the values `(B, L - 1)` of a fused LM head (position `t` scores token `t + 1`) at the completion
        tokens."""
        return values[self.scored_rows, self.scored_columns]

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """`values` `(K,)` placed at their `(row, column)` in a zero tensor of `shape` `(N, C)`."""
        out = values.new_zeros(shape)
        return out.index_put((self.rows, self.columns), values)

    def visible(self, query_unit, query_branch, key_unit, key_branch) -> torch.Tensor:
        """Whether a query of this unit and branch may see a key of that one (both earlier keys and later ones: the
        causal part is the caller's): the same unit, and the key in the unit's shared prompt or the query's branch."""
        return (query_unit == key_unit) & ((key_branch == 0) | (query_branch == key_branch))

    def attention(self) -> torch.Tensor:
        """`(B, 1, L, L)` bool, true where query `q` attends to key `k`: `k <= q` and `visible`."""
        unit, branch = self.units, self.branches
        length = unit.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=unit.device).tril()
        visible = self.visible(unit[:, :, None], branch[:, :, None], unit[:, None, :], branch[:, None, :])
        return (causal & visible)[:, None]

    def block_mask(self):
        """The same as `attention`, as flex attention's `BlockMask` (built block by block from the units and
        branches, without a dense mask)."""
        from torch.nn.attention.flex_attention import create_block_mask

        unit, branch = self.units, self.branches

        def mask_mod(b, h, q, k):
            return (k <= q) & self.visible(unit[b, q], branch[b, q], unit[b, k], branch[b, k])

        rows, length = unit.shape
        return create_block_mask(mask_mod, rows, None, length, length, device=unit.device)


Prefix = tuple[int, int, int]  #: a unit's shared prompt: (its leader row, first column, length)
Branch = tuple[int, int, int, int]  #: (row, first column, length, offset of its first scored token in the branch)
Unit = tuple[Prefix | None, list[Branch]]  #: forwarded contiguously: the prefix (if any), then each branch


def _unit_size(unit: Unit) -> int:
    prefix, branches = unit
    return (prefix[2] if prefix else 0) + sum(branch[2] for branch in branches)


def _fill(
    groups: list[tuple[Prefix | None, list[Branch], int]], rows: int, length: int
) -> tuple[list[Unit], list[tuple[int, int]], list[int]]:
    """Place `groups` (prefix, branches, size), largest first, their branches largest first, in `rows` packed rows of
    at most `length` tokens: `(units, placements (row, offset), tokens used per row)`.

    Each group goes whole into the row with the most room (which balances the rows: the longest sets the forward's
    width). Where it does not fit, the largest of its branches that fit go there with a copy of the prefix, and the
    rest likewise into the next row with the most room; where not even one branch fits, into a new row (of its own
    when a branch and the prefix are longer than `length`).
    """
    used = [0] * rows
    heap = [(0, row) for row in range(rows)]  # (tokens used, row): the row with the most room first
    units: list[Unit] = []
    placements: list[tuple[int, int]] = []
    for prefix, branches, whole in groups:
        prefix_tokens = prefix[2] if prefix else 0
        left = branches
        while left:
            row = heap[0][1] if heap else len(used)
            room = length - (used[row] if heap else 0)
            taken, size, rest = left, whole, []
            if whole > room:
                taken, size = [], prefix_tokens
                for branch in left:
                    if size + branch[2] <= room:
                        taken.append(branch)
                        size += branch[2]
                    else:
                        rest.append(branch)
            if not taken:  # not one branch fits: an empty row (a new one if none), for the group or its largest branch
                row = row if heap and used[row] == 0 else len(used)
                taken, size, rest = (
                    (left, whole, []) if whole <= length else (left[:1], prefix_tokens + left[0][2], left[1:])
                )
            if row == len(used):
                used.append(0)
                heapq.heappush(heap, (0, row))
            units.append((prefix, taken))
            placements.append((row, used[row]))
            used[row] += size
            # The row's entry in the heap, updated: it is the top one unless it was just opened behind others.
            index = heap.index((used[row] - size, row))
            heap[index] = (used[row], row)
            heapq.heapify(heap)
            left, whole = rest, whole - (size - prefix_tokens)
    return units, placements, used


def place_units(
    groups: list[Unit], row_tokens: int | None, attention_weight: float = 0.0
) -> tuple[list[Unit], list[tuple[int, int]]]:
    """Where each unit goes: `(units, placements)`, a placement `(packed row, offset)`, in the packed rows' order;
    every packed row is as long as the longest (the forward's `(B, L)`).

    `row_tokens=None`: one packed row, the groups whole and in order. Otherwise rows of at most `row_tokens` tokens
    (longer only for a unit that no row of that budget holds), their number `B` and length `L` chosen for the least
    cost `B * L * (1 + attention_weight * L)`: each forwarded token costs the model's linear layers, and attention
    over a row's dense mask `attention_weight` of that per token it attends to (at equal cost, fewer rows). Row
    counts from the fewest that hold the tokens are tried, each filled by `_fill` at its even share of the tokens.

    Args:
        groups: the units as the rows give them: one per sequence, or one per prompt with all its completions.
        row_tokens (`int` or `None`): the token budget of a packed row.
        attention_weight (`float`): attention's cost per attended token relative to the linear layers' per token
            (`2 h n / P` of `logprobs.row_budget`; 0 where attention costs each sequence alone, as varlen kernels).
    """
    if row_tokens is None:
        placements, at = [], 0
        for unit in groups:
            placements.append((0, at))
            at += _unit_size(unit)
        return list(groups), placements
    total = sum(_unit_size(unit) for unit in groups)
    longest = max((prefix[2] if prefix else 0) + max(b[2] for b in branches) for prefix, branches in groups)
    ordered = sorted(
        (
            (prefix, sorted(branches, key=lambda branch: branch[2], reverse=True), _unit_size((prefix, branches)))
            for prefix, branches in groups
        ),
        key=lambda group: group[2],
        reverse=True,
    )
    # Row counts to try: the fewest that hold the tokens and the next two, then half as many more each time while an
    # even share of the tokens is longer than the longest unit, at most a row per sequence; each with rows of its even
    # share of the tokens, a little more, and the budget.
    sequences = sum(len(branches) for _, branches, _ in ordered)
    fewest = min(-(-total // row_tokens), sequences)
    counts, rows = [], fewest
    while not counts or (-(-total // rows) >= longest and rows <= sequences):
        counts.append(rows)
        rows = rows + 1 if rows < fewest + 2 else rows + rows // 2
    best = None
    for rows in counts:
        even = -(-total // rows)
        for length in sorted(
            {min(row_tokens, max(longest, length)) for length in (even, int(even * 1.1), row_tokens)}
        ):
            units, placements, used = _fill(ordered, rows, length)
            width, filled = max(used), sum(1 for tokens in used if tokens)
            cost = (filled * width * (1 + attention_weight * width), filled)  # at equal cost, fewer rows
            if best is None or cost < best[0]:
                best = (cost, units, placements)
    # In the packed rows' order: `PackedLayout.keep`'s row-major order is the order of the scored tokens.
    order = sorted(range(len(best[1])), key=best[2].__getitem__)
    return [best[1][k] for k in order], [best[2][k] for k in order]


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(piece, index)` of each element of the ranges `[start, start + length)`, laid end to end: `(total,)` each,
    `total` the sum of `lengths` (given, so that nothing is read back from the device)."""
    piece = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    return piece, starts[piece] + torch.arange(total, device=lengths.device) - first[piece]


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """One host array to the device without waiting for it: from pinned memory, asynchronously, on a GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    row_tokens: int | None,
    spans: list[RowSpan] | None = None,
    shared_prompts: bool = False,
    attention_weight: float = 0.0,
    anchor_position: int | None = None,
) -> PackedLayout:
    """Lay padded rows end to end in units (one row's real tokens; with `shared_prompts`, a prompt but its last token,
    then per completion of it that token and the completion), placed in packed rows of at most `row_tokens` tokens
    (`None`: one row) by `place_units`; a prompt whose completions do not fit together has further units, each with
    the prompt again. Rows must pack (`unpackable_reason` is `None`). No host synchronisation besides `row_spans` (none
    when `spans` are given), one asynchronous upload.

    Args:
        input_ids (`torch.Tensor` of shape `(N, P + C)`), attention_mask (`torch.Tensor` of shape `(N, P + C)`):
            prompts left-padded, completions right-padded, as TRL builds them.
        logits_to_keep (`int`): `C`, the completion width.
        row_tokens (`int` or `None`): the token budget of a packed row.
        spans: `row_spans(attention_mask, logits_to_keep, input_ids)`, when already read.
        shared_prompts (`bool`): forward each prompt once per unit.
        attention_weight (`float`): `place_units`'s cost of attention.
        anchor_position (`int`, *optional*): a position the layout must hold (the padded forward's largest, `P + C -
            1`).
    """
    device = input_ids.device
    width = attention_mask.size(1)
    prompt_width = width - logits_to_keep
    if spans is None:
        spans = row_spans(attention_mask, logits_to_keep, input_ids if shared_prompts else None)

    # A group: (prefix, branches); the prefix (leader row, first column, length) is forwarded once, then each branch
    # (row, first column, length, first scored offset in the branch) continues it. `place_units` may split a group
    # into units, each with the prefix again.
    if shared_prompts:
        members: dict[int, list[int]] = {}
        for i, span in enumerate(spans):
            members.setdefault(span.leader, []).append(i)
        groups = [
            (
                (leader, spans[leader].first, prompt_width - 1 - spans[leader].first),
                [(i, prompt_width - 1, 1 + spans[i].completion, 0) for i in rows],
            )
            for leader, rows in members.items()
        ]
    else:
        groups = [(None, [(i, s.first, s.tokens, prompt_width - 1 - s.first)]) for i, s in enumerate(spans)]
    units, placements = place_units(groups, row_tokens, attention_weight)
    num_rows = max(packed_row for packed_row, _ in placements) + 1
    ends = [0] * num_rows
    for (packed_row, offset), unit in zip(placements, units, strict=True):
        ends[packed_row] = max(ends[packed_row], offset + _unit_size(unit))
    row_length = max(ends)
    if anchor_position is not None and ends[-1] == row_length:
        row_length += 1  # room for the anchor in the last row's tail

    # Per piece (on the host): pieces (source, destination, length, position, unit, branch), in the flattened
    # order of the packed rows; the completion tokens each branch scores (first scored destination, tokens, padded
    # row); the attention's segments (query length, then its keys as (destination, length) spans).
    pieces, scored, query_lengths, key_spans, key_lengths = [], [], [], [], []

    def place(source: int, at: int, length: int, position: int, unit: int, branch: int, keys: list) -> None:
        pieces.append((source, at, length, position, unit, branch))
        query_lengths.append(length)
        key_spans.extend(keys)
        key_lengths.append(sum(span[1] for span in keys))

    def tail(packed_row: int) -> None:
        length = row_length - ends[packed_row]
        if length:
            query_lengths.append(length)
            key_spans.append((packed_row * row_length + ends[packed_row], length))
            key_lengths.append(length)

    packed_row_before = 0
    for unit, ((prefix, branches), (packed_row, offset)) in enumerate(zip(units, placements, strict=True)):
        for finished in range(packed_row_before, packed_row):
            tail(finished)
        packed_row_before = packed_row
        at, start_position, prefix_span = packed_row * row_length + offset, 0, []
        if prefix is not None and prefix[2] > 0:
            leader, column, length = prefix
            prefix_span = [(at, length)]
            place(leader * width + column, at, length, 0, unit, 0, prefix_span)
            at, start_position = at + length, length
        for number, (i, column, length, first_scored) in enumerate(branches, start=1):
            place(
                i * width + column,
                at,
                length,
                start_position,
                unit,
                number if prefix else 0,
                [*prefix_span, (at, length)],
            )
            # Completion token j sits at padded column prompt_width + j; its logit at the column before it.
            scored.append((at + first_scored, spans[i].completion, i))
            at += length
    for finished in range(packed_row_before, num_rows):
        tail(finished)
    # Positions of the tails: 0, 1, ... from each row's end (modulo P + C); the anchor row's shifted to end there.
    shifts = [0] * num_rows
    if anchor_position is not None:
        shifts[-1] = (anchor_position + 1 - (row_length - ends[-1]) % width) % width

    host = [value for piece in pieces for value in piece]
    host += [value for entry in scored for value in entry]
    host += query_lengths + key_lengths + [value for span in key_spans for value in span] + ends + shifts
    arrays = torch.split(
        upload(host, device),
        [
            6 * len(pieces),
            3 * len(scored),
            len(query_lengths),
            len(key_lengths),
            2 * len(key_spans),
            num_rows,
            num_rows,
        ],
    )
    piece_array, scored_array = arrays[0].view(-1, 6), arrays[1].view(-1, 3)
    source, destination, length, position, unit_of, branch_of = piece_array.unbind(1)
    real = sum(piece[2] for piece in pieces)
    completion_tokens = sum(entry[1] for entry in scored)

    # Token by token, on the device: each real token's source and destination, position, unit and branch.
    piece, token_source = _ranges(source, length, real)
    token_destination = _ranges(destination, length, real)[1]
    flat = num_rows * row_length
    flat_ids = input_ids.new_zeros(flat)
    flat_ids[token_destination] = input_ids.reshape(-1)[token_source]
    columns = torch.arange(row_length, device=device)
    row_ends, row_shifts = arrays[5], arrays[6]
    flat_positions = ((columns[None, :] - row_ends[:, None] + row_shifts[:, None]).clamp(min=0) % width).reshape(-1)
    flat_positions[token_destination] = position[piece] + token_destination - destination[piece]
    flat_units = torch.arange(num_rows, device=device).repeat_interleave(row_length) + len(units)
    flat_units[token_destination] = unit_of[piece]
    flat_branches = torch.zeros(flat, dtype=torch.long, device=device)
    flat_branches[token_destination] = branch_of[piece]

    # The scored logits: each branch's, then the completion tokens' padded rows and columns.
    scored_first, scored_count, scored_row = scored_array.unbind(1)
    scored_piece, scored_flat = _ranges(scored_first, scored_count, completion_tokens)
    completion_columns = scored_flat - scored_first[scored_piece]

    # The attention's segments.
    query_lengths_device, key_lengths_device = arrays[2], arrays[3]
    key_span_array = arrays[4].view(-1, 2)
    key_index = None
    if shared_prompts:
        key_index = _ranges(key_span_array[:, 0], key_span_array[:, 1], sum(key_lengths))[1]

    def cumulative(lengths: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)

    segments = PackedAttention(
        cu_seqlens_q=cumulative(query_lengths_device),
        cu_seqlens_k=cumulative(key_lengths_device),
        max_length_q=max(query_lengths),
        max_length_k=max(key_lengths),
        key_index=key_index,
    )
    return PackedLayout(
        input_ids=flat_ids.view(num_rows, row_length),
        position_ids=flat_positions.view(num_rows, row_length),
        scored_rows=torch.div(scored_flat, row_length, rounding_mode="floor"),
        scored_columns=scored_flat % row_length,
        rows=scored_row[scored_piece],
        columns=completion_columns,
        units=flat_units.view(num_rows, row_length),
        branches=flat_branches.view(num_rows, row_length),
        segments=segments,
        num_sequences=len(spans),
        shared_prompts=shared_prompts,
    )
