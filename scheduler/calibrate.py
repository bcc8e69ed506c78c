"""Measure this machine and write the ``cpu`` hardware profile.

Every rate is one unit's, as the cost model charges it: a unit is one worker thread running
kernels on one torch thread, so each figure is timed on one torch thread, repeated, and the
best run counts (other jobs on a shared machine only ever slow a run down). Matmul flop/s
per dtype, memory bandwidth (large tensor copies), shared-memory copy latency, the
ThreadExecutor's per-task dispatch overhead, and the cores the cube, vector and comm workers
really share (``contention.cores``): a graph of matmul tasks on as many cube workers as the
process may use cores, against one (the median over repeated rounds). Each figure's source says how it was measured; the inter-node link is
an estimate (nothing to measure on one machine).
"""
from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.executors.threaded import ThreadExecutor
from megaloom.runtime.files import atomic_write
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import COMM, CUBE, ENGINE_KINDS, VECTOR, Cost
from megaloom.scheduler.profile import HardwareProfile, parse_profile, user_profile_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _best(fn: Callable[[], object], seconds: float) -> float:
    """The fastest of repeated calls of ``fn`` within about ``seconds`` (at least 3 calls)."""
    fn()  # warm-up
    times, t_end = [], time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _matmul(dtype: torch.dtype, n: int) -> Callable[[], object]:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return lambda: torch.matmul(a, b, out=out)


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _best(lambda: dst.copy_(src), seconds)


def shared_cores(units: int, n: int, seconds: float, tasks: int = 32) -> float:
    """The cores ``units`` cube workers of the ThreadExecutor get together: the makespan of
    ``tasks`` independent fp32 ``n``-square matmuls on one cube worker over that on ``units``
    (each beside a vector worker running as many small tasks, as a graph's workers do),
    the median over rounds within about ``seconds`` (at least 5); between 1 and ``units``. Other
    jobs take their share, and a worker that loses its core loses it for a scheduler slice, so a
    loaded machine gives fewer than its cores; the median, since a moment when they pause says
    little of a run."""
    g = TaskGraph("calibrate-cores")
    a, b = g.input("a", (n, n)), g.input("b", (n, n))
    for i in range(tasks):
        g.task("matmul", [a, b], [g.output(f"c{i}", (n, n))])
        g.task("silu", [a], [g.output(f"s{i}", (n, n))])
    inputs = {"a": torch.randn(n, n), "b": torch.randn(n, n)}
    one, many = (ThreadExecutor({CUBE: k, VECTOR: 1}, intra_op_threads=1) for k in (1, units))
    one.run(g, inputs), many.run(g, inputs)  # warm-up
    ratios, t_end = [], time.perf_counter() + seconds
    while len(ratios) < 5 or time.perf_counter() < t_end:
        ratios.append(one.run(g, inputs).trace.makespan / many.run(g, inputs).trace.makespan)
    return min(float(units), max(1.0, statistics.median(ratios)))


def dispatch_overhead(tasks: int) -> float:
    """Seconds per task of the ThreadExecutor on independent no-op tasks (null kernels)."""
    g = TaskGraph("calibrate-dispatch")
    for _ in range(tasks):
        g.task("noop", engine=VECTOR, cost=Cost())
    ex = ThreadExecutor({VECTOR: 1}, kernels="null")
    return _best(lambda: ex.run(g), 0.0) / tasks


def calibrate(matmul_size: int = 512, copy_bytes: int = 64 << 20, seconds: float = 0.3, tasks: int = 500) -> HardwareProfile:
    """Measure this machine; the ``cpu`` profile (not yet written)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one unit = one worker thread on one torch thread
    try:
        unit = {p: 2.0 * matmul_size ** 3 / _best(_matmul(dt, matmul_size), seconds) for p, dt in DTYPES.items()}
        bw = copy_bandwidth(copy_bytes, seconds)
        shared = shared_cores(cores, min(matmul_size, 128), seconds)
        latency = _best(lambda: torch.empty(1).copy_(torch.zeros(1)), min(seconds, 0.05))
    finally:
        torch.set_num_threads(threads)
    overhead = dispatch_overhead(tasks)
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    how = f"measured by `megaloom calibrate` on {platform.node()} ({machine}, {cores} cores, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    data = {
        "name": "cpu",
        "description": f"this machine ({machine}, {cores} cores), calibrated",
        "units": {CUBE: cores, VECTOR: cores, COMM: 1},
        "peak": {e: {p: r * cores for p, r in unit.items()} for e in (CUBE, VECTOR)},
        "mem_bw": bw * cores,
        "links": {"intra": {"alpha": latency, "beta": bw / 2}, "inter": {"alpha": 5.0e-5, "beta": 1.25e9}},
        "task_overhead": overhead,
        "contention": {"cores": shared, "engines": list(ENGINE_KINDS), "overlap": 0.0},
        "sources": {
            "units": f"one cube and one vector unit per core ({cores} cores this process may use); one comm channel",
            "peak.cube": f"{how}: best {matmul_size}x{matmul_size} torch.matmul per dtype on one thread, times the units",
            "peak.vector": "same as peak.cube (the same CPU cores)",
            "mem_bw": f"{how}: best copy of {copy_bytes >> 20} MiB (read + write bytes) on one thread, times the units",
            "links.intra": f"{how}: alpha = 1-element copy time, beta = half one thread's copy bandwidth",
            "links.inter": "estimate: 10 GbE (1.25 GB/s), 50 us latency",
            "task_overhead": f"{how}: ThreadExecutor null-kernel dispatch over {tasks} tasks",
            "contention": f"{how}: {cores} cube workers of the ThreadExecutor ran matmul tasks {shared:.2f}x "
                          "as fast as one (the cube, vector and comm workers share the cores)",
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
