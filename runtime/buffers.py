"""Buffers and regions: the named tensor slots tasks read and write, and boxes of them.

    x = g.input("x", (128, 64))
    x[0:64, :]            # a Region: rows 0-63, every column
    x.split(0, 32)        # four row tiles
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from megaloom.runtime.dtypes import itemsize
from megaloom.runtime.errors import GraphError
from megaloom.runtime.region import Box, box_shape, box_size, full_box


@dataclass(eq=False, slots=True)
class Buffer:
    """A named tensor slot. ``is_input``: the caller provides it; ``is_output``: returned."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    is_input: bool = False
    is_output: bool = False
    _full: Region | None = field(default=None, repr=False)

    @property
    def full(self) -> Region:
        """The region covering the whole buffer."""
        if self._full is None:
            self._full = Region(self, full_box(self.shape))
        return self._full

    @property
    def nbytes(self) -> int:
        return box_size(full_box(self.shape)) * itemsize(self.dtype)

    def __getitem__(self, index: Any) -> Region:
        return self.full[index]

    def region(self, box: Box) -> Region:
        """The region of this buffer covering ``box`` (one (start, stop) pair per dim)."""
        return Region(self, tuple(tuple(b) for b in box))

    def split(self, dim: int, size: int) -> list[Region]:
        """Tiles of at most ``size`` elements along ``dim`` (the last may be shorter)."""
        return self.full.split(dim, size)

    def __repr__(self) -> str:
        return f"Buffer({self.name!r}, {self.shape}, {self.dtype})"


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a buffer: one (start, stop) pair per dim."""

    buffer: Buffer
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    @property
    def dtype(self) -> str:
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        return box_size(self.box) * itemsize(self.buffer.dtype)

    def __getitem__(self, index: Any) -> Region:
        """Sub-region by integer-free basic slicing, e.g. ``buf[0:64, :]``."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(self.box):
            raise GraphError(f"too many indices for {self}")
        box = list(self.box)
        for d, ix in enumerate(index):
            if not isinstance(ix, slice) or ix.step not in (None, 1):
                raise GraphError(f"regions take unit-step slices only, got {ix!r} for {self}")
            lo, hi = box[d]
            try:
                start, stop, _ = ix.indices(hi - lo)
            except TypeError:
                raise GraphError(f"regions take integer slice bounds, got {ix!r} for {self}") from None
            box[d] = (lo + start, lo + max(start, stop))
        return Region(self.buffer, tuple(box))

    def split(self, dim: int, size: int) -> list[Region]:
        """Tiles of at most ``size`` elements along ``dim``."""
        dim, size = integer(dim, f"split dim of {self}"), integer(size, f"tile size of {self}")
        if not 0 <= dim < len(self.box):
            raise GraphError(f"cannot split {self} along dim {dim}: it has {len(self.box)} dims")
        if size <= 0:
            raise GraphError(f"tile size must be positive, got {size}")
        (lo, hi), box = self.box[dim], self.box
        return [Region(self.buffer, (*box[:dim], (a, min(a + size, hi)), *box[dim + 1:])) for a in range(lo, hi, size)]

    def __repr__(self) -> str:
        if self.box == full_box(self.buffer.shape):
            return self.buffer.name
        return f"{self.buffer.name}[{', '.join(f'{a}:{b}' for a, b in self.box)}]"


def integer(v: Any, what: str) -> int:
    """``v`` as an int (Python or NumPy integer); a float, string or bool raises GraphError."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise GraphError(f"{what} must be an integer, got {v!r}")
    return operator.index(v)
