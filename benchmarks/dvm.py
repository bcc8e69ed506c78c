"""DVM fusion benchmark: SiLU and tanh-GELU written as primitives, side by side.

For each function on an 8192 x 4096 float32 tensor: unfused eager torch (the baseline),
DVM fused (tiled backend, including output allocation, and kernel only into a
preallocated output), torch.compile of the same function (steady state and compile
time) and torch's built-in F.silu / F.gelu. Then compile latency of the tiled backend:
a new signature and a cache hit. One JSON line per figure; ratios are against the
unfused eager time measured in the same run. Candidates are timed in interleaved
rounds (each round runs every candidate once), so load from other jobs on a shared
machine hits them alike; min and median are both reported.

    python benchmarks/dvm.py [--rows 8192 --cols 4096 --reps 5 --no-inductor]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from megaloom.ops import dvm
from megaloom.ops.dvm.program import Program, instr

C = math.sqrt(2.0 / math.pi)


def silu_prim(x):
    return x * torch.reciprocal(torch.exp(torch.neg(x)) + 1)


def gelu_prim(x):
    return 0.5 * x * (1 + torch.tanh(C * (x + 0.044715 * x * x * x)))


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def interleaved(cands: dict[str, object], reps: int) -> dict[str, list[float]]:
    """Time every candidate once per round, rounds repeated: load spikes hit all alike."""
    for fn in cands.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def bench_function(name: str, fn, builtin, x: torch.Tensor, reps: int, inductor: bool) -> None:
    j = dvm.jit(fn)
    t0 = time.perf_counter()
    got = j(x)
    emit(figure=f"{name}.dvm_first_call", seconds=time.perf_counter() - t0,
         note="fx trace + fusion pass + compile + run")
    ref = fn(x)
    emit(figure=f"{name}.dvm_max_abs_err", value=float((got - ref).abs().max()), bit_exact=bool(torch.equal(got, ref)))
    task = j.graph(x).tasks[0]
    prog = dvm.program_of(task.attrs)
    out = torch.empty_like(x)
    cands = {"unfused_eager": lambda: fn(x), "dvm_fused": lambda: j(x)}
    kern = dvm.compile_program(prog)
    cands["dvm_fused_kernel_only"] = lambda: kern([x], [out])
    for label, opts in (("tile_1MiB", dvm.Options(tile_bytes=1 << 20)), ("threads_1", dvm.Options(threads=1))):
        k = dvm.compile_program(prog, opts)
        cands[f"dvm_fused_kernel_only.{label}"] = (lambda k: lambda: k([x], [out]))(k)
    cands["torch_builtin"] = lambda: builtin(x)
    if inductor:
        torch._dynamo.reset()
        cf = torch.compile(fn)
        t0 = time.perf_counter()
        cf(x)
        emit(figure=f"{name}.torch_compile_compile_time", seconds=time.perf_counter() - t0)
        cands["torch_compile"] = lambda: cf(x)
        ik = dvm.compile_program(prog, dvm.Options(backend="inductor"))
        ik([x], [out])
        emit(figure=f"{name}.dvm_inductor_backend_compile_time", seconds=ik.compile_seconds)
        cands["dvm_inductor_backend_kernel_only"] = lambda: ik([x], [out])
    times = interleaved(cands, reps)
    base_min, base_med = min(times["unfused_eager"]), statistics.median(times["unfused_eager"])
    for k, ts in times.items():
        emit(figure=f"{name}.{k}", min_s=min(ts), median_s=statistics.median(ts),
             ratio_min=min(ts) / base_min, ratio_median=statistics.median(ts) / base_med, reps=reps,
             **({"ops": len(prog.code)} if k == "dvm_fused" else {}))


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
         target_us=100)
    same = [Program((((64 + i, 64), "float32"),), progs[0].code, (5,)) for i in range(n)]
    hit = []
    for p in same:  # fresh program objects of the same structure, other sizes: signature + lookup
        t0 = time.perf_counter()
        dvm.compile_program(p)
        hit.append(time.perf_counter() - t0)
    emit(figure="compile.cache_hit", median_us=statistics.median(hit) * 1e6, n=n, target_us=5,
         note="signature of a fresh Program object + lookup")
    hit2 = []
    for _ in range(n):
        t0 = time.perf_counter()
        dvm.compile_program(progs[0])
        hit2.append(time.perf_counter() - t0)
    emit(figure="compile.cache_hit_same_program", median_us=statistics.median(hit2) * 1e6, n=n, target_us=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow to compile)")
    args = ap.parse_args()
    emit(figure="machine", torch=torch.__version__, threads=torch.get_num_threads(), l2_bytes=dvm.l2_cache_bytes(),
         shape=[args.rows, args.cols])
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    bench_function("silu", silu_prim, F.silu, x, args.reps, not args.no_inductor)
    bench_function("gelu_tanh", gelu_prim, lambda t: F.gelu(t, approximate="tanh"), x, args.reps, not args.no_inductor)
    bench_compile(200)


if __name__ == "__main__":
    main()
