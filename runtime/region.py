"""Boxes: rectangular regions of a buffer, as one (start, stop) pair per dim."""
from __future__ import annotations

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def overlaps(a: Box, b: Box) -> bool:
    """True when the boxes share at least one element."""
    for (a0, a1), (b0, b1) in zip(a, b):
        if a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1:
            return False
    return True


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
