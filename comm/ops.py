"""Comm ops: collectives as task-graph nodes on the ``comm`` engine (``context=True``).

Each kernel starts the collective on ``ctx.comm`` and waits on its handle, so a task
holds one comm unit until its data has moved while compute units keep running (gloo
and NCCL release the GIL). Rows move along dim 0. Every rank runs its own graph and
must issue its collectives in the same order as its peers: give comm tasks a fixed
order (a chain of control edges, see :func:`chain`) or a single comm unit per rank.

| op                   | inputs  | outputs | attrs                                         |
|----------------------|---------|---------|-----------------------------------------------|
| all_to_all           | send    | recv    | send_splits, recv_splits (rows per peer)      |
| all_gather           | shard   | full    | world_size                                    |
| reduce_scatter       | full    | shard   | world_size, op (sum / avg / max / min)        |
| all_reduce           | x       | y       | op                                            |
| send                 | x       | -       | peer, tag                                     |
| recv                 | -       | x       | peer, tag, shape, dtype                       |
| shard_all_gather     | shard   | full    | sizes (rows per rank), rank                   |
| shard_reduce_scatter | full    | shard   | sizes, rank, op                               |

Cost is ``Cost(comm_bytes=...)``: bytes this rank puts on the wire (ring algorithms for
gather/scatter/reduce). The simulator prices it with the profile's link model.
"""
from __future__ import annotations

from typing import Any

import torch

from megaloom.comm.communicator import Communicator, LocalCommunicator, check_reduce_op
from megaloom.comm.sharding import gather_uneven, reduce_scatter_uneven
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import CommError, GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

_LOCAL = LocalCommunicator()


def communicator(ctx: Any) -> Communicator:
    """The run's communicator; a world of one when the context has none."""
    if ctx is not None and ctx.comm is not None:
        return ctx.comm
    if ctx is not None and ctx.world_size != 1:
        raise CommError(f"rank {ctx.rank}: a comm task needs ExecContext.comm in a world of {ctx.world_size}")
    return _LOCAL


def chain(*tasks) -> None:
    """Order comm tasks one after the other so every rank issues them in the same order."""
    for a, b in zip(tasks, tasks[1:]):
        a.precede(b)


def _rows(spec: TensorSpec, rows: int) -> TensorSpec:
    return TensorSpec((rows, *spec.shape[1:]), spec.dtype)


def _one(ins: list[TensorSpec], op: str) -> TensorSpec:
    if len(ins) != 1 or not ins[0].shape:
        raise GraphError(f"{op} takes one tensor of at least 1 dim, got {[s.shape for s in ins]}")
    return ins[0]


def _world(attrs: dict, op: str) -> int:
    w = attrs.get("world_size")
    if not isinstance(w, int) or w < 1:
        raise GraphError(f"{op} needs attr world_size (a positive int), got {w!r}")
    return w


def _ring(nbytes: int, w: int) -> float:
    return nbytes * (w - 1) / w


# -- all_to_all -------------------------------------------------------------------------
def _a2a_shape(ins, attrs):
    x = _one(ins, "all_to_all")
    send, recv = attrs.get("send_splits"), attrs.get("recv_splits")
    if not isinstance(send, list) or not isinstance(recv, list) or len(send) != len(recv):
        raise GraphError(f"all_to_all needs attrs send_splits and recv_splits, lists of one int per rank; "
                         f"got {send!r} and {recv!r}")
    if sum(send) != x.shape[0]:
        raise GraphError(f"all_to_all send_splits {send} sum to {sum(send)}, send region has {x.shape[0]} rows")
    return [_rows(x, sum(recv))]


def _a2a_ref(x, *, send_splits, recv_splits, ctx=None):
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    communicator(ctx).all_to_all(out, x, send_splits, recv_splits)
    return out


def _a2a_kernel(ins, outs, *, send_splits, recv_splits, ctx=None):
    communicator(ctx).all_to_all(outs[0], ins[0], send_splits, recv_splits)


# -- all_gather / reduce_scatter / all_reduce --------------------------------------------
def _ag_shape(ins, attrs):
    x = _one(ins, "all_gather")
    return [_rows(x, x.shape[0] * _world(attrs, "all_gather"))]


def _ag_ref(x, *, world_size, ctx=None):
    out = x.new_empty((x.shape[0] * world_size, *x.shape[1:]))
    communicator(ctx).all_gather(out, x)
    return out


def _ag_kernel(ins, outs, *, world_size, ctx=None):
    communicator(ctx).all_gather(outs[0], ins[0])


def _rs_shape(ins, attrs):
    x, w = _one(ins, "reduce_scatter"), _world(attrs, "reduce_scatter")
    check_reduce_op(attrs.get("op", "sum"))
    if x.shape[0] % w:
        raise GraphError(f"reduce_scatter: {x.shape[0]} rows do not split over world_size {w}")
    return [_rows(x, x.shape[0] // w)]


def _rs_ref(x, *, world_size, op="sum", ctx=None):
    out = x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
    communicator(ctx).reduce_scatter(out, x, op)
    return out


def _rs_kernel(ins, outs, *, world_size, op="sum", ctx=None):
    communicator(ctx).reduce_scatter(outs[0], ins[0], op)


def _ar_shape(ins, attrs):
    check_reduce_op(attrs.get("op", "sum"))
    return [_one(ins, "all_reduce")]


def _ar_ref(x, *, op="sum", world_size=None, ctx=None):
    y = x.clone()
    communicator(ctx).all_reduce(y, op)
    return y


def _ar_kernel(ins, outs, *, op="sum", world_size=None, ctx=None):
    outs[0].copy_(ins[0])
    communicator(ctx).all_reduce(outs[0], op)


# -- send / recv ---------------------------------------------------------------------------
def _send_shape(ins, attrs):
    _one(ins, "send")
    if not isinstance(attrs.get("peer"), int):
        raise GraphError(f"send needs attr peer (an int), got {attrs.get('peer')!r}")
    return []


def _send_ref(x, *, peer, tag=0, ctx=None):
    communicator(ctx).send(x, peer, tag=tag)
    return ()


def _send_kernel(ins, outs, *, peer, tag=0, ctx=None):
    communicator(ctx).send(ins[0], peer, tag=tag)


def _recv_shape(ins, attrs):
    if ins or not isinstance(attrs.get("peer"), int) or not isinstance(attrs.get("shape"), list):
        raise GraphError(f"recv takes no inputs and attrs peer, shape, dtype; got {len(ins)} inputs, attrs {attrs}")
    return [TensorSpec(tuple(attrs["shape"]), dtype_name(attrs.get("dtype", "float32")))]


def _recv_ref(*, peer, shape, dtype="float32", tag=0, ctx=None):
    out = torch.empty(tuple(shape), dtype=torch_dtype(dtype))
    communicator(ctx).recv(out, peer, tag=tag)
    return out


def _recv_kernel(ins, outs, *, peer, shape, dtype="float32", tag=0, ctx=None):
    communicator(ctx).recv(outs[0], peer, tag=tag)


# -- uneven shards ----------------------------------------------------------------------
def _sizes(attrs, op) -> tuple[list[int], int]:
    sizes, rank = attrs.get("sizes"), attrs.get("rank")
    if not isinstance(sizes, list) or not sizes or not isinstance(rank, int) or not 0 <= rank < len(sizes):
        raise GraphError(f"{op} needs attrs sizes (rows per rank) and rank, got sizes={sizes!r} rank={rank!r}")
    return sizes, rank


def _sag_shape(ins, attrs):
    x = _one(ins, "shard_all_gather")
    sizes, rank = _sizes(attrs, "shard_all_gather")
    if x.shape[0] != sizes[rank]:
        raise GraphError(f"shard_all_gather: shard has {x.shape[0]} rows, sizes[{rank}] is {sizes[rank]}")
    return [_rows(x, sum(sizes))]


def _check_rank(ctx, rank: int, op: str) -> Communicator:
    comm = communicator(ctx)
    if comm.rank != rank:
        raise CommError(f"{op} was built for rank {rank} but runs on rank {comm.rank}")
    return comm


def _sag_kernel(ins, outs, *, sizes, rank, ctx=None):
    gather_uneven(_check_rank(ctx, rank, "shard_all_gather"), ins[0], sizes, outs[0])


def _sag_ref(x, *, sizes, rank, ctx=None):
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    _sag_kernel([x], [out], sizes=sizes, rank=rank, ctx=ctx)
    return out


def _srs_shape(ins, attrs):
    x = _one(ins, "shard_reduce_scatter")
    sizes, rank = _sizes(attrs, "shard_reduce_scatter")
    check_reduce_op(attrs.get("op", "sum"))
    if x.shape[0] != sum(sizes):
        raise GraphError(f"shard_reduce_scatter: input has {x.shape[0]} rows, sizes {sizes} sum to {sum(sizes)}")
    return [_rows(x, sizes[rank])]


def _srs_kernel(ins, outs, *, sizes, rank, op="sum", ctx=None):
    reduce_scatter_uneven(_check_rank(ctx, rank, "shard_reduce_scatter"), ins[0], sizes, outs[0], op)


def _srs_ref(x, *, sizes, rank, op="sum", ctx=None):
    out = x.new_empty((sizes[rank], *x.shape[1:]))
    _srs_kernel([x], [out], sizes=sizes, rank=rank, op=op, ctx=ctx)
    return out


# -- costs ------------------------------------------------------------------------------
def _cost_in(ins, outs, attrs) -> Cost:
    return Cost(comm_bytes=float(ins[0].nbytes))


def _cost_out(ins, outs, attrs) -> Cost:
    return Cost(comm_bytes=float(outs[0].nbytes))


def _cost_ring(full: TensorSpec, attrs) -> Cost:
    """Ring gather/scatter of the full tensor ``full`` (uneven shards travel padded to the largest)."""
    w = len(attrs["sizes"]) if "sizes" in attrs else attrs["world_size"]
    rows = max(attrs["sizes"]) * w if "sizes" in attrs else full.shape[0]
    return Cost(comm_bytes=_ring(_rows(full, rows).nbytes, w))


def _cost_gather(ins, outs, attrs) -> Cost:
    return _cost_ring(outs[0], attrs)


def _cost_scatter(ins, outs, attrs) -> Cost:
    return _cost_ring(ins[0], attrs)


def _cost_all_reduce(ins, outs, attrs) -> Cost:
    w = attrs.get("world_size", 2)
    return Cost(comm_bytes=2 * _ring(ins[0].nbytes, w))


for _op in (
    OpDef("all_to_all", ("comm",), _a2a_ref, _a2a_shape, _cost_in, _a2a_kernel, context=True,
          doc="rows to every peer by send_splits, from every peer by recv_splits; sizes checked across ranks first"),
    OpDef("all_gather", ("comm",), _ag_ref, _ag_shape, _cost_gather, _ag_kernel, context=True,
          doc="every rank's rows, concatenated in rank order"),
    OpDef("reduce_scatter", ("comm",), _rs_ref, _rs_shape, _cost_scatter, _rs_kernel, context=True,
          doc="reduce over ranks, keep this rank's chunk of rows"),
    OpDef("all_reduce", ("comm",), _ar_ref, _ar_shape, _cost_all_reduce, _ar_kernel, context=True,
          doc="reduce over ranks; every rank gets the result"),
    OpDef("send", ("comm",), _send_ref, _send_shape, _cost_in, _send_kernel, context=True,
          doc="send a region to rank peer"),
    OpDef("recv", ("comm",), _recv_ref, _recv_shape, _cost_out, _recv_kernel, context=True,
          doc="receive a region from rank peer"),
    OpDef("shard_all_gather", ("comm",), _sag_ref, _sag_shape, _cost_gather, _sag_kernel, context=True,
          doc="uneven shards (sizes per rank) padded, gathered and narrowed into the full tensor"),
    OpDef("shard_reduce_scatter", ("comm",), _srs_ref, _srs_shape, _cost_scatter, _srs_kernel, context=True,
          doc="full tensor split by sizes, padded, reduce-scattered and narrowed to this rank's shard"),
):
    register(_op)
