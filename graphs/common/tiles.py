"""Tiles: the row ranges, column blocks and cube chains the graph builders lay tasks over."""
from __future__ import annotations

import itertools

from megaloom.graphs.common.tags import tags
from megaloom.runtime.graph import Buffer, TaskGraph


def tile_ranges(stop: int, size: int, start: int = 0) -> list[tuple[int, int]]:
    """(start, stop) ranges of at most ``size`` rows covering ``[start, stop)``."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal blocks of ``[0, n)`` (fewer when ``n < parts``)."""
    parts = max(1, min(parts, n))
    edges = [n * i // parts for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def weight_grad_chains(g: TaskGraph, grad: Buffer, act: Buffer, out: Buffer, tiles: list[tuple[int, int]],
                       cols: int, rows: int, acc: str, stage: str) -> None:
    """``out = sum_i grad[i]^T flat(act[i])`` as cube chains over the token tiles.

    The columns of ``out`` are split in blocks of at most ``cols`` (a block never spans two
    rows of act's trailing dims), one chain per block, so the chains run on different cube
    units. Each link of a chain covers ``rows`` tokens (rounded up to whole tiles), so a link
    waits for the vector work of its tiles only. Each chain accumulates in its own ``acc``
    buffer; its last link writes ``out`` in out's dtype.
    """
    per = -(-rows // (tiles[0][1] - tiles[0][0]))
    tiles = [(tiles[i][0], tiles[min(i + per, len(tiles)) - 1][1]) for i in range(0, len(tiles), per)]
    last, lead = act.shape[-1], act.shape[1:-1]
    blocks = [(row, idx, c0, min(c0 + cols, last)) for row, idx in enumerate(itertools.product(*map(range, lead)))
              for c0 in range(0, last, cols)]  # row: the row-major index of the trailing-dims row idx
    for j, (row, idx, c0, c1) in enumerate(blocks):
        dst = out[:, row * last + c0:row * last + c1]
        # one accumulator per chain keeps each buffer's writer list short
        acc_buf = g.buffer(f"{out.name}.acc{j}", dst.shape, acc) if len(tiles) > 1 else None
        for i, (a, b) in enumerate(tiles):
            final = i == len(tiles) - 1
            src = act[(slice(a, b), *(slice(k, k + 1) for k in idx), slice(c0, c1))]
            g.task("proj_grad_weight", [grad[a:b], src] + ([acc_buf] if i else []), [dst if final else acc_buf],
                   name=f"{stage}.{i}.{j}", attrs={"out_dtype": out.dtype if final else acc},
                   tags=tags(stage=stage, direction="bwd", tile=i))
