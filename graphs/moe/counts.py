"""Counts-built MegaMoE graphs: one graph per routing's per-expert counts, every tile sized at build.

The recv layout holds each local expert's rows back to back (source rank by source rank); the
send layout each peer's rows, expert by expert. All-to-alls go in rounds with a rotated
destination order (see :mod:`.graph`), one collective per (expert, round, chunk of at most
``comm_tile`` rows), the chunk count being the same on every rank.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

from megaloom.graphs.common.tiles import tile_ranges
from megaloom.graphs.moe.ops import Cut
from megaloom.graphs.moe.spec import Counts, MegaMoESpec
from megaloom.graphs.moe.tasks import TaskBuilder
from megaloom.ops.mxfp8.format import BLOCK
from megaloom.runtime.graph import Buffer, Task, TaskGraph
from megaloom.runtime.registry import COMM, VECTOR, get_op


def _chunk(block: tuple[int, int], i: int, tile: int) -> tuple[int, int]:
    """Chunk ``i`` of ``tile`` rows of a row block (empty past its end)."""
    lo, hi = block
    return min(lo + i * tile, hi), min(lo + (i + 1) * tile, hi)


class CountsBuilder(TaskBuilder):
    """The tasks of a graph built for ``counts``: every tile of every expert's rows, as plain tasks."""

    def __init__(self, g: TaskGraph, spec: MegaMoESpec, counts: Counts, direction: str):
        super().__init__(g, spec, counts, direction)
        self.rows_of = [counts.expert_rows(e) for e in range(self.El)]
        self.group_rows = [hi - lo for lo, hi in self.rows_of]
        ends = list(accumulate((-(-n // BLOCK) * BLOCK for n in self.group_rows), initial=0))
        self.blocks, self.padded_rows = list(zip(ends, ends[1:])), ends[-1]  # each local expert's rows padded to 32

    @staticmethod
    def rows(spec: MegaMoESpec, counts: Counts) -> tuple[int, int, int]:
        """Rows of the recv layout, of the send layout, and of the ``tok`` / ``ws`` inputs."""
        return counts.recv_rows, counts.send_rows, counts.send_rows

    def tiles(self) -> list[tuple[int, int, int, int | None]]:
        """(expert, first row, end row, tile index: None here) of every row tile of the recv layout."""
        return [(e, a, b, None) for e, (lo, hi) in enumerate(self.rows_of)
                for a, b in tile_ranges(hi, self.spec.tile_m, lo)]

    def experts(self, e: int) -> slice:
        """The experts of a per-expert stack that a tile of expert ``e`` reads."""
        return slice(e, e + 1)

    def tile_task(self, op: str, ins: list, outs: list, cuts: tuple[Sequence[Cut], Sequence[Cut]], name: str,
                  expert: int, j: int | None, attrs: dict | None = None, block: int | None = None) -> Task:
        """Task ``op`` on tile ``j`` (or, with ``block``, on expert ``block``'s rows); ``cuts``: how each input
        and each output is cut to the live rows when they are known only at run time (not here)."""
        return self.task(op, ins, outs, name, expert=expert, engine=get_op(op).engine, attrs=attrs)

    def pack(self, src: Buffer, tok: Buffer, send: Buffer, recv: Buffer, scale: Buffer | None = None) -> None:
        """Gather routed rows of ``src`` into the send layout (own rows: into ``recv``)."""
        c, tm = self.c, self.spec.tile_m
        for p in range(self.W):
            for e in range(self.El):
                lo, hi = c.send_block(p, e)
                for a, b in tile_ranges(hi, tm, lo):
                    if p == self.rank:
                        r0 = c.recv_block(e, p)[0] + a - lo
                        dst = recv[r0:r0 + b - a]
                    else:
                        dst = send[a:b]
                    ins = [src, tok[a:b]] + ([scale[a:b]] if scale is not None else [])
                    self.task("moe_gather", ins, [dst], f"gather.p{p}.e{e}.{a}", expert=e, peer=p)

    def exchange(self, send: Buffer, recv: Buffer, expert: int, combine: bool) -> None:
        """Rounds ``1 .. W - 1`` of expert ``expert``, each in chunks of at most ``comm_tile`` rows (a round
        no rank has rows for is skipped on every rank); combine copies the own rows back."""
        c, r, W, e = self.c, self.rank, self.W, expert
        src_buf, dst_buf = (recv, send) if combine else (send, recv)
        for j in range(1, W):
            to, frm = (r + j) % W, (r - j) % W
            rows, src_blk, dst_blk = c.round(e, j, combine)
            tile = self.spec.comm_tile or max(rows + [1])
            chunks = max(-(-n // tile) for n in rows)  # the same on every rank: 0 skips the round
            for i in range(chunks):
                (s0, s1), (d0, d1) = _chunk(src_blk, i, tile), _chunk(dst_blk, i, tile)
                splits_s, splits_r = [0] * W, [0] * W
                splits_s[to], splits_r[frm] = s1 - s0, d1 - d0
                t = self.task("all_to_all", [src_buf[s0:s1]], [dst_buf[d0:d1]], f"{self._stage}.e{e}.j{j}.{i}",
                              expert=e, peer=to, engine=COMM, round=j, link="intra",
                              attrs={"send_splits": splits_s, "recv_splits": splits_r})
                self.comm_task(t, e, combine)
        if combine and W > 1:  # own rows
            lo, hi = c.recv_block(e, r)
            if hi > lo:
                s0 = c.send_block(r, e)[0]
                self.task("copy", [recv[lo:hi]], [send[s0:s0 + hi - lo]], f"{self._stage}.e{e}.self",
                          expert=e, peer=r, engine=VECTOR)
