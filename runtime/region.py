"""Boxes: rectangular regions of a buffer, as one (start, stop) pair per dim."""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def overlaps(a: Box, b: Box) -> bool:
    """True when the boxes share at least one element."""
    for (a0, a1), (b0, b1) in zip(a, b):
        if a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1:
            return False
    return True


def in_bounds(box: Box, shape: tuple[int, ...]) -> bool:
    """True when ``box`` is a well-formed box (start <= stop) of a tensor of ``shape``."""
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def contains(outer: Box, inner: Box) -> bool:
    """True when every element of ``inner`` lies in ``outer``."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def subtract(box: Box, cut: Box) -> list[Box]:
    """``box`` minus ``cut`` as a list of disjoint boxes."""
    if not overlaps(box, cut):
        return [box]
    pieces: list[Box] = []
    rest = list(box)
    for d, ((a, b), (c0, c1)) in enumerate(zip(box, cut)):
        if a < c0:
            pieces.append(tuple(rest[:d]) + ((a, c0),) + tuple(rest[d + 1:]))
        if c1 < b:
            pieces.append(tuple(rest[:d]) + ((c1, b),) + tuple(rest[d + 1:]))
        rest[d] = (max(a, c0), min(b, c1))
    return pieces


def uncovered(box: Box, covers: list[Box]) -> list[Box]:
    """The parts of ``box`` that no box in ``covers`` contains."""
    left = [box]
    for c in covers:
        left = [p for q in left for p in subtract(q, c)]
        if not left:
            break
    return left


def to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


class BoxIndex:
    """Boxes of one buffer, found by overlap in O(log n + hits).

    Entries are kept sorted by their start along one key dim; a query for ``[a, b)`` along
    it looks only at entries starting in ``[a - longest + 1, b)``, where ``longest`` is the
    longest extent along that dim ever added. Each time the entries double, the key dim is
    chosen again (and the entries re-sorted): the dim along which boxes are narrowest for the
    range they cover, rows for row tiles, columns for column tiles, so tiles along any one
    dim stay cheap. A box spanning the key dim (a whole-buffer access) widens every later
    query of this index.
    """

    __slots__ = ("dim", "starts", "entries", "longest", "_rekey_at")

    def __init__(self) -> None:
        self.dim, self.longest, self._rekey_at = 0, 0, 8
        self.starts: list[int] = []
        self.entries: list[Box] = []

    def add(self, box: Box) -> None:
        s, e = box[self.dim] if box else (0, 1)
        i = bisect_right(self.starts, s)
        self.starts.insert(i, s)
        self.entries.insert(i, box)
        self.longest = max(self.longest, e - s)
        if len(self.entries) >= self._rekey_at and box:
            self._rekey_at *= 2
            self._rekey(len(box))

    def _rekey(self, ndim: int) -> None:
        """Key on the dim where boxes are narrowest for the range they cover."""
        spans = [[box[d] for box in self.entries] for d in range(ndim)]
        longest = [max(b - a for a, b in s) for s in spans]
        spread = [longest[d] / max(1, max(b for _, b in s) - min(a for a, _ in s)) for d, s in enumerate(spans)]
        best = min(range(ndim), key=spread.__getitem__)
        if spread[best] < spread[self.dim]:
            self.dim, self.longest = best, longest[best]
            self.entries.sort(key=lambda box: box[best][0])
            self.starts = [box[best][0] for box in self.entries]

    def _span(self, box: Box) -> range:
        if not box:
            return range(len(self.entries))
        a, b = box[self.dim]
        return range(bisect_left(self.starts, a - max(self.longest, 1) + 1), bisect_left(self.starts, b))

    def overlapping(self, box: Box) -> list[Box]:
        """The boxes sharing at least one element with ``box``."""
        entries = self.entries
        return [entries[i] for i in self._span(box) if overlaps(entries[i], box)]
