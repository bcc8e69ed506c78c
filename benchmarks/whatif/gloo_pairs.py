"""Pairs on two gloo ranks (two processes, one thread each): all-reduces of another size, a
second data-parallel rank on the same machine, and a MoE step's experts spread over both ranks.
B is predicted from A's profiler traces alone, with the link's alpha-beta model measured once on
these ranks and the cores the two ranks' processes share (matmuls on one rank alone against both
at once).

The two ranks live in a pool of worker processes that stay up for the whole suite: each
command (time a workload, record it, measure the link) runs on both at once.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.whatif import moe_ep
from benchmarks.whatif.pair import Pair
from benchmarks.whatif.record import STEPS, TRACE_DIR, predicted_ratio, profile_steps, timed
from megaloom.scheduler.importers.kineto.work import WIRE
from megaloom.scheduler.profile import Contention, load_profile
from megaloom.scheduler.replay import WhatIf

BUCKET = 1 << 21
"""Floats all-reduced per step by the comm pair's side A (8 MiB)."""
WIDTH, TOKENS = 512, 64


def mlp(width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width), nn.ReLU(),
                         nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))


def _training(model: nn.Module, extra: Callable[[], None] | None = None) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(TOKENS, model[0].in_features if isinstance(model, nn.Sequential) else WIDTH)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if extra:
            extra()
        opt.step()
    return step


def workload(name: str) -> Callable[[], None]:
    """``bucket:N`` (a quarter-width MLP step, then an all-reduce of N floats: comm about half the
    step), ``ddp`` (the MLP in DDP), ``moe:N`` (a MoE step at expert-parallel degree N), ``mlp``."""
    if name.startswith("moe:"):
        return moe_ep.step(int(name.split(":")[1]))
    if name.startswith("bucket:"):
        buf = torch.zeros(int(name.split(":")[1]))
        return _training(mlp(WIDTH // 4), lambda: dist.all_reduce(buf))
    if name == "ddp":
        return _training(nn.parallel.DistributedDataParallel(mlp()))
    return _training(mlp())


def _matmuls(a: torch.Tensor, run: bool, calls: int = 200) -> float:
    """Seconds for ``calls`` matmuls of ``a`` by itself (none unless ``run``), between two
    barriers: the other rank runs them too or waits."""
    dist.barrier()
    t = time.perf_counter()
    for _ in range(calls if run else 0):
        a @ a
    t = time.perf_counter() - t
    dist.barrier()
    return t


def _worker(rank: int, port: int, conn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    steps: dict[str, Callable[[], None]] = {}
    try:
        while True:
            cmd, name, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd not in ("link", "cores") and name not in steps:
                steps[name] = workload(name)
            step = steps.get(name)
            dist.barrier()
            if cmd == "time":
                t = time.perf_counter()
                timed(step, arg)
                dist.barrier()
                conn.send(time.perf_counter() - t)
            elif cmd == "record":  # three recordings, each of both ranks at once, and how long each took
                timed(step, 2)
                tries = []
                for k in range(3):
                    dist.barrier()
                    t = time.perf_counter()
                    tries.append((profile_steps(step, f"{arg}.{k}.rank{rank}", warmup=0, tries=1), time.perf_counter() - t))
                conn.send(tries)
            elif cmd == "cores":  # matmuls on rank 0 alone, then on both ranks at once: 5 rounds
                a, out = torch.randn(128, 128), []
                for _ in range(5):
                    out.append([_matmuls(a, rank == 0 or both) for both in (False, True)])
                conn.send(out)
            else:  # the link: median time of the collective ``name`` per size
                out = []
                for n in arg:
                    buf, got, times = torch.ones(n), torch.empty(n), []
                    for _ in range(9):
                        dist.barrier()
                        t = time.perf_counter()
                        dist.all_reduce(buf) if name == "all_reduce" else dist.all_to_all_single(got, buf)
                        times.append(time.perf_counter() - t)
                    out.append(statistics.median(times))
                conn.send(out)
    finally:
        dist.destroy_process_group()


class _Pool:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        port = 29500 + os.getpid() % 1000
        self.conns, self.procs = [], []
        for r in range(2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, port, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)

    def ask(self, cmd: str, name: str = "", arg=None) -> list:
        for c in self.conns:
            c.send((cmd, name, arg))
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.send(("stop", "", None))
        for p in self.procs:
            p.join(timeout=30)


_pool: _Pool | None = None
_link: dict = {}


def pool() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool()
    return _pool


def close() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def link_profile(collective: str = "all_reduce"):
    """The ``cpu`` profile with the gloo link these ranks measured with ``collective`` (alpha and
    beta from two sizes: the alpha of a collective counts its own rounds, two for a ring
    all-reduce, one for an all-to-all of 2 ranks) and the cores the two ranks share (matmuls on
    rank 0 alone against both ranks at once)."""
    if collective not in _link:
        small, large = 1 << 14, 1 << 22
        t = [max(x) for x in zip(*pool().ask("link", collective, [small, large]))]
        wire = 4 * WIRE[collective](2)  # bytes on the wire per float of the message
        beta = wire * (large - small) / (t[1] - t[0])
        alpha = max(t[0] - wire * small / beta, 0.0)
        base = load_profile("cpu")
        if "cores" not in _link:
            alone, both = zip(*pool().ask("cores")[0])  # rank 0's rounds: alone, then beside rank 1
            _link["cores"] = Contention(min(2.0, max(1.0, statistics.median(2 * a / b for a, b in zip(alone, both)))),
                                        base.contention.engines)
        _link[collective] = dataclasses.replace(base, name="cpu-gloo", links={**base.links, "intra": (alpha, beta)},
                                                contention=_link["cores"])
    return _link[collective]


def _ranks(name: str) -> Callable[[], float]:
    return lambda: max(pool().ask("time", name, STEPS))


def pairs() -> list[Pair]:
    traces: dict = {}
    local: dict = {}

    def record_ranks(name: str, key: str, warm: str | None = None, link: str = "all_reduce") -> None:
        if warm:  # side B's first step (its allocations) outside the timed rounds
            pool().ask("time", warm, 1)
        # the recording both ranks took least time in: the least disturbed
        tries = list(zip(*pool().ask("record", name, key)))
        traces[key] = [path for path, _ in min(tries, key=lambda ranks: max(t for _, t in ranks))]
        link_profile(link)

    def record_single() -> None:
        torch.set_num_threads(1)
        local["mlp"] = workload("mlp")
        traces["mlp"] = [profile_steps(local["mlp"], "mlp")]
        link_profile()

    def single() -> float:
        t = time.perf_counter()
        timed(local["mlp"])
        return time.perf_counter() - t

    return [
        Pair("comm", f"2 gloo ranks, all-reduce of {BUCKET * 4 >> 20} MiB -> {BUCKET * 2 >> 20} MiB per step",
             _ranks(f"bucket:{BUCKET}"), _ranks(f"bucket:{BUCKET // 2}"),
             lambda: predicted_ratio(traces["bucket"], WhatIf(comm_bytes=0.5), link_profile()),
             lambda: record_ranks(f"bucket:{BUCKET}", "bucket")),
        Pair("parallelism", "MLP step, data-parallel degree 1 -> 2 gloo ranks (DDP)", single, _ranks("ddp"),
             lambda: predicted_ratio(traces["mlp"], WhatIf(dp=2, host_ranks=2), link_profile()), record_single),
        Pair("parallelism", f"MoE step ({moe_ep.EXPERTS} experts, top-{moe_ep.TOP_K}), expert-parallel degree 1 -> 2 "
             "on 2 gloo ranks", _ranks("moe:1"), _ranks("moe:2"),
             lambda: predicted_ratio(traces["moe"], WhatIf(ep=2, scope=("experts",)), link_profile("all_to_all")),
             lambda: record_ranks("moe:1", "moe", warm="moe:2", link="all_to_all")),
    ]


__all__ = ["TRACE_DIR", "close", "pairs"]
