"""Buffer accesses in task order: what a new access must wait for, and what it reads unwritten.

Per buffer, a :class:`Frontier` holds the accesses a later one must be ordered after: for
each region its last write and the reads since (a write covering earlier accesses stands for
them). Dependency derivation asks it for each new access's hazards (read after write, write
after read, write after write); validation of a loaded graph replays it in a topological order.

Most buffers are accessed by tiles that are either identical or disjoint: such a buffer keeps
one slot per tile (its last writer, then the readers since), found by one dict lookup. The
first access that partly overlaps a tile turns the buffer's frontier into two
:class:`~megaloom.runtime.region.BoxIndex` (reads, writes), found by overlap, for good.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.runtime.region import Box, BoxIndex, box_size, uncovered

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region

Entries = list[tuple[Box, int]]
_NONE: Entries = []


class Frontier:
    """The accesses of one buffer that later accesses must be ordered after."""

    __slots__ = ("slots", "tiles", "reads", "writes")

    def __init__(self) -> None:
        self.slots: dict[Box, list[int]] | None = {}  # tile -> [last writer or -1, readers since ...]
        self.tiles = BoxIndex()  # the tiles, to find what a new one overlaps
        self.reads: BoxIndex | None = None  # the general form, once tiles overlap
        self.writes: BoxIndex | None = None

    def known(self, box: Box) -> bool:
        """True when ``box`` is one of the tiles (each checked to lie in the buffer when first seen)."""
        return self.slots is not None and box in self.slots

    def _slot(self, box: Box) -> list[int] | None:
        """The slot of tile ``box`` (made if new); None for an empty box, or once the frontier
        is general (which a box partly overlapping a tile makes it)."""
        slots = self.slots
        if slots is None:
            return None
        slot = slots.get(box)
        if slot is not None:
            return slot
        if not box_size(box):
            return None  # an empty box overlaps nothing
        if self.tiles.overlapping(box):
            self._generalise()
            return None
        self.tiles.add(box, 0)
        slot = slots[box] = [-1]
        return slot

    def _generalise(self) -> None:
        self.reads, self.writes = BoxIndex(), BoxIndex()
        for box, slot in self.slots.items():
            if slot[0] >= 0:
                self.writes.add(box, slot[0])
            for r in slot[1:]:
                self.reads.add(box, r)
        self.slots = None

    def writes_over(self, box: Box) -> Entries:
        """``(box, task)`` of the frontier's writes overlapping ``box``."""
        slot = self._slot(box)
        if slot is not None:
            return [(box, slot[0])] if slot[0] >= 0 else _NONE
        return _NONE if self.slots is not None else self.writes.overlapping(box)

    def reads_over(self, box: Box) -> Entries:
        """``(box, task)`` of the frontier's reads overlapping ``box``."""
        slot = self._slot(box)
        if slot is not None:
            return [(box, r) for r in slot[1:]]
        return _NONE if self.slots is not None else self.reads.overlapping(box)

    def read(self, box: Box, tid: int) -> None:
        slot = self._slot(box)
        if slot is not None:
            slot.append(tid)
        elif self.slots is None:
            self.reads.add(box, tid)

    def write(self, box: Box, tid: int) -> None:
        """Task ``tid`` writes ``box``: it stands for the earlier accesses inside ``box``."""
        slot = self._slot(box)
        if slot is not None:
            slot[:] = [tid, tid] if tid in slot[1:] else [tid]
        elif self.slots is None:
            self.reads.drop_inside(box, tid)
            self.writes.drop_inside(box, tid)
            self.writes.add(box, tid)

    def gap(self, box: Box, writes: Entries) -> Box | None:
        """The first piece of ``box`` that none of ``writes`` (:meth:`writes_over` entries) covers."""
        if writes and writes[0][0] == box:
            return None
        gaps = [g for g in uncovered(box, [b for b, _ in writes]) if box_size(g)] if box_size(box) else ()
        return gaps[0] if gaps else None


Gap = tuple[int, "Region", Box]
"""A read of unwritten data: (task id, the region read, the first piece of it no task wrote)."""


def derive(frontiers: dict[str, Frontier], tid: int, ins: tuple[Region, ...], outs: tuple[Region, ...],
           gaps: list[Gap]) -> list[int]:
    """The predecessors of task ``tid`` by its accesses, in id order; records the accesses, and
    each read of a graph-internal buffer that no earlier write covers in ``gaps`` (the first ten)."""
    before: list[int] = []
    for r in ins:
        f = frontiers[r.buffer.name]
        slot = f.slots.get(r.box) if f.slots is not None else None
        found = [(r.box, slot[0])] if slot is not None and slot[0] >= 0 else f.writes_over(r.box)  # read after write
        before += [t for _, t in found]
        if not r.buffer.is_input and len(gaps) < 10 and (gap := f.gap(r.box, found)) is not None:
            gaps.append((tid, r, gap))
    for r in outs:
        f = frontiers[r.buffer.name]
        slot = f.slots.get(r.box) if f.slots is not None else None
        if slot is not None:  # a known tile: its last writer and the reads since
            before += slot[1:] if slot[0] < 0 else slot
        else:
            before += [t for _, t in f.reads_over(r.box)] + [t for _, t in f.writes_over(r.box)]
    for r in ins:
        frontiers[r.buffer.name].read(r.box, tid)
    for r in outs:
        frontiers[r.buffer.name].write(r.box, tid)
    return sorted(set(before) - {tid})
