"""The task builder of MegaMoE's graphs: tags, stage barriers, the collective chain, and the
GEMM, SwiGLU and MXFP8 stages laid over the row tiles of the recv layout.

Where the rows are is the subclass's: :class:`~.counts.CountsBuilder` (rows from the per-expert
counts of a build) or :class:`~.dynamic.DynamicBuilder` (static capacity, rows read from a plan
at run time). Each tile task says how it cuts its operands with :class:`~.ops.Cut` values.
"""
from __future__ import annotations

from typing import Any

from megaloom.graphs.common.tags import tags
from megaloom.graphs.common.tiles import split, tile_ranges
from megaloom.graphs.moe.ops import Cut, swiglu_program
from megaloom.graphs.moe.spec import Counts, MegaMoESpec
from megaloom.ops.mxfp8.format import BLOCK
from megaloom.runtime.graph import Buffer, Region, Task, TaskGraph
from megaloom.runtime.registry import VECTOR

FP8, E8M0 = "float8_e4m3fn", "float8_e8m0fnu"
MX = tuple[Buffer, Buffer]  # an MXFP8 operand: FP8 payload and E8M0 scales


class TaskBuilder:
    """Adds the tasks of one direction of a rank's graph. Where the rows are is the subclass's: static
    ``rows(spec, counts)`` (rows of the recv and send layouts and of ``tok`` / ``ws``), ``tiles()``,
    ``experts(e)``, ``tile_task(...)``, ``pack(...)``, ``exchange(...)`` (see :class:`~.counts.CountsBuilder`),
    and, per local expert ``e``, ``rows_of[e]`` (the rows of the recv layout its tasks cover), ``blocks[e]``
    (its block of the token-axis MXFP8 layout, ``padded_rows`` rows in all) and ``group_rows[e]`` (the rows
    its token-axis MXFP8 weight-gradient tiles declare)."""

    def __init__(self, g: TaskGraph, spec: MegaMoESpec, counts: Counts, direction: str):
        self.g, self.spec, self.c, self.direction = g, spec, counts, direction
        self.rank, self.W, self.El = counts.rank, spec.ep, spec.experts_local
        self.sequential = spec.schedule == "sequential"
        self._stage_tasks: list[Task] = []
        self._barrier: Task | None = None
        self._comm: list[tuple[tuple[int, int, int], Task]] = []

    # -- bookkeeping ---------------------------------------------------------------
    def stage(self, name: str) -> None:
        """Start stage ``name``; under ``sequential`` it waits for every earlier task.
        A task's ``stage`` tag is the current stage unless it passes its own."""
        if self.sequential and self._stage_tasks:
            self._barrier = self.g.task("noop", name=f"barrier.{self.direction}.{name}", engine=VECTOR,
                                        after=self._stage_tasks, tags=self.tags(name))
            self._stage_tasks = []
        self._stage = name

    def tags(self, stage: str, expert: int | None = None, peer: int | None = None) -> dict:
        group = None if expert is None else self.spec.group_of(expert)
        return tags(stage=stage, rank=self.rank, direction=self.direction, expert=expert, group=group, peer=peer)

    def task(self, op: str, ins, outs, name: str, expert: int | None = None, peer: int | None = None,
             engine: str | None = None, attrs: dict | None = None, **more: Any) -> Task:
        prio = 0 if expert is None or self.sequential else -self.spec.group_of(expert)
        t = self.g.task(op, ins, outs, name=f"{self.direction}.{name}", engine=engine, attrs=attrs,
                        priority=prio, tags={**self.tags(self._stage, expert, peer), **tags(**more)},
                        after=(self._barrier,) if self._barrier is not None else ())
        self._stage_tasks.append(t)
        return t

    def comm_task(self, t: Task, e: int, combine: bool) -> None:
        """Put collective ``t`` of expert ``e`` in the chain of :meth:`chain_comm`."""
        grp = self.spec.group_of(e)
        # sequential: all dispatches, then all combines; else D0 D1 C0 D2 C1 ...: dispatch a group ahead
        slot = (int(combine), grp, e) if self.sequential else (2 * grp + 3 if combine else 2 * grp, grp, e)
        self._comm.append((slot, t))

    def chain_comm(self) -> None:
        """Issue the collectives in one order on every rank (control edges; ``ordered_comm``)."""
        if not self.spec.ordered_comm:
            return
        ordered = [t for _, t in sorted(self._comm, key=lambda kt: (kt[0], kt[1].id))]
        for a, b in zip(ordered, ordered[1:]):
            a.precede(b)

    # -- stages ----------------------------------------------------------------------
    def gemm_tiles(self, stage: str, x: Buffer | MX, w: Buffer | MX, out: Buffer, n: int, trans: bool) -> None:
        """Row tiles x column blocks of ``out[rows_e] = x[rows_e] @ w[e]`` (``w[e]^T`` with ``trans``) for
        every expert; on MXFP8 operands (payload, scales) an ``mx_grouped_matmul`` of layout NN (NT)."""
        dt = self.spec.dtype
        for e, a, b, j in self.tiles():
            for c0, c1 in split(n, self.spec.cube_split):
                # column block c of x @ W[e] is x @ W[e][:, c]; of x @ W[e]^T, x @ W[e][c, :]^T
                cols = (self.experts(e), *((slice(c0, c1), slice(None)) if trans else (slice(None), slice(c0, c1))))
                dst, name = [out[a:b, c0:c1]], f"{stage}.e{e}.{a}.c{c0}"
                if isinstance(x, tuple):
                    self.tile_task("mx_grouped_matmul", [x[0][a:b], x[1][a:b], w[0][cols], w[1][cols]], dst,
                                   ((Cut.ROWS, Cut.ROWS, Cut.EXPERT, Cut.EXPERT), (Cut.ROWS,)), name, e, j,
                                   attrs={"group_offsets": [b - a], "layout": "NT" if trans else "NN", "out_dtype": dt})
                else:
                    self.tile_task("moe_gmm", [x[a:b], w[cols]], dst, ((Cut.ROWS, Cut.EXPERT), (Cut.ROWS,)), name, e, j,
                                   attrs={"trans_w": True} if trans else None)

    def swiglu_tiles(self, stage: str, gu: Buffer, out: Buffer, da: Buffer | None = None) -> None:
        """SwiGLU of ``gu = [gate | up]`` into ``out`` (with ``da``: its gradient ``[dgate | dup]``) on each
        row tile of every expert: ``dvm.fused`` tasks under ``fuse_vector``, else the unfused op. In a
        dynamic graph a fused tile runs on its whole tile (its program has the tile's shape; rows past
        the live ones hold values nothing reads) and an empty tile returns at once."""
        inter, made = gu.shape[1] // 2, {}
        for e, a, b, j in self.tiles():
            if not self.spec.fuse_vector or self.spec.grouped:  # the unfused op
                ins = [gu[a:b]] if da is None else [gu[a:b], da[a:b]]
                self.tile_task(stage, ins, [out[a:b]], ((Cut.ROWS,) * len(ins), (Cut.ROWS,)), f"{stage}.e{e}.{a}", e, j)
                continue
            halves = [gu[a:b, :inter], gu[a:b, inter:]]
            if da is None:
                ins, outs = halves, [out[a:b]]
            else:
                ins, outs = [da[a:b], *halves], [out[a:b, :inter], out[a:b, inter:]]
            if b - a not in made:  # one attrs dict per tile shape: the program is decoded once
                made[b - a] = swiglu_program(b - a, inter, self.spec.dtype, backward=da is not None)
            self.tile_task("dvm.fused", ins, outs, ((Cut.WHOLE,) * len(ins), (Cut.WHOLE,) * len(outs)),
                           f"{stage}.e{e}.{a}", e, j, attrs=made[b - a])

    def wgrad(self, stage: str, a: Buffer | MX, b: Buffer | MX, out: Buffer) -> None:
        """``out[e] = a[rows_e]^T @ b[rows_e]`` per expert in ``wgrad_split x cube_split`` output
        blocks (zeros for an idle expert; ``grouped``: one task per block over every expert); the weight
        gradient stays on this rank. On token-axis MXFP8 operands (payload, scales), an
        ``mx_grouped_matmul`` of layout TN over the padded blocks."""
        for e in [None] if self.spec.grouped else range(self.El):  # grouped: one task over every expert
            (lo, hi), (p0, p1) = ((0, self.padded_rows),) * 2 if e is None else (self.rows_of[e], self.blocks[e])
            rows, srows = slice(p0, p1), slice(p0 // BLOCK, p1 // BLOCK)
            at = slice(None) if e is None else slice(e, e + 1)
            for k0, k1 in split(out.shape[1], self.spec.wgrad_split):
                for c0, c1 in split(out.shape[2], self.spec.cube_split):
                    dst, name = [out[at, k0:k1, c0:c1]], f"{stage}.e{e}.k{k0}.c{c0}"
                    if isinstance(a, tuple):
                        self.tile_task("mx_grouped_matmul", [a[0][rows, k0:k1], a[1][srows, k0:k1], b[0][rows, c0:c1],
                                                             b[1][srows, c0:c1]], dst,
                                       ((Cut.PADDED, Cut.SCALES, Cut.PADDED, Cut.SCALES), (Cut.EXPERT,)), name, e, None,
                                       block=e, attrs={"group_offsets": [self.group_rows[e]], "layout": "TN",
                                                       "out_dtype": self.spec.dtype})
                    else:
                        self.tile_task("moe_wgrad", [a[lo:hi, k0:k1], b[lo:hi, c0:c1]], dst,
                                       ((Cut.ROWS, Cut.ROWS), (Cut.EXPERT,)), name, e, None, block=e)

    def token_tiles_of(self) -> list[tuple[int, int]]:
        """The token tiles of the top-k sums: ``tile_m`` tokens each, or (``grouped``) all in one."""
        return tile_ranges(self.spec.tokens, max(1, self.spec.tokens) if self.spec.grouped else self.spec.tile_m)

    def token_tiles(self, op: str, full: list[Region | Buffer], tiled: list[Buffer], out: Buffer, stage: str) -> None:
        """``op(*full, *tiled[tile])`` for each token tile."""
        for a, b in self.token_tiles_of():
            self.task(op, [*full, *(x[a:b] for x in tiled)], [out[a:b]], f"{stage}.{a}")

    # -- MXFP8: quantisation tasks of ``quant_cols`` columns each ------------------------
    def quant_rows(self, stage: str, src: Buffer, q: tuple[Buffer, Buffer]) -> None:
        """Row-wise (along the last dim) quantisation of every row tile of every expert, in column chunks."""
        for e, a, b, j in self.tiles():
            for c0, c1 in tile_ranges(src.shape[1], self.spec.quant_cols):
                self.tile_task("mx_quantize", [src[a:b, c0:c1]], [q[0][a:b, c0:c1], q[1][a:b, c0 // BLOCK:c1 // BLOCK]],
                               ((Cut.ROWS,), (Cut.ROWS, Cut.ROWS)), f"{stage}.e{e}.{a}.c{c0}", e, j,
                               attrs={"scale_mode": self.spec.scale_mode, "axis": "rows"})

    def quant_tokens(self, stage: str, src: Buffer, q: tuple[Buffer, Buffer]) -> None:
        """Token-axis quantisation of each expert's rows into its padded block of ``q``, in column chunks."""
        for e in range(self.El):
            (lo, hi), (p0, p1) = self.rows_of[e], self.blocks[e]
            for c0, c1 in tile_ranges(src.shape[1], self.spec.quant_cols) if hi > lo else ():
                self.tile_task("mx_quantize_grouped", [src[lo:hi, c0:c1]],
                               [q[0][p0:p1, c0:c1], q[1][p0 // BLOCK:p1 // BLOCK, c0:c1]],
                               ((Cut.ROWS,), (Cut.PADDED, Cut.SCALES)), f"{stage}.e{e}.c{c0}", e, None,
                               attrs={"scale_mode": self.spec.scale_mode, "group_offsets": [hi - lo], "axis": "cols"},
                               block=e)

    def quant_weights(self, stage: str, w: Buffer, q: tuple[Buffer, Buffer], axis: str) -> None:
        """Each expert's weight ``[K, N]`` quantised along ``axis`` (``cols``: along K, chunks of the N
        columns; ``rows``: along N, chunks of the K rows); experts without rows are not needed."""
        for e in range(self.El):
            lo, hi = self.rows_of[e]
            for c0, c1 in tile_ranges(w.shape[2 if axis == "cols" else 1], self.spec.quant_cols) if hi > lo else ():
                cols = (slice(None), slice(c0, c1)) if axis == "cols" else (slice(c0, c1), slice(None))
                at = (slice(e, e + 1), *cols)
                self.task("mx_quantize", [w[at]], [q[0][at], q[1][at]], f"{stage}.e{e}.c{c0}", expert=e,
                          attrs={"scale_mode": self.spec.scale_mode, "axis": axis})

    def forward_gemm(self, stage: str, x: Buffer, w: Buffer, out: Buffer, save: bool) -> None:
        """``out[e] = x[e] @ w[e]`` per expert, in the spec's precision; under MXFP8 with ``save``, ``x`` is
        also kept as the token-axis FP8 output ``<x>_mx`` (what the weight gradient reads)."""
        n = out.shape[1]
        if not self.spec.mxfp8:
            return self.gemm_tiles(stage, x, w, out, n, trans=False)
        wq = mx_buffers(self.g, f"{w.name}_q", w.shape, "cols")
        xq = mx_buffers(self.g, f"{x.name}_q", x.shape, "rows")
        self.quant_weights(f"quant_{w.name}", w, wq, "cols")
        self.quant_rows(f"quant_{x.name}", x, xq)
        if save:
            xt = mx_buffers(self.g, f"{x.name}_mx", (self.padded_rows, x.shape[1]), "cols", self.g.output)
            self.quant_tokens(f"quant_{x.name}_t", x, xt)
        self.gemm_tiles(stage, xq, wq, out, n, trans=False)

    def backward_gemms(self, which: str, dy: Buffer, w: Buffer, dx: Buffer, act: Buffer | tuple[Buffer, Buffer],
                       dw: Buffer) -> None:
        """GEMM ``which`` backward: ``dx = dy w[e]^T`` per expert and ``dw[e] = act[e]^T dy[e]`` (``act``:
        the saved forward input; under MXFP8 its token-axis FP8 payload and scales)."""
        n = dx.shape[1]
        if not self.spec.mxfp8:
            self.gemm_tiles(f"dgmm{which}", dy, w, dx, n, trans=True)
            return self.wgrad(f"wgrad{which}", act, dy, dw)
        wq = mx_buffers(self.g, f"{w.name}_q", w.shape, "rows")
        dyq = mx_buffers(self.g, f"{dy.name}_q", dy.shape, "rows")
        dyt = mx_buffers(self.g, f"{dy.name}_mx", (self.padded_rows, dy.shape[1]), "cols")
        self.quant_weights(f"quant_{w.name}", w, wq, "rows")
        self.quant_rows(f"quant_{dy.name}", dy, dyq)
        self.quant_tokens(f"quant_{dy.name}_t", dy, dyt)
        self.gemm_tiles(f"dgmm{which}", dyq, wq, dx, n, trans=True)
        self.wgrad(f"wgrad{which}", act, dyt, dw)


def mx_buffers(g: TaskGraph, name: str, shape: tuple[int, ...], axis: str, make: Any = None) -> MX:
    """FP8 payload and E8M0 scales of a tensor of ``shape`` blocked along ``axis`` (rows: last dim;
    cols: dim -2), as graph buffers (made by ``make``: ``g.buffer`` by default, or ``g.output``, ``g.input``)."""
    make = make or g.buffer
    d = -1 if axis == "rows" else -2
    scales = list(shape)
    scales[d] //= BLOCK
    return make(name, shape, FP8), make(f"{name}_scales", tuple(scales), E8M0)
