"""`FieldLayout`: named fields of one flat vector, each with the reduction that combines two of its values.

The diagnostics keep their running sums on the device as one vector, so that a log step needs one `gather`: a
layout packs tensors into it by name, merges two vectors (micro-batches of one process) and reduces a stack of them
(every process's) field by field: sums add up, minima and maxima combine as minima and maxima.
"""

from __future__ import annotations

import math

import torch

__all__ = ["REDUCTIONS", "FieldLayout"]

REDUCTIONS = ("sum", "min", "max")


class FieldLayout:
    """An ordered set of named fields of a 1-dim vector.

    Args:
        fields (`list[tuple[str, str]]` or `list[tuple[str, str, int]]`): `(name, reduction, size)` per field; the
            size defaults to 1 (a scalar), a larger one is a block (e.g. histogram counts); reductions are those of
            `REDUCTIONS`.
    """

    def __init__(self, fields):
        self.names: list[str] = []
        self.slices: dict[str, slice] = {}
        self.sizes: dict[str, int] = {}
        self.reductions: dict[str, str] = {}
        start = 0
        for name, reduction, *size in fields:
            if reduction not in REDUCTIONS:
                raise ValueError(f"field {name!r}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
            if name in self.slices:
                raise ValueError(f"field {name!r} appears twice.")
            width = size[0] if size else 1
            self.names.append(name)
            self.slices[name] = slice(start, start + width)
            self.sizes[name] = width
            self.reductions[name] = reduction
            start += width
        self.width = start
        self._mask_cache: dict[str, dict[str, torch.Tensor]] = {}

    def _masks(self, device: torch.device) -> dict[str, torch.Tensor]:
        # Filled on the device (a tensor made from host data is a blocking copy on a GPU), once: merge runs per
        # micro-batch.
        key = str(device)
        if key not in self._mask_cache:
            kinds = [
                torch.full((self.sizes[name],), REDUCTIONS.index(self.reductions[name]), device=device)
                for name in self.names
            ]
            kinds = torch.cat(kinds) if kinds else torch.zeros(0, dtype=torch.long, device=device)
            self._mask_cache[key] = {reduction: kinds == index for index, reduction in enumerate(REDUCTIONS)}
        return self._mask_cache[key]

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """One vector from `values` (a 0-dim tensor per scalar field, a `(size,)` one per block), in field order."""
        missing = set(self.names) - set(values)
        if missing:
            raise KeyError(f"no value for the fields {sorted(missing)}")
        return torch.cat([values[name].reshape(self.sizes[name]) for name in self.names])

    def identity(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The vector that merges with any other as if absent: 0 in sums, inf in minima, -inf in maxima."""
        masks = self._masks(device)
        identity = torch.zeros(self.width, dtype=dtype, device=device).masked_fill_(masks["min"], math.inf)
        return identity.masked_fill_(masks["max"], -math.inf)

    def add(self, vector: torch.Tensor | None, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`vector` (`None`: the identity) with `values`, some of the fields in its dtype, merged into them; device
        ops only."""
        first = next(iter(values.values()))
        some = self.identity(first.device, first.dtype)
        for name, value in values.items():
            some[self.slices[name]] = value.reshape(-1)
        return some if vector is None else self.merge(vector, some)

    def unpack(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of `vector` (shape `(width,)`, or `(..., width)`: then each field keeps the leading dims)."""
        out = {}
        for name in self.names:
            value = vector[..., self.slices[name]]
            out[name] = value[..., 0] if self.sizes[name] == 1 else value
        return out

    def merge(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """Combine two packed vectors field by field; device ops only."""
        masks = self._masks(first.device)
        merged = torch.where(masks["min"], torch.minimum(first, second), first + second)
        return torch.where(masks["max"], torch.maximum(first, second), merged)

    def reduce(self, rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Combine a stack of packed vectors along `dim` field by field."""
        masks = self._masks(rows.device)
        reduced = torch.where(masks["min"], rows.amin(dim=dim), rows.sum(dim=dim))
        return torch.where(masks["max"], rows.amax(dim=dim), reduced)
