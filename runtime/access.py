"""Buffer accesses in task order: what a new access must wait for, and what it reads unwritten.

Per buffer, a :class:`Frontier` holds the accesses a later one must be ordered after: for
each region its last write and the reads since (a write covering earlier accesses stands for
them). Dependency derivation asks it for each new access's hazards (read after write, write
after read, write after write); validation of a loaded graph replays it in a topological order.

A buffer keeps one slot per tile, each distinct box accessed (its last writer, then the
readers since); a write clears the slots of the tiles inside it. Most buffers are accessed by
tiles that are either identical or disjoint: an access then meets its own tile alone, found by
one dict lookup. Once two tiles partly overlap, the tiles an access meets are found by overlap
(a :class:`~megaloom.runtime.region.BoxIndex`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.runtime.region import Box, BoxIndex, box_size, contains, uncovered

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region

Entries = list[tuple[Box, int]]


class Frontier:
    """The accesses of one buffer that later accesses must be ordered after, per tile (each
    distinct box accessed): its last writer and the reads since."""

    __slots__ = ("slots", "tiles", "disjoint")

    def __init__(self) -> None:
        self.slots: dict[Box, list[int]] = {}  # tile -> [last writer or -1, readers since ...]
        self.tiles = BoxIndex()  # the tiles, found by overlap
        self.disjoint = True  # no two tiles partly overlap: a tile meets only itself

    def over(self, box: Box) -> list[tuple[Box, list[int]]]:
        """The tiles overlapping ``box``, with their slots (``box`` becomes a tile if new and not empty)."""
        slot = self.slots.get(box)
        if slot is not None and self.disjoint:
            return [(box, slot)]
        if not box_size(box):
            return []  # an empty box overlaps nothing
        found = [(b, self.slots[b]) for b in self.tiles.overlapping(box)]
        if slot is None:
            self.disjoint = self.disjoint and not found
            self.tiles.add(box)
            found.append((box, self.slots.setdefault(box, [-1])))
        return found

    def writes_over(self, box: Box) -> Entries:
        """``(tile, task)`` of the last writes overlapping ``box``."""
        return [(b, s[0]) for b, s in self.over(box) if s[0] >= 0]

    def reads_over(self, box: Box) -> Entries:
        """``(tile, task)`` of the reads since, overlapping ``box``."""
        return [(b, r) for b, s in self.over(box) for r in s[1:]]

    def read(self, box: Box, tid: int) -> None:
        if box in self.slots:  # (an empty box has none)
            self.slots[box].append(tid)

    def write(self, box: Box, tid: int) -> None:
        """Task ``tid`` writes ``box``: it stands for the earlier accesses of the tiles inside it."""
        for b, s in self.over(box):
            if b == box or contains(box, b):
                s[:] = [tid if b == box or s[0] == tid else -1] + [r for r in s[1:] if r == tid]

    def gap(self, box: Box, writes: Entries) -> Box | None:
        """The first piece of ``box`` that none of ``writes`` (:meth:`writes_over` entries) covers."""
        if (writes and writes[0][0] == box) or not box_size(box):
            return None
        return next((g for g in uncovered(box, [b for b, _ in writes]) if box_size(g)), None)


Gap = tuple[int, "Region", Box]
"""A read of unwritten data: (task id, the region read, the first piece of it no task wrote)."""


def derive(frontiers: dict[str, Frontier], tid: int, ins: tuple[Region, ...], outs: tuple[Region, ...],
           gaps: list[Gap]) -> list[int]:
    """The predecessors of task ``tid`` by its accesses, in id order; records the accesses, and
    each read of a graph-internal buffer that no earlier write covers in ``gaps`` (the first ten).
    (A read is recorded at once: only writes order a read, and the task's own accesses are no hazard.)"""
    before: list[int] = []
    for r in ins:
        f = frontiers[r.buffer.name]
        slot = f.slots.get(r.box) if f.disjoint else None
        if slot is None:
            found = f.writes_over(r.box)
            before += [t for _, t in found]
            slot = f.slots.get(r.box)  # (none for an empty box)
        elif slot[0] >= 0:  # a known tile, written: its last writer (read after write)
            before.append(slot[0])
            found = None
        else:
            found = []
        if found is not None and not r.buffer.is_input and len(gaps) < 10 and (gap := f.gap(r.box, found)) is not None:
            gaps.append((tid, r, gap))
        if slot is not None:
            slot.append(tid)
    for r in outs:
        f = frontiers[r.buffer.name]
        slot = f.slots.get(r.box) if f.disjoint else None
        if slot is not None:  # a known tile: its last writer and the reads since
            before += slot[1:] if slot[0] < 0 else slot
        else:
            before += [t for _, t in f.reads_over(r.box)] + [t for _, t in f.writes_over(r.box)]
        f.write(r.box, tid)
    if len(before) == 1 and before[0] != tid:
        return before
    return sorted(set(before) - {tid})
