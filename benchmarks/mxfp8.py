"""MXFP8 benchmarks: quantisation throughput, quantised matmul on CPU, simulated speed-up.

1. Quantisation of an 8192 x 4096 bf16 tensor (GB/s of input): row-wise, column-wise,
   dual (both in one call), grouped (8 uneven token groups), next to a plain
   ``x.to(float8_e4m3fn)`` cast (no scales) as the baseline.
2. K = N = 4096, M in {2048, 8192, 16384}: CPU time of quantise(X) + quantise(W) +
   emulated MXFP8 matmul next to the bf16 matmul ``X @ W.T`` (emulation dequantises the
   operands, so it is slower than bf16 on a CPU: this measures the emulation's cost).
3. The same shapes simulated on a hardware profile (default ``ascend-950``) as tiled
   task graphs (256 x 256 output tiles on the cube units, quantisation in 32-row tiles on
   the vector units): bf16 makespan / MXFP8 makespan, next to the published 1.43-1.54x.

    python benchmarks/mxfp8.py [--max-m 16384] [--repeat 3] [--profile ascend-950] [--skip-cpu]

Prints one JSON line per figure.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megaloom.ops.mxfp8 import mx_matmul, quantize, quantize_dual, quantize_grouped
from megaloom.ops.mxfp8.matmul import emulation_dtype
from megaloom.runtime import TaskGraph

PUBLISHED = (1.43, 1.54)  # MXFP8 over bf16 GEMM speed-up on Ascend 950, as quoted in issue 3
K = N = 4096
MS = (2048, 8192, 16384)
TILE = 256  # output tile of one cube task
QTILE = 32  # rows per quantisation task: enough tasks to occupy the vector units


def best(fn, repeat: int) -> float:
    """Fastest of ``repeat`` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def quant_throughput(repeat: int) -> None:
    x = torch.randn(8192, 4096, dtype=torch.bfloat16)
    sizes = [1000, 37, 0, 2048, 1500, 977, 1630, 1000]  # 8 groups, one empty, none a multiple of 32
    offsets = torch.tensor(sizes).cumsum(0).tolist()
    gb = x.numel() * x.element_size() / 1e9
    base = best(lambda: x.to(torch.float8_e4m3fn), repeat)
    emit(figure="quantize", kind="cast_baseline", shape=[8192, 4096], seconds=base, gb_per_s=gb / base)
    for kind, fn in (("rows", lambda: quantize(x, "rows")), ("cols", lambda: quantize(x, "cols")),
                     ("dual", lambda: quantize_dual(x)), ("grouped_cols", lambda: quantize_grouped(x, offsets))):
        s = best(fn, repeat)
        emit(figure="quantize", kind=kind, shape=[8192, 4096], seconds=s, gb_per_s=gb / s, vs_cast=base / s)


def cpu_matmul(ms: list[int], repeat: int) -> None:
    w = torch.randn(N, K, dtype=torch.bfloat16)
    for m in ms:
        x = torch.randn(m, K, dtype=torch.bfloat16)
        bf16 = best(lambda: x @ w.t(), repeat)
        qx, qw = quantize(x), quantize(w)
        quant = best(lambda: (quantize(x), quantize(w)), repeat)
        mm = best(lambda: mx_matmul(qx, qw, "NT", torch.bfloat16), repeat)
        emit(figure="cpu_matmul", m=m, n=N, k=K, bf16_s=bf16, mx_quantize_s=quant, mx_matmul_s=mm,
             mx_total_s=quant + mm, speedup_vs_bf16=bf16 / (quant + mm),
             mode=f"emulated: dequantise to {emulation_dtype(qx, qw, torch.bfloat16)}, fp32-accumulating GEMM")


def linear_graph(m: int, fmt: str, quantize_w: bool = True) -> TaskGraph:
    """Y = X W^T as tiles: bf16 ``matmul`` tasks, or MXFP8 row-tile quantisation + ``mx_matmul`` tasks."""
    g = TaskGraph(f"linear_{fmt}_{m}")
    y = g.output("y", (m, N), "bfloat16")
    if fmt == "bf16":
        x, w = g.input("x", (m, K), "bfloat16"), g.input("w", (N, K), "bfloat16")
        for i in range(0, m, TILE):
            for j in range(0, N, TILE):
                g.task("matmul", [x[i:i + TILE], w[j:j + TILE]], [y[i:i + TILE, j:j + TILE]],
                       attrs={"trans_b": True, "out_dtype": "bfloat16"})
        return g
    x = g.input("x", (m, K), "bfloat16")
    xd, xs = g.buffer("xd", (m, K), "float8_e4m3fn"), g.buffer("xs", (m, K // 32), "float8_e8m0fnu")
    if quantize_w:
        w = g.input("w", (N, K), "bfloat16")
        wd, ws = g.buffer("wd", (N, K), "float8_e4m3fn"), g.buffer("ws", (N, K // 32), "float8_e8m0fnu")
        for j in range(0, N, QTILE):
            g.task("mx_quantize", [w[j:j + QTILE]], [wd[j:j + QTILE], ws[j:j + QTILE]], attrs={"axis": "rows"})
    else:
        wd, ws = g.input("wd", (N, K), "float8_e4m3fn"), g.input("ws", (N, K // 32), "float8_e8m0fnu")
    for i in range(0, m, QTILE):
        g.task("mx_quantize", [x[i:i + QTILE]], [xd[i:i + QTILE], xs[i:i + QTILE]], attrs={"axis": "rows"})
    for i in range(0, m, TILE):
        for j in range(0, N, TILE):
            g.task("mx_matmul", [xd[i:i + TILE], xs[i:i + TILE], wd[j:j + TILE], ws[j:j + TILE]],
                   [y[i:i + TILE, j:j + TILE]], attrs={"layout": "NT", "out_dtype": "bfloat16"})
    return g


def simulated(ms: list[int], profile: str) -> None:
    from megaloom.scheduler import Simulator, load_profile

    prof = load_profile(profile)
    for m in ms:
        span = {}
        for name, g in (("bf16", linear_graph(m, "bf16")), ("mxfp8", linear_graph(m, "mxfp8")),
                        ("mxfp8_w_prequantised", linear_graph(m, "mxfp8", quantize_w=False))):
            span[name] = Simulator(prof, policy="critical_path").schedule(g).makespan
        emit(figure="simulated_matmul", profile=profile, m=m, n=N, k=K, tile=TILE, quant_tile_rows=QTILE,
             bf16_us=span["bf16"] * 1e6, mxfp8_us=span["mxfp8"] * 1e6,
             mxfp8_w_prequantised_us=span["mxfp8_w_prequantised"] * 1e6,
             speedup=span["bf16"] / span["mxfp8"],
             speedup_w_prequantised=span["bf16"] / span["mxfp8_w_prequantised"],
             published=list(PUBLISHED))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-m", type=int, default=max(MS), help="skip matmul shapes with a larger M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", default="ascend-950")
    ap.add_argument("--skip-cpu", action="store_true", help="only the simulated figures")
    args = ap.parse_args()
    ms = [m for m in MS if m <= args.max_m]
    if not args.skip_cpu:
        quant_throughput(args.repeat)
        cpu_matmul(ms, args.repeat)
    simulated(ms, args.profile)


if __name__ == "__main__":
    main()
