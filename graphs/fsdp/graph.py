"""FSDP as one task graph: an MLP whose weights are uneven shards, with prefetched gathers.

``build_fsdp_mlp_graph`` lays out, for one rank, the forward and backward of a stack of
bias-free Linear layers (``y = x @ W.T``, ReLU between layers, none after the last).
Layer ``l``'s weight ``[dims[l+1], dims[l]]`` is sharded along dim 0 (:class:`ShardLayout`):

    forward  layer l   shard_all_gather(w{l}) -> w{l}.full        (comm)
                       per token tile: matmul (cube) -> relu (vector)
    backward layer l   shard_all_gather(w{l}) -> w{l}.full_bwd    (comm, re-gathered)
                       per token tile: relu mask + where (vector), dx = dh @ W (cube)
                       dW = dh^T @ a over all tokens, in row tiles of dW (cube: ``matmul`` with ``trans_a``)
                       shard_reduce_scatter(dW) -> dw{l}          (comm)

Every gather writes its own buffer, so the region-derived dependencies never order two
gathers; control edges set how far they run ahead. The layers' forward then backward
form a sequence of stages; with ``prefetch=p`` the gather of stage ``s`` waits for the
compute of stage ``s - p - 1``: ``p=1`` lets the next layer's gather run under the
current layer's compute, ``p=0`` gathers only once the previous layer is done (the
serial baseline). All comm tasks are chained in the order they were added, so every
rank issues its collectives in the same order (:func:`megaloom.comm.ops.chain`).

Graph buffers: inputs ``x`` [tokens, dims[0]], ``w{l}`` (this rank's shard) and, with
``backward``, ``dy`` [tokens, dims[-1]]; outputs ``y`` and, with ``backward``, ``dx``
and ``dw{l}`` (this rank's shard of the weight gradient, reduced over ranks by
``reduce_op``: ``avg`` as FSDP averages data-parallel gradients, or ``sum``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaloom.comm.ops import chain
from megaloom.comm.sharding import ShardLayout
from megaloom.graphs.common.tags import tags
from megaloom.graphs.common.tiles import tile_ranges
from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import Buffer, Task, TaskGraph


# -- the graph -------------------------------------------------------------------------------
def weight_layouts(dims: Sequence[int], world_size: int, rank: int) -> list[ShardLayout]:
    """Layer ``l``'s weight ``[dims[l+1], dims[l]]`` sharded over ranks along dim 0."""
    return [ShardLayout.of((dims[i + 1], dims[i]), world_size, rank, f"w{i}") for i in range(len(dims) - 1)]


class _Builder:
    def __init__(self, g: TaskGraph, layouts: list[ShardLayout], backward: bool, prefetch: int, rank: int):
        self.g, self.layouts, self.rank, self.prefetch = g, layouts, rank, prefetch
        n = len(layouts)
        self.stages = [("fwd", i) for i in range(n)] + ([("bwd", i) for i in reversed(range(n))] if backward else [])
        self.ends: list[list[Task]] = []  # per finished stage: the compute tasks that end it
        self.comm: list[Task] = []
        self.full: dict[tuple[str, int], Buffer] = {}  # (direction, layer) -> gathered weight buffer
        self.gathered = 0  # stages whose gather is added

    def tags(self, stage: tuple[str, int], kind: str) -> dict:
        return tags(stage=kind, layer=stage[1], direction=stage[0], rank=self.rank)

    def comm_task(self, op: str, src, dst, attrs: dict, stage, kind: str, after=()) -> Task:
        t = self.g.task(op, [src], [dst], attrs=attrs, name=f"{kind}.{stage[0]}{stage[1]}",
                        tags=self.tags(stage, kind), after=after)
        self.comm.append(t)
        return t

    def gather_through(self, s: int) -> None:
        """Add the gathers of stages up to ``s + prefetch`` (each after stage ``j - prefetch - 1``)."""
        while self.gathered < len(self.stages) and self.gathered <= s + self.prefetch:
            j = self.gathered
            d, i = self.stages[j]
            lay = self.layouts[i]
            full = self.g.buffer(f"w{i}.full" + ("_bwd" if d == "bwd" else ""), lay.shape, self.g.buffers["x"].dtype)
            self.full[(d, i)] = full
            wait = self.ends[j - self.prefetch - 1] if j - self.prefetch - 1 >= 0 else ()
            self.comm_task("shard_all_gather", self.g.buffers[f"w{i}"], full,
                           {"sizes": list(lay.sizes), "rank": self.rank}, self.stages[j], "gather", wait)
            self.gathered += 1


def build_fsdp_mlp_graph(dims: Sequence[int], tokens: int, world_size: int, rank: int, *, tile: int | None = None,
                         backward: bool = True, prefetch: int = 1, reduce_op: str = "avg",
                         dtype: str = "float32", name: str | None = None) -> TaskGraph:
    """One rank's FSDP forward (and backward) of Linear layers ``dims[0] -> ... -> dims[-1]``.

    ``tile``: token rows per compute task, and weight-gradient rows per weight-gradient task
    (default: untiled). ``prefetch``: how many stages a weight gather may run ahead (0:
    none, the serial baseline). Layer ``l``'s weight has ``dims[l+1]`` rows, at least
    ``world_size`` (else CommError naming ``w{l}``). Run it with ``ExecContext(rank,
    world_size, comm)`` on every rank; inputs from :func:`fsdp_mlp_inputs`.
    """
    if len(dims) < 2 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise GraphError(f"fsdp mlp needs at least two positive layer widths, got {list(dims)}")
    if tokens < 1 or prefetch < 0 or (tile is not None and tile < 1):
        raise GraphError(f"fsdp mlp needs tokens >= 1, tile >= 1 and prefetch >= 0; "
                         f"got tokens={tokens}, tile={tile}, prefetch={prefetch}")
    layouts = weight_layouts(dims, world_size, rank)
    n = len(layouts)
    g = TaskGraph(name or f"fsdp-mlp-rank{rank}")
    x = g.input("x", (tokens, dims[0]), dtype)
    for i, lay in enumerate(layouts):
        g.input(f"w{i}", lay.local_shape, dtype)
    dy = g.input("dy", (tokens, dims[-1]), dtype) if backward else None
    y = g.output("y", (tokens, dims[-1]), dtype)
    acts = [x] + [g.buffer(f"a{i}", (tokens, dims[i + 1]), dtype) for i in range(n - 1)] + [y]
    pre = [g.buffer(f"h{i}", (tokens, dims[i + 1]), dtype) for i in range(n - 1)]
    rows = tile_ranges(tokens, tile or tokens)
    b = _Builder(g, layouts, backward, prefetch, rank)

    for s, (_, i) in enumerate(b.stages[:n]):  # forward
        b.gather_through(s)
        ends = []
        for lo, hi in rows:
            last = i == n - 1
            mm = g.task("matmul", [acts[i][lo:hi], b.full[("fwd", i)]], [(acts[i + 1] if last else pre[i])[lo:hi]],
                        attrs={"trans_b": True}, name=f"matmul.fwd{i}.{lo}", tags=b.tags(b.stages[s], "matmul"))
            ends.append(mm if last else g.task("dvm.relu", [pre[i][lo:hi]], [acts[i + 1][lo:hi]],
                                               name=f"relu.fwd{i}.{lo}", tags=b.tags(b.stages[s], "relu")))
        b.ends.append(ends)
    grads = [g.output("dx", (tokens, dims[0]), dtype)] + [g.buffer(f"da{i}", (tokens, dims[i + 1]), dtype)
                                                          for i in range(n - 1)] + [dy] if backward else []
    for s in range(n, len(b.stages)):  # backward (when built), last layer first
        stage = b.stages[s]
        i = stage[1]
        b.gather_through(s)
        if i < n - 1:  # through the ReLU: dh = da where a > 0
            dh = g.buffer(f"dh{i}", (tokens, dims[i + 1]), dtype)
            mask = g.buffer(f"mask{i}", (tokens, dims[i + 1]), "bool")
        else:
            dh = dy
        ends = []
        for lo, hi in rows:
            if i < n - 1:
                g.task("dvm.gt", [acts[i + 1][lo:hi]], [mask[lo:hi]], attrs={"scalar": 0.0},
                       name=f"mask.bwd{i}.{lo}", tags=b.tags(stage, "relu_grad"))
                g.task("dvm.where", [mask[lo:hi], grads[i + 1][lo:hi]], [dh[lo:hi]], attrs={"scalar": 0.0},
                       name=f"where.bwd{i}.{lo}", tags=b.tags(stage, "relu_grad"))
            ends.append(g.task("matmul", [dh[lo:hi], b.full[("bwd", i)]], [grads[i][lo:hi]],
                               name=f"matmul.bwd{i}.{lo}", tags=b.tags(stage, "dgrad")))
        dw_full = g.buffer(f"dw{i}.full", layouts[i].shape, dtype)
        for lo, hi in tile_ranges(dims[i + 1], tile or dims[i + 1]):  # rows of dW, all tokens each
            ends.append(g.task("matmul", [dh[:, lo:hi], acts[i]], [dw_full[lo:hi]], attrs={"trans_a": True},
                               name=f"wgrad.bwd{i}.{lo}", tags=b.tags(stage, "wgrad")))
        b.ends.append(ends)
        dw = g.output(f"dw{i}", layouts[i].local_shape, dtype)
        b.comm_task("shard_reduce_scatter", dw_full, dw,
                    {"sizes": list(layouts[i].sizes), "rank": rank, "op": reduce_op}, stage, "reduce_scatter")
    chain(*b.comm)
    return g


def fsdp_mlp_inputs(weights: Sequence[torch.Tensor], x: torch.Tensor, dy: torch.Tensor | None,
                    world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """The graph's inputs on ``rank``: its token batch and its shard of every full weight."""
    dims = [weights[0].shape[1]] + [w.shape[0] for w in weights]
    layouts = weight_layouts(dims, world_size, rank)
    out = {"x": x, **{f"w{i}": lay.shard(w).contiguous() for i, (w, lay) in enumerate(zip(weights, layouts))}}
    return out if dy is None else {**out, "dy": dy}


def fsdp_mlp_reference(weights: Sequence[torch.Tensor], x: torch.Tensor,
                       dy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Unsharded torch autograd: ``y`` and, given ``dy``, ``dx`` and full ``dw{l}`` (this batch only)."""
    ws = [w.detach().clone().requires_grad_(dy is not None) for w in weights]
    a = h = x.detach().clone().requires_grad_(dy is not None)
    for i, w in enumerate(ws):
        a = a @ w.t()
        if i < len(ws) - 1:
            a = torch.relu(a)
    if dy is None:
        return {"y": a.detach()}
    a.backward(dy)
    return {"y": a.detach(), "dx": h.grad, **{f"dw{i}": w.grad for i, w in enumerate(ws)}}
