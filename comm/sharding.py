"""Uneven dim-0 sharding over W ranks, and the padded collectives that move such shards.

``N`` rows over ``W`` ranks: the first ``N mod W`` ranks get one extra row (7 rows on
4 ranks -> 2, 2, 2, 1). Collectives need equal pieces, so each shard travels
zero-padded to the largest shard size and is narrowed back after the transfer:

    all-gather      local (sizes[r] rows) -> pad -> [W * max] -> narrow each slot -> full (N rows)
    reduce-scatter  full grad (N rows) -> split by sizes -> pad each -> [W * max] -> reduce -> narrow
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloom.comm.communicator import Communicator, Handle
from megaloom.runtime.errors import CommError


def shard_sizes(n: int, world: int, name: str = "tensor") -> list[int]:
    """Rows per rank; raises CommError naming ``name`` when ``n < world``."""
    if world < 1:
        raise CommError(f"cannot shard {name!r} over {world} ranks")
    if n < world:
        raise CommError(f"cannot shard {name!r}: dim 0 has {n} rows, fewer than the {world} ranks")
    base, extra = divmod(n, world)
    return [base + (r < extra) for r in range(world)]


def shard_offsets(sizes: list[int]) -> list[int]:
    """First row of each shard."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where rank ``rank``'s shard of a ``shape`` tensor lies: rows ``offset : offset + size``."""

    shape: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int

    @staticmethod
    def of(shape: tuple[int, ...], world: int, rank: int, name: str = "tensor") -> ShardLayout:
        if not shape:
            raise CommError(f"cannot shard {name!r}: it is a scalar")
        return ShardLayout(tuple(shape), tuple(shard_sizes(shape[0], world, name)), rank)

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def padded(self) -> int:
        return max(self.sizes)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.size, *self.shape[1:])

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full tensor (a view)."""
        return full.narrow(0, self.offset, self.size)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def gather_uneven(comm: Communicator, local: torch.Tensor, sizes: list[int], out: torch.Tensor,
                  *, async_op: bool = False) -> Handle:
    """Fill ``out`` (``sum(sizes)`` rows) with every rank's shard; ``local`` has ``sizes[rank]`` rows."""
    pad = max(sizes)
    if local.shape[0] != sizes[comm.rank] or out.shape[0] != sum(sizes):
        raise CommError(f"rank {comm.rank}: uneven all_gather of shard {tuple(local.shape)} into "
                        f"{tuple(out.shape)} does not match shard sizes {sizes}")
    buf = local.new_empty((comm.world_size * pad, *local.shape[1:]))
    inner = comm.all_gather(buf, _pad_rows(local, pad), async_op=True)
    return _Then(inner, lambda: torch.cat([buf[r * pad: r * pad + s] for r, s in enumerate(sizes)], out=out),
                 async_op)


def reduce_scatter_uneven(comm: Communicator, full: torch.Tensor, sizes: list[int], out: torch.Tensor,
                          op: str = "sum", *, async_op: bool = False) -> Handle:
    """Reduce ``full`` (``sum(sizes)`` rows) over ranks; ``out`` gets this rank's ``sizes[rank]`` rows."""
    pad = max(sizes)
    if full.shape[0] != sum(sizes) or out.shape[0] != sizes[comm.rank]:
        raise CommError(f"rank {comm.rank}: uneven reduce_scatter of {tuple(full.shape)} into "
                        f"{tuple(out.shape)} does not match shard sizes {sizes}")
    send = full.new_zeros((comm.world_size * pad, *full.shape[1:]))
    for r, (o, s) in enumerate(zip(shard_offsets(sizes), sizes)):
        send[r * pad: r * pad + s] = full[o: o + s]
    recv = full.new_empty((pad, *full.shape[1:]))
    inner = comm.reduce_scatter(recv, send, op, async_op=True)
    return _Then(inner, lambda: out.copy_(recv[: out.shape[0]]), async_op)


class _Then(Handle):
    """Wrap a handle and run ``then`` once it completes (narrowing the padded buffer)."""

    def __init__(self, inner: Handle, then, async_op: bool):
        self.inner, self.then, self._done = inner, then, False
        if not async_op:
            self.wait()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            self.inner.wait(timeout)
            self.then()
            self._done = True

    def is_completed(self) -> bool:
        return self._done
