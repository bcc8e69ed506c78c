"""``TorchCommunicator``: the Communicator interface over ``torch.distributed``.

Gloo on CPU, NCCL on CUDA. The process group comes from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), from an explicit
``init_method``, or is passed in. Every wait is bounded by ``timeout`` seconds (also
given to the process group), and every backend failure, including a peer that died or
never arrived, surfaces as :class:`CommError` naming the call and the rank. A group made
here is destroyed at exit, so a process that caught a timeout exits with its own code
rather than aborting in gloo's teardown.
"""
from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from megaloom.comm.communicator import Communicator, Handle, check_reduce_op, check_rows, pack
from megaloom.runtime.errors import CommError

# torch >= 2.10 names the tensor-in/tensor-out collectives *_single; older releases *_into_tensor / *_tensor
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchHandle(Handle):
    """A torch.distributed work object; ``then`` runs once after it completes."""

    def __init__(self, work: Any, what: str, rank: int, timeout: float, then=None):
        self.work, self.what, self.rank, self.timeout, self.then = work, what, rank, timeout, then
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        t = self.timeout if timeout is None else timeout
        try:
            ok = self.work.wait(timeout=timedelta(seconds=t))
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses on timeout and dead peers
            raise CommError(f"rank {self.rank}: {self.what} failed: {_first_line(e)}") from e
        if ok is False:
            raise CommError(f"rank {self.rank}: {self.what} did not complete within {t:g} s")
        self._done = True
        if self.then is not None:
            self.then()

    def is_completed(self) -> bool:
        return self._done or bool(self.work.is_completed())


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


class TorchCommunicator(Communicator):
    """Collectives through a torch.distributed process group.

    With ``group=None`` the default group is used, initialised here when needed
    (``backend`` defaults to NCCL when CUDA is available, else gloo). ``timeout`` bounds
    initialisation (a rank that never arrives) and every wait (a rank that died).
    ``check`` (default True): exchange split sizes before every all_to_all (a call may
    also pass ``check=False``) and dtype and shape before every all_gather,
    reduce_scatter and all_reduce, so a mismatch is a CommError on every rank before
    data moves; costs two tiny collectives per call. A checked send is preceded by its
    element count and dtype, so a recv of another size or dtype is a CommError, never
    stale values (a send larger than the recv makes gloo abort the receiving process,
    which its peers see as a CommError; the receiver cannot refuse it in time). With NCCL each rank uses GPU
    ``LOCAL_RANK`` (torchrun's variable; else rank modulo the GPU count).
    """

    def __init__(self, group: Any = None, *, backend: str | None = None, init_method: str | None = None,
                 rank: int | None = None, world_size: int | None = None, timeout: float = 60.0,
                 device: torch.device | None = None, check: bool = True):
        self.timeout, self.check = float(timeout), check
        self._owns_group = False
        if group is None and not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
            try:
                dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                        world_size=world_size, timeout=timedelta(seconds=self.timeout))
            except Exception as e:
                raise CommError(f"rank {rank}: cannot join a world of {world_size} ranks "
                                f"({backend}, timeout {self.timeout:g} s): {_first_line(e)}") from e
            self._owns_group = True
            atexit.register(self.close)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                                 else torch.device("cpu"))

    def _run(self, what: str, fn, async_op: bool, then=None) -> Handle:
        try:
            work = fn()
        except Exception as e:
            raise CommError(f"rank {self.rank}: {what} failed: {_first_line(e)}") from e
        h = TorchHandle(work, what, self.rank, self.timeout, then)
        if not async_op:
            h.wait()
        return h

    def all_to_all(self, out, inp, send_splits, recv_splits, *, async_op=False, check=True) -> Handle:
        if check and self.check:
            self.check_all_to_all(out, inp, send_splits, recv_splits)
        dst, then = _contiguous_target(out)
        return self._run("all_to_all", lambda: dist.all_to_all_single(
            dst, inp.contiguous(), [int(s) for s in recv_splits], [int(s) for s in send_splits],
            group=self.group, async_op=True), async_op, then)

    def all_gather(self, out, inp, *, async_op=False) -> Handle:
        check_rows("all_gather", out, inp, self.world_size * inp.shape[0])
        if self.check:
            self.check_same("all_gather", inp)
        dst, then = _contiguous_target(out)
        return self._run("all_gather", lambda: _GATHER(
            dst, inp.contiguous(), group=self.group, async_op=True), async_op, then)

    def reduce_scatter(self, out, inp, op="sum", *, async_op=False) -> Handle:
        check_reduce_op(op)
        if inp.shape[0] % self.world_size:
            raise CommError(f"reduce_scatter: {inp.shape[0]} input rows do not split over {self.world_size} ranks")
        check_rows("reduce_scatter", out, inp, inp.shape[0] // self.world_size)
        if self.check:
            self.check_same("reduce_scatter", inp)
        dst, then = _contiguous_target(out)
        return self._run("reduce_scatter", lambda: _SCATTER(
            dst, inp.contiguous(), op=_OPS[op], group=self.group, async_op=True), async_op, then)

    def all_reduce(self, tensor, op="sum", *, async_op=False) -> Handle:
        check_reduce_op(op)
        if self.check:
            self.check_same("all_reduce", tensor)
        dst, then = _contiguous_target(tensor, copy_in=True)
        return self._run("all_reduce", lambda: dist.all_reduce(
            dst, op=_OPS[op], group=self.group, async_op=True), async_op, then)

    def send(self, tensor, peer, *, tag=0, async_op=False) -> Handle:
        self._check_peer(peer)
        what = f"send to rank {peer}"
        head = self._run(what, lambda: dist.isend(_header(tensor), self._global(peer), group=self.group, tag=tag),
                         True) if self.check else None
        return self._run(what, lambda: dist.isend(tensor.contiguous(), self._global(peer), group=self.group, tag=tag),
                         async_op, head.wait if head is not None else None)

    def recv(self, tensor, peer, *, tag=0, async_op=False) -> Handle:
        """With ``check``, the sender's size and dtype travel ahead of the data (one tiny
        message), so a smaller or different send is a CommError, never stale values."""
        self._check_peer(peer)
        what = f"recv from rank {peer}"
        dst, then = _contiguous_target(tensor)
        if self.check:
            got = torch.empty(2, dtype=torch.int64, device=self.device)
            head = self._run(what, lambda: dist.irecv(got, self._global(peer), group=self.group, tag=tag), True)
            copy_back = then

            def then() -> None:
                head.wait()
                want = _header(tensor).tolist()
                n, code = got.tolist()
                if [n, code] != want:
                    sent = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype code {code}"
                    raise CommError(f"rank {self.rank}: {what}: it sent {n} elements of {sent}, "
                                    f"the receiving tensor holds {want[0]} of {tensor.dtype}")
                if copy_back is not None:
                    copy_back()
        return self._run(what, lambda: dist.irecv(dst, self._global(peer), group=self.group, tag=tag), async_op, then)

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self.group, async_op=True), False)

    def exchange(self, value: Any, what: str = "exchange") -> list[Any]:
        data = torch.frombuffer(bytearray(pack(value)), dtype=torch.uint8)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        self._run(what, lambda: _GATHER(sizes, mine, group=self.group, async_op=True), False)
        n = int(sizes.max())
        buf = torch.zeros(n, dtype=torch.uint8, device=self.device)
        buf[: data.numel()] = data.to(self.device)
        everyone = torch.empty(self.world_size * n, dtype=torch.uint8, device=self.device)
        self._run(what, lambda: _GATHER(everyone, buf, group=self.group, async_op=True), False)
        raw = everyone.cpu().numpy().tobytes()
        return [msgpack.unpackb(raw[r * n: r * n + int(sizes[r])], raw=False) for r in range(self.world_size)]

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CommError(f"rank {self.rank}: bad peer {peer} in a world of {self.world_size}")

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)


_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _header(t: torch.Tensor) -> torch.Tensor:
    """What a checked send announces: its element count and dtype (an index into ``_DTYPES``)."""
    return torch.tensor([t.numel(), _DTYPES.index(t.dtype)], dtype=torch.int64, device=t.device)


def _contiguous_target(t: torch.Tensor, copy_in: bool = False):
    """A contiguous tensor to receive into, and a callback copying it back when ``t`` is a strided view."""
    if t.is_contiguous():
        return t, None
    tmp = t.contiguous() if copy_in else torch.empty_like(t, memory_format=torch.contiguous_format)
    return tmp, lambda: t.copy_(tmp)
