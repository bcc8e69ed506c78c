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
from megaloom.graphs.moe.counts import CountsBuilder
from megaloom.graphs.moe.dynamic import DynamicBuilder
from megaloom.graphs.moe.spec import Counts, MegaMoESpec, synthetic_counts
from megaloom.graphs.moe.tasks import TaskBuilder, mx_buffers
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import Buffer, TaskGraph

FWD_STAGES = ("dispatch", "gmm1", "swiglu", "gmm2", "combine", "weighted_sum")
BWD_STAGES = ("dispatch", "dgmm2", "swiglu_grad", "dgmm1", "combine", "unpermute", "topk_grad")


def saved_names(spec: MegaMoESpec) -> tuple[str, ...]:
    """The forward's outputs that its backward reads, in order."""
    if spec.mxfp8:
        return ("xr_mx", "xr_mx_scales", "gu", "a_mx", "a_mx_scales", "yc")
    return ("xr", "gu", "a", "yc")


def _layout_buffers(g: TaskGraph, spec: MegaMoESpec, rows: tuple[int, int], names: tuple[str, str],
                    keep: tuple[bool, bool]):
    """The send-layout and recv-layout buffers of one row stream, of ``rows`` (one buffer when W == 1)."""
    def make(name: str, n: int, out: bool) -> Buffer:
        return (g.output if out else g.buffer)(name, (n, spec.hidden), spec.dtype)
    if spec.ep == 1:  # the layouts coincide
        one = make(names[0] if keep[0] else names[1], rows[1], any(keep))
        return one, one
    return make(names[0], rows[0], keep[0]), make(names[1], rows[1], keep[1])


def _start(spec: MegaMoESpec, counts: Counts, direction: str, dynamic: bool):
    """One direction's graph, its task builder class and rows (recv layout, send layout, ``tok`` / ``ws``)."""
    if spec.grouped and not dynamic:
        raise ConfigError("MegaMoE grouped graphs are dynamic: build them with dynamic=True")
    builder = DynamicBuilder if dynamic else CountsBuilder
    return TaskGraph(f"megamoe.{direction}.r{counts.rank}"), builder, builder.rows(spec, counts)


def build_forward(spec: MegaMoESpec, counts: Counts, *, save: bool = True, dynamic: bool = False) -> TaskGraph:
    """Forward graph of rank ``counts.rank``. Inputs ``x [T, H]``, ``tok [S]``, ``pos [T, k]``,
    ``w [T, k]``, ``gate_up [E_l, H, 2I]``, ``down [E_l, I, H]``; output ``out [T, H]`` and,
    with ``save``, the activations the backward graph needs (:func:`saved_names`).

    ``dynamic``: the graph of every routing (:mod:`.layout`): buffers of static capacity, plan inputs
    ``meta`` (and ``comm`` under EP) read at run time; ``counts`` then only set simulated sizes and tags.
    At W == 1 ``tok`` and ``pos`` index the pooled layout (:func:`.layout.pooled_routing`)."""
    T, H, I, k, El = spec.tokens, spec.hidden, spec.intermediate, spec.top_k, spec.experts_local
    dt, mx = spec.dtype, spec.mxfp8
    g, builder, (R, S, St) = _start(spec, counts, "fwd", dynamic)
    x, tok = g.input("x", (T, H), dt), g.input("tok", (St,), "int64")
    pos, w = g.input("pos", (T, k), "int64"), g.input("w", (T, k), dt)
    w1, w2 = g.input("gate_up", (El, H, 2 * I), dt), g.input("down", (El, I, H), dt)
    keep = g.output if save else g.buffer
    xs, xr = _layout_buffers(g, spec, (S, R), ("xs", "xr"), (False, save and not mx))
    gu, a = keep("gu", (R, 2 * I), dt), (keep if not mx else g.buffer)("a", (R, I), dt)
    yc, y = _layout_buffers(g, spec, (S, R), ("yc", "y"), (save, False))
    out = g.output("out", (T, H), dt)

    b = builder(g, spec, counts, "fwd")
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


def build_backward(spec: MegaMoESpec, counts: Counts, *, dynamic: bool = False) -> TaskGraph:
    """Backward graph of rank ``counts.rank``. Inputs ``dout [T, H]``, ``tok``, ``pos``,
    ``ws [S, 1]`` (top-k weights in send layout), the saved activations (:func:`saved_names`) and
    the weights; outputs ``dx [T, H]``, ``dw [T, k]``, ``d_gate_up``, ``d_down``. ``dynamic``: as
    for :func:`build_forward` (``ws`` in the layout of ``tok``)."""
    T, H, I, k, El = spec.tokens, spec.hidden, spec.intermediate, spec.top_k, spec.experts_local
    dt, mx = spec.dtype, spec.mxfp8
    g, builder, (R, S, St) = _start(spec, counts, "bwd", dynamic)
    dout, tok = g.input("dout", (T, H), dt), g.input("tok", (St,), "int64")
    pos, ws = g.input("pos", (T, k), "int64"), g.input("ws", (St, 1), dt)
    b = builder(g, spec, counts, "bwd")
    xr = mx_buffers(g, "xr_mx", (b.padded_rows, H), "cols", g.input) if mx else g.input("xr", (R, H), dt)
    gu = g.input("gu", (R, 2 * I), dt)
    a = mx_buffers(g, "a_mx", (b.padded_rows, I), "cols", g.input) if mx else g.input("a", (R, I), dt)
    yc = g.input("yc", (S if spec.ep > 1 else R, H), dt)
    w1, w2 = g.input("gate_up", (El, H, 2 * I), dt), g.input("down", (El, I, H), dt)
    dx, dw = g.output("dx", (T, H), dt), g.output("dw", (T, k), dt)
    dw1, dw2 = g.output("d_gate_up", (El, H, 2 * I), dt), g.output("d_down", (El, I, H), dt)
    dys, dyr = _layout_buffers(g, spec, (S, R), ("dys", "dyr"), (False, False))
    da, dgu = g.buffer("da", (R, I), dt), g.buffer("dgu", (R, 2 * I), dt)
    dxs, dxr = _layout_buffers(g, spec, (S, R), ("dxs", "dxr"), (False, False))

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


def _topk_grad(b: TaskBuilder, dout: Buffer, yc: Buffer, pos: Buffer, dw: Buffer) -> None:
    for lo, hi in b.token_tiles_of():
        b.task("moe_topk_grad", [dout[lo:hi], yc, pos[lo:hi]], [dw[lo:hi]], f"topk_grad.{lo}", stage="topk_grad")


class MoEGraphBuilder(GraphBuilder):
    """MegaMoE's graphs: the builders take the per-expert counts after the spec; from plain options
    they come from ``routing`` (see :func:`synthetic_counts`), ``seed`` and ``rank``; ``dynamic=true``
    builds the graph of every routing (static capacity, sizes read from the plan at run time), the
    counts then setting its simulated tile sizes."""

    extras = {"direction": "fwd", "routing": "balanced", "seed": 0, "rank": 0, "dynamic": False}

    def args(self, spec: MegaMoESpec, extras: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        dyn = extras["dynamic"]
        if not isinstance(dyn, bool):
            raise ConfigError(f"option dynamic must be true or false, got {dyn!r}")
        counts = synthetic_counts(spec, extras["routing"], rank=int(extras["rank"]), seed=int(extras["seed"]))
        return (counts,), {"dynamic": True} if dyn else {}

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
