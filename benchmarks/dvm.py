"""DVM fusion benchmark: fused kernels against torch.compile (Inductor), side by side.

For SiLU, tanh-GELU and a 12-op chain, each written as DVM primitives, on an 8192 x 4096
float32 tensor: the DVM fused kernel of the native backend (the compiled C kernels), of
the tiled torch backend, and the Inductor kernel of the same function, each writing into a
preallocated output; then unfused eager torch and ``dvm.jit`` with output allocation.
Candidates are timed in interleaved rounds (each round runs every candidate once), so load
from other jobs on a shared machine hits them alike; medians and minima are reported and
ratios are against the Inductor kernel of the same round set. Then compile latency: a new
DVM signature, a cache hit, the first ``dvm.jit`` call on a new input shape (small
inputs), and torch.compile's first call. One JSON line per figure.

    python benchmarks/dvm.py [--rows 8192 --cols 4096 --reps 7 --threads 1 --no-inductor --only silu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from megaloom.ops import dvm, native
from megaloom.ops.dvm.program import Program, instr

C = math.sqrt(2.0 / math.pi)


def silu(x):
    return x * torch.reciprocal(torch.exp(torch.neg(x)) + 1)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(C * (x + 0.044715 * x * x * x)))


def chain12(x):
    """Twelve primitives: ten arithmetic (three with a tensor operand), one exp, one sigmoid."""
    a = x * 0.5 + 0.25
    b = torch.exp(a * -1.5)
    c = torch.sigmoid(x) * b
    d = c - x * 0.125
    e = d * d * 0.75 + x
    return e * 2.0


FUNCTIONS = {"silu": silu, "gelu_tanh": gelu_tanh, "chain12": chain12}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def interleaved(cands: dict[str, object], reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, process CPU) seconds of every candidate, once per round, rounds repeated: load
    spikes hit all alike. CPU time counts every thread of this process, and not the time
    the machine gives to other jobs (with --threads 1 it is the kernel's own time)."""
    for fn in cands.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def bench_function(name: str, fn, x: torch.Tensor, reps: int, inductor: bool) -> None:
    j = dvm.jit(fn, limits=dvm.Limits(max_ops=16, max_cost=64.0))  # one fused node per function
    small = x[:64, :256]
    j(small)  # trace + fuse once
    graph = j.graph(small)
    if len(graph.tasks) != 1:
        raise SystemExit(f"{name}: expected one fused task, got {[t.op for t in graph.tasks]}")
    prog = dvm.program_of(graph.tasks[0].attrs)
    out = torch.empty_like(x)
    kern = dvm.compile_program(prog)
    tiled = dvm.compile_program(prog, dvm.Options(backend="tiled"))
    ref = fn(x)
    kern([x], [out])
    emit(figure=f"{name}.check", ops=len(prog.code), backend=kern.backend, bit_exact=bool(torch.equal(out, ref)),
         max_abs_err=float((out - ref).abs().max()), max_abs_value=float(ref.abs().max()),
         share_differing=float((out != ref).float().mean()))
    cands = {"dvm_native_kernel": lambda: kern([x], [out]), "dvm_tiled_kernel": lambda: tiled([x], [out])}
    if inductor:
        torch._dynamo.reset()

        def into(t, o):
            o.copy_(fn(t))

        cf = torch.compile(into, dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        cf(x, out)
        emit(figure=f"{name}.torch_compile_first_call", seconds=time.perf_counter() - t0)
        cands["inductor_kernel"] = lambda: cf(x, out)
    cands["eager_unfused"] = lambda: fn(x)
    cands["dvm_jit_allocating"] = lambda: j(x)
    times = interleaved(cands, reps)
    base = "inductor_kernel" if inductor else "dvm_native_kernel"
    wall = {k: [w for w, _ in ts] for k, ts in times.items()}
    cpu = {k: statistics.median(c for _, c in ts) for k, ts in times.items()}
    bmed, bmin = statistics.median(wall[base]), min(wall[base])
    for k, ts in wall.items():
        emit(figure=f"{name}.{k}", median_ms=statistics.median(ts) * 1e3, min_ms=min(ts) * 1e3,
             max_ms=max(ts) * 1e3, ratio_median=statistics.median(ts) / bmed, ratio_min=min(ts) / bmin,
             cpu_median_ms=cpu[k] * 1e3, cpu_ratio_median=cpu[k] / cpu[base], vs=base, reps=reps)


def bench_compile(n: int) -> None:
    code = (instr("neg", [0]), instr("exp", [1]), instr("reciprocal", [3]), instr("mul", [0, 4]))
    progs = [Program((((64, 64), "float32"),), code[:2] + (instr("add", [2], scalar=1.0 + i),) + code[2:], (5,))
             for i in range(n)]
    dvm.clear_cache()
    new = []
    for p in progs:  # every scalar differs: every signature is new
        t0 = time.perf_counter()
        dvm.compile_program(p)
        new.append(time.perf_counter() - t0)
    emit(figure="compile.new_signature", median_us=statistics.median(new) * 1e6, max_us=max(new) * 1e6, n=n,
         backend=dvm.compile_program(progs[0]).backend, target_us=100)
    same = [Program((((64 + i, 64), "float32"),), progs[0].code, (5,)) for i in range(n)]
    hit = []
    for p in same:  # fresh program objects of the same structure, other sizes: signature + lookup
        t0 = time.perf_counter()
        dvm.compile_program(p)
        hit.append(time.perf_counter() - t0)
    emit(figure="compile.cache_hit", median_us=statistics.median(hit) * 1e6, n=n, target_us=5)


def bench_jit_new_shape(n: int) -> None:
    """First call of one jit function on each of ``n`` new small input shapes."""
    for name, fn in FUNCTIONS.items():
        j = dvm.jit(fn)
        t0 = time.perf_counter()
        j(torch.randn(8, 64))
        first = time.perf_counter() - t0
        firsts = []
        for i in range(n):
            x = torch.randn(16 + i, 64 + 2 * i)
            t0 = time.perf_counter()
            j(x)
            firsts.append(time.perf_counter() - t0)
        emit(figure=f"jit_new_shape.{name}", median_us=statistics.median(firsts) * 1e6, max_us=max(firsts) * 1e6,
             very_first_call_ms=first * 1e3, n=n, target_us=100,
             note="first call per new shape; the very first call traces the function once")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow to compile)")
    ap.add_argument("--only", choices=sorted(FUNCTIONS), action="append", help="functions to time (default: all)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (DVM and Inductor kernels alike)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    emit(figure="machine", torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
         native=native.AVAILABLE, isa=native.isa(), load_avg=list(os.getloadavg()), shape=[args.rows, args.cols])
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    for name in args.only or FUNCTIONS:
        bench_function(name, FUNCTIONS[name], x, args.reps, not args.no_inductor)
    bench_compile(200)
    bench_jit_new_shape(50)
    emit(figure="machine_after", load_avg=list(os.getloadavg()))


if __name__ == "__main__":
    main()
