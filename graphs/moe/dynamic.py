"""Dynamic MegaMoE graphs: one graph per spec that takes each step's routing as run-time inputs.

Buffers have the static capacity of a :class:`~.layout.Layout`; tile tasks are ``moe_dyn`` tasks
that read their live rows from the plan input ``meta`` (and, under EP, the all-to-all sizes from
``comm``). The counts a graph is built with set only its simulated tile sizes and tags: a task
empty at those counts is simulated as skipped.
"""
from __future__ import annotations

from typing import Sequence

from megaloom.graphs.common.tiles import tile_ranges
from megaloom.graphs.moe.layout import Layout, make_plan
from megaloom.graphs.moe.ops import Cut
from megaloom.graphs.moe.spec import Counts, MegaMoESpec
from megaloom.graphs.moe.tasks import TaskBuilder
from megaloom.runtime.graph import Buffer, Task, TaskGraph
from megaloom.runtime.registry import COMM, VECTOR, get_op
from megaloom.scheduler.cost import DURATION_ATTR


class DynamicBuilder(TaskBuilder):
    """The tasks of a dynamic graph on ``counts.rank``: tiles of the layout's static row regions.

    At ``W == 1`` the layout is pooled (a tile's expert is picked at run time; ``tok`` and ``ws`` are
    in the pooled layout too); under EP each local expert owns a static slot."""

    def __init__(self, g: TaskGraph, spec: MegaMoESpec, counts: Counts, direction: str):
        super().__init__(g, spec, counts, direction)
        self.lay = Layout(spec, counts.rank)
        self.rows_of = self.blocks = [self.lay.region(e) for e in range(self.El)]  # blocks start on multiples of 32
        self.padded_rows, self.group_rows = self.lay.rows, [hi - lo for lo, hi in self.blocks]
        self.plan = make_plan(self.lay, counts)  # the plan of the build's counts: simulated sizes and tags
        self.meta = g.input("meta", (self.lay.tiles + self.El, 3), "int64")
        self.comm_meta = None if self.lay.pooled else g.input("comm", (2, self.El, self.W, 5), "int64")

    @staticmethod
    def rows(spec: MegaMoESpec, counts: Counts) -> tuple[int, int, int]:
        """The static capacity; pooled, ``tok`` and ``ws`` are padded too."""
        lay = Layout(spec, counts.rank)
        return lay.rows, spec.rows, lay.rows if lay.pooled else spec.rows

    def tiles(self) -> list[tuple[int | None, int, int, int | None]]:
        """The row tiles (expert, first row, end row, index); ``grouped``: one over every expert's rows."""
        tm, lay = self.spec.tile_m, self.lay
        if self.spec.grouped:
            return [(None, 0, lay.rows, None)]
        return [(self.plan.tile[j][0] if lay.pooled else j * tm // lay.slot, j * tm, (j + 1) * tm, j)
                for j in range(lay.tiles)]

    def experts(self, e: int) -> slice:
        return slice(None) if self.lay.pooled else slice(e, e + 1)  # pooled: the expert is picked at run time

    def tile_task(self, op: str, ins: list, outs: list, cuts: tuple[Sequence[Cut], Sequence[Cut]], name: str,
                  expert: int, j: int | None, attrs: dict | None = None, block: int | None = None) -> Task:
        """``moe_dyn`` over the live rows of tile ``j`` (or, with ``block``, of expert ``block``'s rows from
        its region's first row; with neither, of every expert's rows), read from the plan at run time."""
        kind = "b" if block is not None else "t" if j is not None else "g"
        if block is None:
            row = self.meta[j:j + 1] if kind == "t" else self.meta[self.lay.tiles:]
            sim, more = self.plan.tile[j][1] if kind == "t" else sum(self.plan.n), {}
        else:
            k = self.lay.tiles + block
            row, sim = self.meta[k:k + 1], self.plan.n[block]
            # a block written in part into a region other experts' blocks share (pooled) keeps their rows
            rmw = self.lay.pooled and block > 0 and any(c not in (Cut.WHOLE, Cut.EXPERT) for c in cuts[1])
            more = {"base": self.lay.region(block)[0], "rmw": rmw}
        codes = kind + "".join(cuts[0]) + "|" + "".join(cuts[1])
        attrs = {"op": op, "codes": codes, "sim": sim, **more, **(attrs or {})}
        if not sim:  # empty at the build's counts: simulated as skipped
            attrs[DURATION_ATTR] = 0.0
        return self.task("moe_dyn", [row, *ins, *(outs if more.get("rmw") else [])], outs, name, expert=expert,
                         engine=get_op(op).engine, attrs=attrs, kernel=op)

    def pack(self, src: Buffer, tok: Buffer, send: Buffer, recv: Buffer, scale: Buffer | None = None) -> None:
        """Pooled: straight into each tile of the recv layout; else into the send layout, expert-sorted (own
        rows reach recv in round 0 of the exchange)."""
        if self.lay.pooled:
            for e, a, b, j in self.tiles():
                ins = [src, tok[a:b]] + ([scale[a:b]] if scale is not None else [])
                self.tile_task("moe_gather", ins, [recv[a:b]], ((Cut.WHOLE,) + (Cut.ROWS,) * (len(ins) - 1),
                                                                (Cut.ROWS,)), f"gather.{a}", e, j)
            return
        for a, b in tile_ranges(self.spec.rows, self.spec.tile_m):
            ins = [src, tok[a:b]] + ([scale[a:b]] if scale is not None else [])
            self.task("moe_gather", ins, [send[a:b]], f"gather.{a}")

    def exchange(self, send: Buffer, recv: Buffer, e: int, combine: bool) -> None:
        """Every round of expert ``e`` in a static number of chunks, rows from the plan (round 0, the own
        rows, is a local copy); nothing to move when pooled."""
        if self.lay.pooled:
            return
        W, tile, d = self.W, self.spec.comm_tile, int(combine)
        lo, hi = self.lay.region(e)
        for j in range(W):
            to, frm = (self.rank + j) % W, (self.rank - j) % W
            src, dst = (recv[lo:hi], send) if combine else (send, recv[lo:hi])
            row = self.comm_meta[d:d + 1, e:e + 1, j:j + 1]
            s0, sn, d0, dn, most = self.plan.comm[d][e][j]
            for i in range(-(-self.spec.tokens // tile) if tile else 1):
                a, b = (i * tile, (i + 1) * tile) if tile else (0, most)
                attrs = {"to": to if j else -1, "frm": frm if j else -1, "world": W, "chunk": i, "tile": tile,
                         "sim": max(min(b, sn) - min(a, sn), min(b, dn) - min(a, dn))}
                if a >= most:  # no rank moves rows in this chunk at the build's counts: simulated as skipped
                    attrs[DURATION_ATTR] = 0.0
                ins = [row, src, dst]
                if not (i or j or (combine and e)):  # the first task writing dst: rows of no other task kept
                    ins, attrs["rows"] = ins[:2], dst.shape[0]
                if not j:  # own rows: a local copy
                    self.task("moe_exchange", ins, [dst], f"{self._stage}.e{e}.self.{i}", expert=e,
                              peer=self.rank, engine=VECTOR, attrs=attrs)
                    continue
                t = self.task("moe_exchange", ins, [dst], f"{self._stage}.e{e}.j{j}.{i}", expert=e,
                              peer=to, engine=COMM, round=j, link="intra", attrs=attrs)
                self.comm_task(t, e, combine)
