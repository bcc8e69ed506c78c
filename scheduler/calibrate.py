"""Measure this machine and write the ``cpu`` hardware profile.

Every rate is one unit's, as the cost model charges it: a unit is one worker thread running
kernels on one torch thread, so each figure is timed on one torch thread, repeated, and the
best run counts (other jobs on a shared machine only ever slow a run down). Matmul flop/s
per dtype, memory bandwidth (large tensor copies), shared-memory copy latency, the
ThreadExecutor's per-task dispatch overhead, and the cores the cube, vector and comm workers
really share (``contention.cores``): as many matmul threads as the process may use cores, at
once, against one alone. Each figure's source says how it was measured; the inter-node link is
an estimate (nothing to measure on one machine).
"""
from __future__ import annotations

import os
import platform
import re
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import atomic_write
from megaloom.scheduler.profile import HardwareProfile, parse_profile, user_profile_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _best(fn: Callable[[], object], seconds: float) -> float:
    """The fastest of repeated calls of ``fn`` within about ``seconds`` (at least 3 calls)."""
    fn()  # warm-up
    best, t_end, n = float("inf"), time.perf_counter() + seconds, 0
    while n < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def _matmul(dtype: torch.dtype, n: int) -> Callable[[], object]:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return lambda: torch.matmul(a, b, out=out)


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _best(lambda: dst.copy_(src), seconds)


def shared_cores(threads: int, n: int, seconds: float, calls: int = 4) -> float:
    """The cores ``threads`` threads of fp32 ``n``-square matmuls get together: ``threads`` times
    the best time of ``calls`` matmuls on one thread alone over the best time of every thread
    doing as many at once; between 1 and ``threads`` (other jobs take their share)."""
    fns = [_matmul(torch.float32, n) for _ in range(threads)]

    def batch(fn: Callable[[], object]) -> None:
        for _ in range(calls):
            fn()

    def together() -> None:
        workers = [threading.Thread(target=batch, args=(fn,)) for fn in fns]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return min(float(threads), max(1.0, threads * _best(lambda: batch(fns[0]), seconds) / _best(together, seconds)))


def dispatch_overhead(tasks: int) -> float:
    """Seconds per task of the ThreadExecutor on independent no-op tasks (null kernels)."""
    from megaloom.runtime.executors.threaded import ThreadExecutor
    from megaloom.runtime.graph import TaskGraph
    from megaloom.runtime.registry import Cost

    g = TaskGraph("calibrate-dispatch")
    for _ in range(tasks):
        g.task("noop", engine="vector", cost=Cost())
    ex = ThreadExecutor({"vector": 1}, kernels="null")
    return _best(lambda: ex.run(g), 0.0) / tasks


def calibrate(matmul_size: int = 512, copy_bytes: int = 64 << 20, seconds: float = 0.3, tasks: int = 500) -> HardwareProfile:
    """Measure this machine; the ``cpu`` profile (not yet written)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one unit = one worker thread on one torch thread
    try:
        unit = {p: 2.0 * matmul_size ** 3 / _best(_matmul(dt, matmul_size), seconds) for p, dt in DTYPES.items()}
        bw = copy_bandwidth(copy_bytes, seconds)
        shared = shared_cores(cores, matmul_size, seconds)
        latency = _best(lambda: torch.empty(1).copy_(torch.zeros(1)), min(seconds, 0.05))
    finally:
        torch.set_num_threads(threads)
    overhead = dispatch_overhead(tasks)
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    how = f"measured by `megaloom calibrate` on {platform.node()} ({machine}, {cores} cores, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    data = {
        "name": "cpu",
        "description": f"this machine ({machine}, {cores} cores), calibrated",
        "units": {"cube": cores, "vector": cores, "comm": 1},
        "peak": {e: {p: r * cores for p, r in unit.items()} for e in ("cube", "vector")},
        "mem_bw": bw * cores,
        "links": {"intra": {"alpha": latency, "beta": bw / 2}, "inter": {"alpha": 5.0e-5, "beta": 1.25e9}},
        "task_overhead": overhead,
        "contention": {"cores": shared, "engines": ["cube", "vector", "comm"], "overlap": 0.0},
        "sources": {
            "units": f"one cube and one vector unit per core ({cores} cores this process may use); one comm channel",
            "peak.cube": f"{how}: best {matmul_size}x{matmul_size} torch.matmul per dtype on one thread, times the units",
            "peak.vector": "same as peak.cube (the same CPU cores)",
            "mem_bw": f"{how}: best copy of {copy_bytes >> 20} MiB (read + write bytes) on one thread, times the units",
            "links.intra": f"{how}: alpha = 1-element copy time, beta = half one thread's copy bandwidth",
            "links.inter": "estimate: 10 GbE (1.25 GB/s), 50 us latency",
            "task_overhead": f"{how}: ThreadExecutor null-kernel dispatch over {tasks} tasks",
            "contention": f"{how}: {cores} matmul threads at once ran {shared:.2f}x one thread's speed in all "
                          "(the cube, vector and comm workers share the cores)",
        },
    }
    return parse_profile(data, "<calibration>")


def write_profile(profile: HardwareProfile, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as YAML atomically (default: the user profile directory)."""
    if path is None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", profile.name):
        raise ConfigError(f"profile name {profile.name!r} is not a plain file name (letters, digits, '.', '_', '-'), "
                          "so it cannot name a file in the profile directory")
    out = Path(path) if path is not None else user_profile_dir() / f"{profile.name}.yaml"
    text = "# written by `megaloom calibrate`\n" + yaml.safe_dump(profile.to_dict(), sort_keys=False)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text.encode())
    except OSError as e:
        raise ConfigError(f"cannot write profile {str(out)!r}: {e.strerror or e}") from None
    return out
