"""DVM fusion benchmark: fused kernels against torch.compile (Inductor), side by side.

For SiLU, tanh-GELU and a 12-op chain, each written as DVM primitives and fused into one
node, on an 8192 x 4096 float32 tensor, at each thread count of ``--threads`` (torch's
intra-op threads, which DVM and Inductor kernels both use), candidates run in interleaved
rounds (each round times every candidate once, so load from other jobs on a shared
machine hits them alike):

- ``dvm_kernel``: the native kernel writing a preallocated output, its program compiled
  to one loop (ops/native/jit.c; the benchmark waits for the background build after the
  warm-up call), against ``inductor_kernel``: torch.compile of ``out.copy_(fn(x))``;
- ``dvm_interpreter``: the same kernel with compiled programs off (the block interpreter);
- ``dvm_jit``: ``dvm.jit(fn)(x)`` as users call it (allocates its output), against
  ``inductor_call``: ``torch.compile(fn)(x)`` as users call it (allocates too);
- with ``--tiled`` / ``--eager``: the tiled torch backend and unfused eager torch.

Per candidate: median / min / max milliseconds and process CPU time; per pair: the ratio
of the medians and the median and range of the per-round ratios. Then compile latency: a
new DVM signature (lowering, no compiler), a cache hit, the background C build of a hot
program, the first ``dvm.jit`` call on a new input shape, torch.compile's first call.
One JSON line per figure.

    python benchmarks/dvm.py [--rows 8192 --cols 4096 --reps 7 --threads 1 2 --no-inductor --only silu]
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
    the machine gives to other jobs (with one thread it is the kernel's own time)."""
    for fn in cands.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def at_threshold(threshold: int, fn, *args) -> None:
    """``fn(*args)`` with the threshold of compiled programs set: -1 runs the interpreter, 0
    compiles a program at its first call."""
    old = native.ext.jit_config()["threshold"]
    native.ext.jit_config(threshold=threshold)
    try:
        fn(*args)
    finally:
        native.ext.jit_config(threshold=old)


PAIRS = (("dvm_kernel", "inductor_kernel"), ("dvm_interpreter", "inductor_kernel"), ("dvm_jit", "inductor_call"),
         ("dvm_jit", "inductor_kernel"), ("dvm_tiled_kernel", "inductor_kernel"), ("eager_unfused", "inductor_kernel"))


def bench_function(name: str, fn, x: torch.Tensor, args) -> None:
    threads = torch.get_num_threads()
    j = dvm.jit(fn, limits=dvm.Limits(max_ops=16, max_cost=64.0))  # one fused node per function
    small = x[:64, :256]
    j(small)  # trace + fuse once
    graph = j.graph(small)
    if len(graph.tasks) != 1:
        raise SystemExit(f"{name}: expected one fused task, got {[t.op for t in graph.tasks]}")
    prog = dvm.program_of(graph.tasks[0].attrs)
    out, ref = torch.empty_like(x), fn(x)
    kern = dvm.compile_program(prog)
    at_threshold(0, kern, [x], [out])  # starts the C build of the program in the background (if not built yet)
    native.ext.jit_wait(300)
    st = native.ext.jit_stats()
    interp = out.clone()
    at_threshold(-1, kern, [x], [interp])
    kern([x], [out])
    emit(figure=f"{name}.check", threads=threads, ops=len(prog.code), backend=kern.backend,
         compiled_loops={k: st[k] for k in ("built", "loaded", "failed", "last_error")},
         compiled_equals_interpreter=bool(torch.equal(out, interp)), bit_exact_vs_eager=bool(torch.equal(out, ref)),
         max_abs_err=float((out - ref).abs().max()), max_abs_value=float(ref.abs().max()),
         share_differing=float((out != ref).float().mean()))
    cands = {"dvm_kernel": lambda: kern([x], [out]), "dvm_interpreter": lambda: at_threshold(-1, kern, [x], [out]),
             "dvm_jit": lambda: j(x)}
    if args.tiled:
        tiled = dvm.compile_program(prog, dvm.Options(backend="tiled"))
        cands["dvm_tiled_kernel"] = lambda: tiled([x], [out])
    if not args.no_inductor:
        torch._dynamo.reset()

        def into(t, o):
            o.copy_(fn(t))

        cf, call = torch.compile(into, dynamic=False, fullgraph=True), torch.compile(fn, dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        cf(x, out)
        emit(figure=f"{name}.torch_compile_first_call", threads=threads, seconds=time.perf_counter() - t0)
        call(x)
        cands["inductor_kernel"] = lambda: cf(x, out)
        cands["inductor_call"] = lambda: call(x)
    if args.eager:
        cands["eager_unfused"] = lambda: fn(x)
    times = interleaved(cands, args.reps)
    wall = {k: [w for w, _ in ts] for k, ts in times.items()}
    cpu = {k: [c for _, c in ts] for k, ts in times.items()}
    for k, ts in wall.items():
        emit(figure=f"{name}.{k}", threads=threads, median_ms=statistics.median(ts) * 1e3, min_ms=min(ts) * 1e3,
             max_ms=max(ts) * 1e3, cpu_median_ms=statistics.median(cpu[k]) * 1e3, reps=args.reps)
    for a, b in PAIRS:
        if a in wall and b in wall:
            per_round = [p / q for p, q in zip(wall[a], wall[b])]
            emit(figure=f"{name}.{a}_vs_{b}", threads=threads,
                 ratio_of_medians=statistics.median(wall[a]) / statistics.median(wall[b]),
                 ratio_median=statistics.median(per_round), ratio_min=min(per_round), ratio_max=max(per_round),
                 cpu_ratio_of_medians=statistics.median(cpu[a]) / statistics.median(cpu[b]))


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
    if native.AVAILABLE:  # the background C build of hot programs, as bench_function started them
        st = native.ext.jit_stats()
        emit(figure="compile.background_c_build", built=st["built"], loaded_from_disk=st["loaded"],
             failed=st["failed"], mean_s=st["seconds"] / max(st["built"], 1), cache=native.ext.jit_config()["cache_dir"])


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
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op thread counts to run")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow to compile)")
    ap.add_argument("--tiled", action="store_true", help="time the tiled torch backend too")
    ap.add_argument("--eager", action="store_true", help="time unfused eager torch too")
    ap.add_argument("--only", choices=sorted(FUNCTIONS), action="append", help="functions to time (default: all)")
    args = ap.parse_args()
    emit(figure="machine", torch=torch.__version__, cpus=os.cpu_count(), native=native.AVAILABLE, isa=native.isa(),
         load_avg=list(os.getloadavg()), shape=[args.rows, args.cols],
         jit=native.ext.jit_config() if native.AVAILABLE else None)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.only or FUNCTIONS:
            bench_function(name, FUNCTIONS[name], x, args)
            emit(figure="load", load_avg=list(os.getloadavg()))
    bench_compile(200)
    bench_jit_new_shape(50)
    emit(figure="machine_after", load_avg=list(os.getloadavg()))


if __name__ == "__main__":
    main()
