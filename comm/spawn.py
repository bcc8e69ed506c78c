"""Run a function on N local ranks, each with its own ``TorchCommunicator``.

Used by tests, benchmarks and quick experiments (``megaloom launch`` starts scripts
instead). Children start from a forkserver that has imported torch once, so a world
starts in about a second. Each rank's return value travels back msgpack-encoded
(never pickled); a rank that raises, dies or outlives ``timeout`` is reported by rank.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing.connection import wait as mp_wait
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import msgpack

from megaloom.runtime.errors import CommError

_CTX = None


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child die by SIGKILL when ``parent`` does, even when the
    parent is killed by SIGKILL (Linux's parent-death signal; elsewhere None)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def _context(module: str, preload: Sequence[str]):
    """The forkserver context; its server preloads torch, ``preload`` and the first caller's module."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", *preload, "megaloom.comm", module])
    return _CTX


def _child(fn, rank: int, world: int, port: int, comm_timeout: float, backend: str, conn, args) -> None:
    import torch

    from megaloom.comm.torch_comm import TorchCommunicator

    torch.set_num_threads(1)
    comm = None
    try:
        comm = TorchCommunicator(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=world, timeout=comm_timeout)
        result = {"ok": True, "value": fn(comm, *args)}
    except BaseException as e:  # reported to the parent by rank
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    conn.send_bytes(msgpack.packb(result, use_bin_type=True))
    conn.close()
    if comm is not None:
        comm.close()  # may wait on dead peers; the parent stops waiting once it has every result


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              comm_timeout: float = 10.0, backend: str = "gloo", allow_fail: bool = False,
              preload: Sequence[str] = ("torch._dynamo",)) -> list[Any]:
    """``fn(comm, *args)`` on ``world_size`` ranks; returns each rank's result, in rank order.

    ``fn`` must be importable (a module-level function) and return msgpack-encodable data.
    A rank that raises makes this raise CommError with its traceback, unless
    ``allow_fail``, where the list holds ``{"error": ...}`` (or ``None`` for a rank that
    exited without a result) in its place. ``preload``: modules the forkserver imports once
    for every rank, as set by the process's first call (``torch._dynamo``, which the first
    optimizer step imports, seconds per rank otherwise; ``()`` starts the server sooner).
    """
    ctx = _context(fn.__module__, preload)
    port = free_port()
    procs, pipes = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, world_size, port, comm_timeout, backend, send, args),
                        name=f"megaloom-rank{rank}", daemon=True)
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * world_size
    answered = [False] * world_size
    while not all(answered) and time.monotonic() < deadline:
        waiting = [r for r, a in enumerate(answered) if not a]
        mp_wait([pipes[r] for r in waiting] + [procs[r].sentinel for r in waiting], timeout=0.5)
        for r in waiting:
            if pipes[r].poll(0):
                answered[r] = True
                try:
                    results[r] = msgpack.unpackb(pipes[r].recv_bytes(), raw=False)
                except EOFError:  # the rank exited without a result
                    results[r] = None
            elif not procs[r].is_alive():
                answered[r] = True  # died without a word
    for p in procs:
        p.join(max(0.0, min(2.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(5)
    stuck = [r for r, a in enumerate(answered) if not a]
    if stuck:
        raise CommError(f"ranks {stuck} of {world_size} did not finish within {timeout:g} s")
    out = []
    for rank, res in enumerate(results):
        if res is None or not res.get("ok"):
            if not allow_fail:
                why = "exited without a result" if res is None else res["traceback"]
                raise CommError(f"rank {rank} of {world_size} failed: {why}")
            out.append(None if res is None else {"error": res["error"]})
        else:
            out.append(res["value"])
    return out
