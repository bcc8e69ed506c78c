"""MegaMoE forward and backward task graphs (one EP rank's view), tile by tile.

Forward, per local expert ``e`` (dependencies are per expert, so experts overlap)::

    x --gather--> xs --all_to_all--> xr[e] --GMM1--> gu[e] --SwiGLU--> a[e] --GMM2--> y[e]
                  (self rows go straight to xr)                                       |
    out <--weighted sum over top-k-- yc <--all_to_all (combine; self rows: copy)------+

Backward::

    dout --gather * w--> dys --all_to_all--> dyr[e] --+--> dA = dY W2^T --SwiGLU grad--> dgu[e]
                                                      +--> dW2[e] = A^T dY             |
    dx <--sum over top-k-- dxs <--all_to_all-- dxr[e] <-- dX = dG W1^T <---------------+
                                                          dW1[e] = X^T dG <------------+
    dw[t, j] = <dout[t], yc[pos[t, j]]>  (top-k weight gradient, off the expert path)

All-to-alls go in rounds with a rotated destination order: in round ``j`` rank ``r``
sends to ``(r + j) % W`` and receives from ``(r - j) % W`` (rank r starts with r + 1;
round 0, its own rows, is a local copy); one collective per (expert, round, chunk of at
most ``comm_tile`` rows), the chunk count being the same on every rank. Every rank issues the same collectives in the
same order (a chain of control edges, ``ordered_comm``), so real execution never
mismatches collectives; a round no rank has rows for is skipped on every rank. Without
the chain (``ordered_comm=False``: simulation of one-sided puts, as MegaKernels issue
them) comm tasks of different peers and experts may run at once on several channels.
Tasks carry the tags ``stage``, ``expert``, ``group``, ``rank``, ``peer``, ``direction``
(and ``round`` and ``link`` for comm).

Schedules: ``sequential`` puts a barrier between stages (the no-overlap baseline);
``interleaved`` keeps only data dependencies, gives expert group ``g`` priority
``-g``, and runs dispatch one group ahead of combine in the collective chain.

With ``precision="mxfp8"`` every expert GEMM is an ``mx_grouped_matmul`` tile (cube) on
operands quantised by vector tasks: activations row-wise per row tile (``mx_quantize``),
weights per expert along the contraction dim, and, for the weight gradients, activations and
output gradients along tokens per expert (``mx_quantize_grouped``: each expert's rows padded
to 32). Layouts: forward ``X W`` and ``A W2`` are NN (weights quantised along their rows'
dim), input gradients ``dY W2^T`` and ``dG W1^T`` are NT, weight gradients ``A^T dY`` and
``X^T dG`` are TN. The forward saves ``xr`` and ``a`` only as their token-axis FP8 payload and
scales (``xr_mx``, ``a_mx``: what the weight gradients read), as MXFP8Linear saves its input.
"""
from __future__ import annotations

from typing import Any

from megaloom.graphs.common.builder import GraphBuilder
from megaloom.graphs.common.spec import load_options, parse_spec
from megaloom.graphs.common.tags import tags
from megaloom.graphs.common.tiles import split, tile_ranges
from megaloom.graphs.moe import ops  # noqa: F401  (registers the MoE ops)
from megaloom.graphs.moe.ops import swiglu_program
from megaloom.graphs.moe.spec import Counts, MegaMoESpec, synthetic_counts
from megaloom.ops.mxfp8.format import BLOCK
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import Buffer, Region, Task, TaskGraph

FWD_STAGES = ("dispatch", "gmm1", "swiglu", "gmm2", "combine", "weighted_sum")
BWD_STAGES = ("dispatch", "dgmm2", "swiglu_grad", "dgmm1", "combine", "unpermute", "topk_grad")
FP8, E8M0 = "float8_e4m3fn", "float8_e8m0fnu"


def saved_names(spec: MegaMoESpec) -> tuple[str, ...]:
    """The forward's outputs that its backward reads, in order."""
    if spec.mxfp8:
        return ("xr_mx", "xr_mx_scales", "gu", "a_mx", "a_mx_scales", "yc")
    return ("xr", "gu", "a", "yc")


def _chunk(block: tuple[int, int], i: int, tile: int) -> tuple[int, int]:
    """Chunk ``i`` of ``tile`` rows of a row block (empty past its end)."""
    lo, hi = block
    return min(lo + i * tile, hi), min(lo + (i + 1) * tile, hi)


class _Builder:
    """Adds the tasks of one direction: tags, stage barriers, the collective chain."""

    def __init__(self, g: TaskGraph, spec: MegaMoESpec, counts: Counts, direction: str):
        self.g, self.spec, self.c, self.direction = g, spec, counts, direction
        self.rank, self.W, self.El = counts.rank, spec.ep, spec.experts_local
        self.sequential = spec.schedule == "sequential"
        self._stage_tasks: list[Task] = []
        self._barrier: Task | None = None
        self._comm: list[tuple[tuple[int, int, int], Task]] = []
        self.padded, at = [], 0  # each local expert's rows in the token-axis MXFP8 layout (padded to 32)
        for e in range(self.El):
            lo, hi = counts.expert_rows(e)
            self.padded.append((at, at + -(-(hi - lo) // BLOCK) * BLOCK))
            at = self.padded[-1][1]

    # -- bookkeeping ---------------------------------------------------------------
    def stage(self, name: str) -> None:
        """Start stage ``name``; under ``sequential`` it waits for every earlier task.
        A task's ``stage`` tag is the current stage unless it passes its own."""
        if self.sequential and self._stage_tasks:
            self._barrier = self.g.task("noop", name=f"barrier.{self.direction}.{name}", engine="vector",
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

    # -- shared pieces ---------------------------------------------------------------
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
        """One expert's all-to-all rounds, each in chunks of at most ``comm_tile`` rows;
        ``combine`` runs them from recv layout back to send layout."""
        c, r, W, e = self.c, self.rank, self.W, expert
        for j in range(1, W):
            to, frm = (r + j) % W, (r - j) % W
            if combine:  # owner r returns the rows of source `to`; gets its own rows back from `frm`
                rows = [c.pair((s + j) % W, s, e) for s in range(W)]  # what rank s sends in this round
                src_blk, dst_blk = c.recv_block(e, to), c.send_block(frm, e)
            else:
                rows = [c.pair(s, (s + j) % W, e) for s in range(W)]
                src_blk, dst_blk = c.send_block(to, e), c.recv_block(e, frm)
            src_buf, dst_buf = (recv, send) if combine else (send, recv)
            tile = self.spec.comm_tile or max(rows + [1])
            chunks = max(-(-n // tile) for n in rows)  # the same on every rank: 0 skips the round
            for i in range(chunks):
                (s0, s1), (d0, d1) = _chunk(src_blk, i, tile), _chunk(dst_blk, i, tile)
                splits_s, splits_r = [0] * W, [0] * W
                splits_s[to], splits_r[frm] = s1 - s0, d1 - d0
                t = self.task("all_to_all", [src_buf[s0:s1]], [dst_buf[d0:d1]], f"{self._stage}.e{e}.j{j}.{i}",
                              expert=e, peer=to, engine="comm", round=j, link="intra",
                              attrs={"send_splits": splits_s, "recv_splits": splits_r})
                self._comm.append((self._chain_slot(e, combine), t))
        if combine and W > 1:  # own rows
            lo, hi = c.recv_block(e, r)
            if hi > lo:
                s0 = c.send_block(r, e)[0]
                self.task("copy", [recv[lo:hi]], [send[s0:s0 + hi - lo]], f"{self._stage}.e{e}.self",
                          expert=e, peer=r, engine="vector")

    def _chain_slot(self, e: int, combine: bool) -> tuple[int, int, int]:
        grp = self.spec.group_of(e)
        if self.sequential:
            return (int(combine), grp, e)
        return (2 * grp + 3 if combine else 2 * grp, grp, e)  # D0 D1 C0 D2 C1 ...: dispatch a group ahead

    def chain_comm(self) -> None:
        """Issue the collectives in one order on every rank (control edges; ``ordered_comm``)."""
        if not self.spec.ordered_comm:
            return
        ordered = [t for _, t in sorted(self._comm, key=lambda kt: (kt[0], kt[1].id))]
        for a, b in zip(ordered, ordered[1:]):
            a.precede(b)

    def gemm_tiles(self, stage: str, op_in: Buffer, weight: Buffer, out: Buffer, n: int, trans: bool) -> None:
        """Row tiles x column blocks of ``out[rows_e] = op_in[rows_e] @ weight[e]`` for every expert."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for a, b in tile_ranges(hi, self.spec.tile_m, lo):
                for c0, c1 in split(n, self.spec.cube_split):
                    # column block c of op_in @ W[e] is op_in @ W[e][:, c]; of op_in @ W[e]^T, op_in @ W[e][c, :]^T
                    w = weight[e:e + 1, c0:c1, :] if trans else weight[e:e + 1, :, c0:c1]
                    self.task("moe_gmm", [op_in[a:b], w], [out[a:b, c0:c1]], f"{stage}.e{e}.{a}.c{c0}",
                              expert=e, engine="cube", attrs={"trans_w": True} if trans else None)

    def row_tiles(self, op: str, ins: list[Buffer], out: Buffer, stage: str) -> None:
        """A vector op applied to each row tile of every expert."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for a, b in tile_ranges(hi, self.spec.tile_m, lo):
                self.task(op, [x[a:b] for x in ins], [out[a:b]], f"{stage}.e{e}.{a}", expert=e)

    def swiglu_tiles(self, stage: str, gu: Buffer, out: Buffer, da: Buffer | None = None) -> None:
        """SwiGLU of ``gu = [gate | up]`` into ``out`` (with ``da``: its gradient ``[dgate | dup]``) on each
        row tile of every expert: ``dvm.fused`` tasks under ``fuse_vector``, else the unfused op."""
        if not self.spec.fuse_vector:
            return self.row_tiles(stage, [gu] if da is None else [gu, da], out, stage)
        inter, made = gu.shape[1] // 2, {}
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for a, b in tile_ranges(hi, self.spec.tile_m, lo):
                halves = [gu[a:b, :inter], gu[a:b, inter:]]
                if da is None:
                    ins, outs = halves, [out[a:b]]
                else:
                    ins, outs = [da[a:b], *halves], [out[a:b, :inter], out[a:b, inter:]]
                if b - a not in made:  # one attrs dict per tile shape: the program is decoded once
                    made[b - a] = swiglu_program(b - a, inter, self.spec.dtype, backward=da is not None)
                self.task("dvm.fused", ins, outs, f"{stage}.e{e}.{a}", expert=e, attrs=made[b - a])

    def wgrad(self, stage: str, a: Buffer, b: Buffer, out: Buffer) -> None:
        """``out[e] = a[rows_e]^T @ b[rows_e]`` per expert in ``wgrad_split x cube_split`` output
        blocks (zeros for an idle expert); the weight gradient stays on this rank."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for k0, k1 in split(out.shape[1], self.spec.wgrad_split):
                for c0, c1 in split(out.shape[2], self.spec.cube_split):
                    self.task("moe_wgrad", [a[lo:hi, k0:k1], b[lo:hi, c0:c1]], [out[e:e + 1, k0:k1, c0:c1]],
                              f"{stage}.e{e}.k{k0}.c{c0}", expert=e, engine="cube")

    # -- MXFP8 ------------------------------------------------------------------------
    def mx_attrs(self, **attrs: Any) -> dict:
        return {"scale_mode": self.spec.scale_mode, **attrs}

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """Column ranges of one quantisation task each (``quant_cols`` wide)."""
        return tile_ranges(n, self.spec.quant_cols)

    def quant_rows(self, stage: str, src: Buffer, q: tuple[Buffer, Buffer]) -> None:
        """Row-wise (along the last dim) quantisation of every row tile of every expert, in column chunks."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for a, b in tile_ranges(hi, self.spec.tile_m, lo):
                for c0, c1 in self.chunks(src.shape[1]):
                    self.task("mx_quantize", [src[a:b, c0:c1]], [q[0][a:b, c0:c1], q[1][a:b, c0 // BLOCK:c1 // BLOCK]],
                              f"{stage}.e{e}.{a}.c{c0}", expert=e, attrs=self.mx_attrs(axis="rows"))

    def quant_tokens(self, stage: str, src: Buffer, q: tuple[Buffer, Buffer]) -> None:
        """Token-axis quantisation of each expert's rows into its padded block of ``q``, in column chunks."""
        for e in range(self.El):
            (lo, hi), (p0, p1) = self.c.expert_rows(e), self.padded[e]
            for c0, c1 in self.chunks(src.shape[1]) if hi > lo else ():
                self.task("mx_quantize_grouped", [src[lo:hi, c0:c1]],
                          [q[0][p0:p1, c0:c1], q[1][p0 // BLOCK:p1 // BLOCK, c0:c1]], f"{stage}.e{e}.c{c0}", expert=e,
                          attrs=self.mx_attrs(group_offsets=[hi - lo], axis="cols"))

    def quant_weights(self, stage: str, w: Buffer, q: tuple[Buffer, Buffer], axis: str) -> None:
        """Each expert's weight ``[K, N]`` quantised along ``axis`` (``cols``: along K, chunks of the N
        columns; ``rows``: along N, chunks of the K rows); experts without rows are not needed."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for c0, c1 in self.chunks(w.shape[2 if axis == "cols" else 1]) if hi > lo else ():
                at = (slice(e, e + 1), slice(None), slice(c0, c1)) if axis == "cols" else (
                    slice(e, e + 1), slice(c0, c1), slice(None))
                self.task("mx_quantize", [w[at]], [q[0][at], q[1][at]], f"{stage}.e{e}.c{c0}", expert=e,
                          attrs=self.mx_attrs(axis=axis))

    def mx_gemm_tiles(self, stage: str, a: tuple[Buffer, Buffer], w: tuple[Buffer, Buffer], out: Buffer, n: int,
                      layout: str) -> None:
        """:meth:`gemm_tiles` on MXFP8 operands: NN (``a @ W[e]``) or NT (``a @ W[e]^T``)."""
        for e in range(self.El):
            lo, hi = self.c.expert_rows(e)
            for r0, r1 in tile_ranges(hi, self.spec.tile_m, lo):
                for c0, c1 in split(n, self.spec.cube_split):
                    cols = (slice(e, e + 1), slice(None), slice(c0, c1)) if layout == "NN" else (
                        slice(e, e + 1), slice(c0, c1), slice(None))
                    self.task("mx_grouped_matmul", [a[0][r0:r1], a[1][r0:r1], w[0][cols], w[1][cols]],
                              [out[r0:r1, c0:c1]], f"{stage}.e{e}.{r0}.c{c0}", expert=e, engine="cube",
                              attrs={"group_offsets": [r1 - r0], "layout": layout, "out_dtype": self.spec.dtype})

    def mx_wgrad(self, stage: str, a: tuple[Buffer, Buffer], b: tuple[Buffer, Buffer], out: Buffer) -> None:
        """:meth:`wgrad` on token-axis MXFP8 operands (layout TN; zeros for an idle expert)."""
        for e in range(self.El):
            (lo, hi), (p0, p1) = self.c.expert_rows(e), self.padded[e]
            rows, srows = slice(p0, p1), slice(p0 // BLOCK, p1 // BLOCK)
            for k0, k1 in split(out.shape[1], self.spec.wgrad_split):
                for c0, c1 in split(out.shape[2], self.spec.cube_split):
                    self.task("mx_grouped_matmul", [a[0][rows, k0:k1], a[1][srows, k0:k1], b[0][rows, c0:c1],
                                                    b[1][srows, c0:c1]], [out[e:e + 1, k0:k1, c0:c1]],
                              f"{stage}.e{e}.k{k0}.c{c0}", expert=e, engine="cube",
                              attrs={"group_offsets": [hi - lo], "layout": "TN", "out_dtype": self.spec.dtype})

    def forward_gemm(self, stage: str, x: Buffer, w: Buffer, out: Buffer, save: bool) -> None:
        """``out[e] = x[e] @ w[e]`` per expert, in the spec's precision; under MXFP8 with ``save``, ``x`` is
        also kept as the token-axis FP8 output ``<x>_mx`` (what the weight gradient reads)."""
        n = out.shape[1]
        if not self.spec.mxfp8:
            self.gemm_tiles(stage, x, w, out, n, trans=False)
            return
        wq, xq = _mx_buffers(self.g, f"{w.name}_q", w.shape, "cols"), _mx_buffers(self.g, f"{x.name}_q", x.shape, "rows")
        self.quant_weights(f"quant_{w.name}", w, wq, "cols")
        self.quant_rows(f"quant_{x.name}", x, xq)
        if save:
            self.quant_tokens(f"quant_{x.name}_t", x, _mx_buffers(self.g, f"{x.name}_mx", (self.padded_rows,
                                                                                         x.shape[1]), "cols", out=True))
        self.mx_gemm_tiles(stage, xq, wq, out, n, "NN")

    def backward_gemms(self, which: str, dy: Buffer, w: Buffer, dx: Buffer, act: Buffer | tuple[Buffer, Buffer],
                       dw: Buffer) -> None:
        """GEMM ``which`` backward: ``dx = dy w[e]^T`` per expert and ``dw[e] = act[e]^T dy[e]`` (``act``:
        the saved forward input; under MXFP8 its token-axis FP8 payload and scales)."""
        n = dx.shape[1]
        if not self.spec.mxfp8:
            self.gemm_tiles(f"dgmm{which}", dy, w, dx, n, trans=True)
            self.wgrad(f"wgrad{which}", act, dy, dw)
            return
        wq, dyq = _mx_buffers(self.g, f"{w.name}_q", w.shape, "rows"), _mx_buffers(self.g, f"{dy.name}_q", dy.shape, "rows")
        dyt = _mx_buffers(self.g, f"{dy.name}_mx", (self.padded_rows, dy.shape[1]), "cols")
        self.quant_weights(f"quant_{w.name}", w, wq, "rows")
        self.quant_rows(f"quant_{dy.name}", dy, dyq)
        self.quant_tokens(f"quant_{dy.name}_t", dy, dyt)
        self.mx_gemm_tiles(f"dgmm{which}", dyq, wq, dx, n, "NT")
        self.mx_wgrad(f"wgrad{which}", act, dyt, dw)

    @property
    def padded_rows(self) -> int:
        """Rows of the token-axis MXFP8 layout (every local expert's rows padded to 32)."""
        return self.padded[-1][1] if self.padded else 0

    def token_tiles(self, op: str, full: list[Region | Buffer], tiled: list[Buffer], out: Buffer, stage: str) -> None:
        """``op(*full, *tiled[tile])`` for each token tile."""
        for a, b in tile_ranges(self.spec.tokens, self.spec.tile_m):
            self.task(op, [*full, *(x[a:b] for x in tiled)], [out[a:b]], f"{stage}.{a}")


def _mx_buffers(g: TaskGraph, name: str, shape: tuple[int, ...], axis: str, out: bool = False
                ) -> tuple[Buffer, Buffer]:
    """FP8 payload and E8M0 scales of a tensor of ``shape`` blocked along ``axis`` (rows: last dim;
    cols: dim -2), as graph buffers (outputs with ``out``)."""
    make = g.output if out else g.buffer
    d = -1 if axis == "rows" else -2
    scales = list(shape)
    scales[d] //= BLOCK
    return make(name, shape, FP8), make(f"{name}_scales", tuple(scales), E8M0)


def _layout_buffers(g: TaskGraph, spec: MegaMoESpec, c: Counts, names: tuple[str, str], keep: tuple[bool, bool]):
    """The send-layout and recv-layout buffers of one row stream (one buffer when W == 1)."""
    def make(name: str, rows: int, out: bool) -> Buffer:
        return (g.output if out else g.buffer)(name, (rows, spec.hidden), spec.dtype)
    if spec.ep == 1:  # the layouts coincide
        one = make(names[0] if keep[0] else names[1], c.recv_rows, any(keep))
        return one, one
    return make(names[0], c.send_rows, keep[0]), make(names[1], c.recv_rows, keep[1])


def build_forward(spec: MegaMoESpec, counts: Counts, *, save: bool = True) -> TaskGraph:
    """Forward graph of rank ``counts.rank``. Inputs ``x [T, H]``, ``tok [S]``, ``pos [T, k]``,
    ``w [T, k]``, ``gate_up [E_l, H, 2I]``, ``down [E_l, I, H]``; output ``out [T, H]`` and,
    with ``save``, the activations the backward graph needs (:func:`saved_names`)."""
    T, H, I, k, El = spec.tokens, spec.hidden, spec.intermediate, spec.top_k, spec.experts_local
    dt, R, S = spec.dtype, counts.recv_rows, counts.send_rows
    g = TaskGraph(f"megamoe.fwd.r{counts.rank}")
    x, tok = g.input("x", (T, H), dt), g.input("tok", (S,), "int64")
    pos, w = g.input("pos", (T, k), "int64"), g.input("w", (T, k), dt)
    w1, w2 = g.input("gate_up", (El, H, 2 * I), dt), g.input("down", (El, I, H), dt)
    mx = spec.mxfp8
    keep = g.output if save else g.buffer
    xs, xr = _layout_buffers(g, spec, counts, ("xs", "xr"), (False, save and not mx))
    gu, a = keep("gu", (R, 2 * I), dt), (keep if not mx else g.buffer)("a", (R, I), dt)
    yc, y = _layout_buffers(g, spec, counts, ("yc", "y"), (save, False))
    out = g.output("out", (T, H), dt)

    b = _Builder(g, spec, counts, "fwd")
    b.stage("dispatch")
    b.pack(x, tok, xs, xr)
    for e in range(El):
        b.exchange(xs, xr, e, combine=False)
    b.stage("gmm1")
    b.forward_gemm("gmm1", xr, w1, gu, save)
    b.stage("swiglu")
    b.swiglu_tiles("swiglu", gu, a)
    b.stage("gmm2")
    b.forward_gemm("gmm2", a, w2, y, save)
    b.stage("combine")
    for e in range(El):
        b.exchange(yc, y, e, combine=True)
    b.stage("weighted_sum")
    b.token_tiles("moe_unpermute_sum", [yc], [pos, w], out, "weighted_sum")
    b.chain_comm()
    return g


def build_backward(spec: MegaMoESpec, counts: Counts) -> TaskGraph:
    """Backward graph of rank ``counts.rank``. Inputs ``dout [T, H]``, ``tok``, ``pos``,
    ``ws [S, 1]`` (top-k weights in send layout), the saved activations (:func:`saved_names`) and
    the weights; outputs ``dx [T, H]``, ``dw [T, k]``, ``d_gate_up``, ``d_down``."""
    T, H, I, k, El = spec.tokens, spec.hidden, spec.intermediate, spec.top_k, spec.experts_local
    dt, R, S, mx = spec.dtype, counts.recv_rows, counts.send_rows, spec.mxfp8
    g = TaskGraph(f"megamoe.bwd.r{counts.rank}")
    dout, tok = g.input("dout", (T, H), dt), g.input("tok", (S,), "int64")
    pos, ws = g.input("pos", (T, k), "int64"), g.input("ws", (S, 1), dt)
    b = _Builder(g, spec, counts, "bwd")
    padded = b.padded_rows

    def saved_mx(name: str, cols: int) -> tuple[Buffer, Buffer]:
        return g.input(name, (padded, cols), FP8), g.input(f"{name}_scales", (padded // BLOCK, cols), E8M0)

    xr = saved_mx("xr_mx", H) if mx else g.input("xr", (R, H), dt)
    gu = g.input("gu", (R, 2 * I), dt)
    a = saved_mx("a_mx", I) if mx else g.input("a", (R, I), dt)
    yc = g.input("yc", (S, H), dt)
    w1, w2 = g.input("gate_up", (El, H, 2 * I), dt), g.input("down", (El, I, H), dt)
    dx, dw = g.output("dx", (T, H), dt), g.output("dw", (T, k), dt)
    dw1, dw2 = g.output("d_gate_up", (El, H, 2 * I), dt), g.output("d_down", (El, I, H), dt)
    dys, dyr = _layout_buffers(g, spec, counts, ("dys", "dyr"), (False, False))
    da, dgu = g.buffer("da", (R, I), dt), g.buffer("dgu", (R, 2 * I), dt)
    dxs, dxr = _layout_buffers(g, spec, counts, ("dxs", "dxr"), (False, False))

    b.stage("dispatch")
    if not b.sequential:  # off the expert path: fills vector gaps while dY travels
        _topk_grad(b, dout, yc, pos, dw)
    b.pack(dout, tok, dys, dyr, scale=ws)
    for e in range(El):
        b.exchange(dys, dyr, e, combine=False)
    b.stage("dgmm2")
    b.backward_gemms("2", dyr, w2, da, a, dw2)
    b.stage("swiglu_grad")
    b.swiglu_tiles("swiglu_grad", gu, dgu, da)
    b.stage("dgmm1")
    b.backward_gemms("1", dgu, w1, dxr, xr, dw1)
    b.stage("combine")
    for e in range(El):
        b.exchange(dxs, dxr, e, combine=True)
    b.stage("unpermute")
    b.token_tiles("moe_unpermute_sum", [dxs], [pos], dx, "unpermute")
    if b.sequential:
        _topk_grad(b, dout, yc, pos, dw)
    b.chain_comm()
    return g


def _topk_grad(b: _Builder, dout: Buffer, yc: Buffer, pos: Buffer, dw: Buffer) -> None:
    for lo, hi in tile_ranges(b.spec.tokens, b.spec.tile_m):
        b.task("moe_topk_grad", [dout[lo:hi], yc, pos[lo:hi]], [dw[lo:hi]], f"topk_grad.{lo}", stage="topk_grad")


class MoEGraphBuilder(GraphBuilder):
    """MegaMoE's graphs: the builders take the per-expert counts after the spec; from plain options
    they come from ``routing`` (see :func:`synthetic_counts`), ``seed`` and ``rank``."""

    extras = {"direction": "fwd", "routing": "balanced", "seed": 0, "rank": 0}

    def args(self, spec: MegaMoESpec, extras: dict[str, Any]) -> tuple:
        return (synthetic_counts(spec, extras["routing"], rank=int(extras["rank"]), seed=int(extras["seed"])),)

    def world(self, spec: str | None = None, **options: Any) -> list[TaskGraph]:
        """``megaloom simulate --graph megamoe:... --world``: every EP rank's graph (``rank = 0 .. ep - 1``,
        same options and routing), for :func:`megaloom.scheduler.world.simulate_world`."""
        with self.named():
            opts = load_options(spec, self.name, options)
            if "rank" in opts:
                raise ConfigError(f"option rank={opts['rank']!r} conflicts with a world simulation, "
                                  "which builds every rank")
            ep = parse_spec(MegaMoESpec, {k: v for k, v in opts.items() if k not in self.extras}, what=self.label,
                            also=self.extras).ep
            return [self.from_options({**opts, "rank": r}) for r in range(ep)]


MEGAMOE = MoEGraphBuilder("megamoe", "MegaMoE", MegaMoESpec, build_forward, build_backward)
