"""The ``Communicator`` interface, its completion ``Handle``, and the world of one.

Every collective takes ``async_op``: ``False`` blocks until the data has moved and
returns a completed handle; ``True`` returns at once and ``handle.wait()`` blocks
(at most ``timeout`` seconds, then :class:`CommError`). Tensors move along dim 0:

| call             | input                         | output                               |
|------------------|-------------------------------|--------------------------------------|
| all_to_all       | ``sum(send_splits)`` rows      | ``sum(recv_splits)`` rows             |
| all_gather       | ``n`` rows                    | ``world * n`` rows (rank order)       |
| reduce_scatter   | ``world * n`` rows            | ``n`` rows (this rank's chunk)        |
| all_reduce       | any (in place)                | same tensor                          |
| send / recv      | whole tensor to / from a peer | ---                                  |

Before an all-to-all moves data, every rank's split sizes, dtype and row shape are
exchanged and checked (``check=True``), so a mismatch is a CommError naming the ranks
on every rank, never a hang or silent garbage.
"""
from __future__ import annotations

from typing import Any, Sequence

import msgpack
import torch

from megaloom.runtime.errors import CommError

REDUCE_OPS = ("sum", "avg", "max", "min")


class Handle:
    """Completion of one communication call. ``wait`` raises CommError on failure or timeout."""

    def wait(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


class Done(Handle):
    """A handle that is already complete."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class Communicator:
    """Collectives among ``world_size`` ranks; see the module docstring for shapes."""

    rank: int = 0
    world_size: int = 1
    timeout: float = 60.0
    check: bool = True  # exchange and compare dtypes / shapes / splits before data moves

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int], *, async_op: bool = False, check: bool = True) -> Handle:
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def send(self, tensor: torch.Tensor, peer: int, *, tag: int = 0, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def recv(self, tensor: torch.Tensor, peer: int, *, tag: int = 0, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def exchange(self, value: Any, what: str = "exchange") -> list[Any]:
        """Every rank's msgpack-encodable ``value``, in rank order (small metadata only).

        ``what`` names the calling operation in errors."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the communicator's resources (idempotent)."""

    # -- checks shared by the backends -------------------------------------------------
    def check_all_to_all(self, out: torch.Tensor, inp: torch.Tensor, send_splits: Sequence[int],
                         recv_splits: Sequence[int]) -> None:
        """Local checks, then a metadata exchange: every rank agrees on sizes and dtype."""
        w = self.world_size
        send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        if len(send) != w or len(recv) != w or min(send + recv, default=0) < 0:
            raise CommError(f"rank {self.rank}: all_to_all needs {w} non-negative send and recv splits, "
                            f"got send {send} recv {recv}")
        if inp.shape[0] != sum(send) or out.shape[0] != sum(recv):
            raise CommError(f"rank {self.rank}: all_to_all send region has {inp.shape[0]} rows for splits {send} "
                            f"(sum {sum(send)}), recv region {out.shape[0]} rows for splits {recv} (sum {sum(recv)})")
        if inp.dtype != out.dtype or inp.shape[1:] != out.shape[1:]:
            raise CommError(f"rank {self.rank}: all_to_all send is {inp.dtype} rows {tuple(inp.shape[1:])}, "
                            f"recv is {out.dtype} rows {tuple(out.shape[1:])}")
        metas = self.exchange([send, recv, str(inp.dtype), list(inp.shape[1:])], "all_to_all metadata")
        problems = []
        dt0, row0 = metas[0][2], metas[0][3]
        for r, (s_r, _, dt, row) in enumerate(metas):
            if dt != dt0 or list(row) != list(row0):
                problems.append(f"rank {r} sends {dt} rows {tuple(row)}, rank 0 sends {dt0} rows {tuple(row0)}")
            for p, (_, r_p, _, _) in enumerate(metas):
                if s_r[p] != r_p[r]:
                    problems.append(f"rank {r} sends {s_r[p]} rows to rank {p}, which expects {r_p[r]}")
        if problems:
            raise CommError("all_to_all split sizes or dtypes disagree across ranks: " + "; ".join(problems[:8]))


    def check_same(self, what: str, t: torch.Tensor) -> None:
        """Every rank passes a tensor of the same dtype and shape to ``what`` (one metadata exchange)."""
        metas = self.exchange([str(t.dtype), list(t.shape)], f"{what} metadata")
        bad = [f"rank {r} has {dt} {tuple(shape)}" for r, (dt, shape) in enumerate(metas) if [dt, shape] != metas[0]]
        if bad:
            raise CommError(f"{what}: ranks disagree on dtype or shape: rank 0 has {metas[0][0]} "
                            f"{tuple(metas[0][1])}, " + ", ".join(bad[:8]))


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise CommError(f"unknown reduce op {op!r}; expected one of {REDUCE_OPS}")
    return op


def check_rows(what: str, out: torch.Tensor, inp: torch.Tensor, out_rows: int) -> None:
    """``out`` must have ``out_rows`` rows and the same dtype and row shape as ``inp``."""
    if out.shape[0] != out_rows or out.shape[1:] != inp.shape[1:] or out.dtype != inp.dtype:
        raise CommError(f"{what}: output is {tuple(out.shape)} {out.dtype}, expected "
                        f"({out_rows}, {', '.join(map(str, inp.shape[1:]))}) {inp.dtype} for input {tuple(inp.shape)}")


def pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError) as e:
        raise CommError(f"exchange value is not msgpack-encodable: {e}") from None


class LocalCommunicator(Communicator):
    """The world of one rank: collectives are copies, and send/recv have no peer."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def all_to_all(self, out, inp, send_splits, recv_splits, *, async_op=False, check=True) -> Handle:
        if check:
            self.check_all_to_all(out, inp, send_splits, recv_splits)
        out.copy_(inp)
        return Done()

    def all_gather(self, out, inp, *, async_op=False) -> Handle:
        check_rows("all_gather", out, inp, inp.shape[0])
        out.copy_(inp)
        return Done()

    def reduce_scatter(self, out, inp, op="sum", *, async_op=False) -> Handle:
        check_reduce_op(op)
        check_rows("reduce_scatter", out, inp, inp.shape[0])
        out.copy_(inp)
        return Done()

    def all_reduce(self, tensor, op="sum", *, async_op=False) -> Handle:
        check_reduce_op(op)
        return Done()

    def send(self, tensor, peer, *, tag=0, async_op=False) -> Handle:
        raise CommError(f"send to rank {peer}: a world of size 1 has no peers")

    def recv(self, tensor, peer, *, tag=0, async_op=False) -> Handle:
        raise CommError(f"recv from rank {peer}: a world of size 1 has no peers")

    def barrier(self) -> None:
        return None

    def exchange(self, value: Any, what: str = "exchange") -> list[Any]:
        pack(value)
        return [value]
