"""MXFP8 benchmarks: quantisation throughput, quantised matmul on CPU, simulated speed-up.

1. Quantisation of an 8192 x 4096 bf16 tensor (GB/s of input), candidates timed side by
   side in interleaved rounds (median and range): the compiled kernels (allocating the
   result as ``quantize`` does, and into preallocated tensors), the torch implementation,
   torchao's ``to_mx`` (the peer; column-wise as ``to_mx`` of the transposed tensor, which
   is how it gets column blocks on CPU), and a bare ``x.to(float8_e4m3fn)`` cast (no
   scales). Row-wise, column-wise, dual (both from one read) and grouped (8 uneven token
   groups). Every result is checked bit for bit against the torch implementation, and the
   row-wise one against torchao.
2. K = N = 4096, M in {2048, 8192, 16384}: CPU time of quantise(X) + quantise(W) +
   emulated MXFP8 matmul next to the bf16 matmul ``X @ W.T`` (emulation dequantises the
   operands, so it is slower than bf16 on a CPU: this measures the emulation's cost).
3. The same shapes simulated on a hardware profile (default ``ascend-950``) as tiled
   task graphs (256 x 256 output tiles on the cube units, quantisation in 32-row tiles on
   the vector units): bf16 makespan / MXFP8 makespan, next to the published 1.43-1.54x.
4. Backward memory: the bytes autograd saves in forward for backward (saved_tensors_hooks,
   distinct storages), the Parameters' own storage left out (it is there anyway), for a
   bf16 ``nn.Linear`` / ``GroupedExperts``, megaloom's ``MXFP8Linear`` /
   ``MXFP8GroupedExperts`` and torchao's MX training autograd functions (``mx_mm``,
   ``_MXFP8GroupedMM``, emulated on CPU; groups not aligned to 32 tokens padded by it), at
   several token counts, groups uneven or all multiples of 32.

    python benchmarks/mxfp8.py [--max-m 16384] [--repeat 7] [--profile ascend-950] [--parts quant matmul sim memory]

Needs torchao for the peer figures (``pip install -e '.[bench]'``); without it they are
skipped. Prints one JSON line per figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megaloom.ops import native
from megaloom.ops.mxfp8 import kernels
from megaloom.ops.mxfp8.format import empty_quantized
from megaloom.ops.mxfp8.grouped import group_tiles
from megaloom.ops.mxfp8 import mx_matmul, quantize, quantize_dual, quantize_grouped
from megaloom.ops.mxfp8.grouped import padded_offsets
from megaloom.ops.mxfp8.matmul import emulation_dtype
from megaloom.runtime import TaskGraph

PUBLISHED = (1.43, 1.54)  # MXFP8 over bf16 GEMM speed-up on Ascend 950, as quoted in issue 3
K = N = 4096
MS = (2048, 8192, 16384)
TILE = 256  # output tile of one cube task
QTILE = 32  # rows per quantisation task: enough tasks to occupy the vector units
PARTS = ["quant", "matmul", "sim", "memory"]


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


def _torchao_to_mx():
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None
    return lambda t: to_mx(t, torch.float8_e4m3fn, 32)


def _u8(ts) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for t in ts]


def check_bits(x: torch.Tensor, offsets: list[int], to_mx) -> None:
    """Every kind through the kernels equals the torch implementation; rows equal torchao."""
    with native.disabled():
        want = {"rows": quantize(x, "rows")[:2], "cols": quantize(x, "cols")[:2],
                "dual": [t for q in quantize_dual(x) for t in q[:2]], "grouped_cols": quantize_grouped(x, offsets)[:2]}
    got = {"rows": quantize(x, "rows")[:2], "cols": quantize(x, "cols")[:2],
           "dual": [t for q in quantize_dual(x) for t in q[:2]], "grouped_cols": quantize_grouped(x, offsets)[:2]}
    same = {k: all(torch.equal(a, b) for a, b in zip(_u8(got[k]), _u8(want[k]))) for k in want}
    if to_mx is not None:
        scale, data = to_mx(x)
        same["rows_vs_torchao"] = torch.equal(_u8([data])[0], _u8(got["rows"])[0]) and \
            torch.equal(scale.view(torch.uint8).reshape(got["rows"][1].shape), _u8(got["rows"])[1])
    emit(figure="quantize_bit_exact", native=native.enabled(), **same)


def quant_throughput(reps: int) -> None:
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    sizes = [1000, 37, 0, 2048, 1500, 977, 1630, 1000]  # 8 groups, one empty, none a multiple of 32
    offsets = torch.tensor(sizes).cumsum(0).tolist()
    gb = x.numel() * x.element_size() / 1e9
    to_mx = _torchao_to_mx()
    check_bits(x, offsets, to_mx)
    r, c = empty_quantized(tuple(x.shape), "rows"), empty_quantized(tuple(x.shape), "cols")
    g = empty_quantized((padded_offsets(offsets)[-1], x.shape[1]), "cols")
    fp8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    tiles = group_tiles(offsets)

    def torch_impl(fn):
        def run():
            with native.disabled():
                fn()
        return run

    cands = {
        "cast_allocating": lambda: x.to(torch.float8_e4m3fn),
        "cast_into": lambda: fp8.copy_(x),
        "rows.native": lambda: quantize(x, "rows"),
        "rows.native_into": lambda: kernels.quantize_into(x, r[:2], None, "floor"),
        "rows.torch": torch_impl(lambda: quantize(x, "rows")),
        "cols.native": lambda: quantize(x, "cols"),
        "cols.native_into": lambda: kernels.quantize_into(x, None, c[:2], "floor"),
        "cols.torch": torch_impl(lambda: quantize(x, "cols")),
        "dual.native": lambda: quantize_dual(x),
        "dual.native_into": lambda: kernels.quantize_into(x, r[:2], c[:2], "floor"),
        "grouped_cols.native": lambda: quantize_grouped(x, offsets),
        "grouped_cols.native_into": lambda: kernels.quantize_into(x, None, g[:2], "floor", tiles),
    }
    if to_mx is not None:
        cands["rows.torchao"] = lambda: to_mx(x)
        cands["cols.torchao"] = lambda: to_mx(x.t().contiguous())
    if not native.enabled():
        cands = {k: v for k, v in cands.items() if "native" not in k}
    times = interleaved(cands, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, ts in times.items():
        kind, _, impl = k.partition(".")
        fields = dict(figure="quantize", kind=kind, impl=impl or "cast", shape=list(x.shape), median_s=med[k],
                      min_s=min(ts), max_s=max(ts), gb_per_s=gb / med[k], gb_per_s_range=[gb / max(ts), gb / min(ts)],
                      vs_cast=med["cast_allocating"] / med[k], reps=reps)
        if f"{kind}.torchao" in med and impl != "torchao":
            per_round = sorted(a / b for a, b in zip(times[f"{kind}.torchao"], ts))  # same round, same load
            fields.update(vs_torchao=med[f"{kind}.torchao"] / med[k], vs_torchao_per_round_median=statistics.median(
                per_round), vs_torchao_per_round_range=[per_round[0], per_round[-1]])
        emit(**fields)


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


class SavedBytes:
    """Inside the block, the distinct storages autograd saves for backward, the storage of
    ``params`` (and of their views) left out; ``.bytes`` after it."""

    def __init__(self, params=()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.params:
            self.storages[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _torchao_training():
    """torchao's MX training functions as (linear(x, w), grouped_mm(x, w, offsets)), emulated on CPU; None without torchao."""
    try:
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _MXFP8GroupedMM
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,
                                                         ScaleCalculationMode)
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError:
        return None
    emu, floor, e4m3 = KernelPreference.EMULATED, ScaleCalculationMode.FLOOR, torch.float8_e4m3fn

    def linear(x, w):
        return mx_mm.apply(x, w, e4m3, e4m3, e4m3, 32, emu, MXFP8Dim0CastKernelChoice.TORCH,
                           MXFP8Dim1CastKernelChoice.TORCH, floor, False)

    def grouped(x, w, offsets):  # w (E, N, K) as our experts hold it; torchao takes (E, K, N)
        pad = any((b - a) % 32 for a, b in zip([0, *offsets[:-1]], offsets))  # torchao pads unaligned groups
        return _MXFP8GroupedMM.apply(x, w.transpose(-2, -1), torch.tensor(offsets, dtype=torch.int32), torch.bfloat16,
                                     emu, False, floor, pad)

    return linear, grouped


def backward_memory() -> None:
    from torch import nn
    import torch.nn.functional as F

    from megaloom.ops.mxfp8 import GroupedExperts, MXFP8GroupedExperts, MXFP8Linear

    ao = _torchao_training()
    k = n = 1024
    for m in (8, 20, 64, 512, 4096):
        x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
        lin = nn.Linear(k, n, bias=False).bfloat16()
        cands = {"bf16": lambda: lin(x), "megaloom": lambda: MXFP8Linear.from_float(lin)(x)}
        if ao is not None:
            cands["torchao"] = lambda: ao[0](x, lin.weight)
        saved = {}
        for name, fn in cands.items():
            with SavedBytes(lin.parameters()) as sb:
                fn()
            saved[name] = sb.bytes
        emit(figure="backward_memory", layer="linear", tokens=m, k=k, n=n, saved_bytes=saved,
             vs_bf16={name: b / saved["bf16"] for name, b in saved.items()})
    experts, dim, hidden = 8, 512, 1024
    uneven = [[t * (i + 1) // 36 for i in range(experts - 1)] for t in (16, 64, 512, 4096)]  # 1:8
    for sizes in [u + [t - sum(u)] for u, t in zip(uneven, (16, 64, 512, 4096))] + [[32 * i for i in range(1, 9)]]:
        t = sum(sizes)
        offsets = torch.tensor(sizes).cumsum(0).tolist()
        ref = GroupedExperts(experts, dim, hidden).bfloat16()
        x = torch.randn(t, dim, dtype=torch.bfloat16, requires_grad=True)

        def torchao_experts():
            h = F.silu(ao[1](x, ref.w_gate, offsets)) * ao[1](x, ref.w_up, offsets)
            return ao[1](h, ref.w_down, offsets)

        cands = {"bf16": lambda: ref(x, offsets), "megaloom": lambda: MXFP8GroupedExperts.from_float(ref)(x, offsets)}
        if ao is not None:
            cands["torchao"] = torchao_experts
        saved = {}
        for name, fn in cands.items():
            with SavedBytes(ref.parameters()) as sb:
                fn()
            saved[name] = sb.bytes
        emit(figure="backward_memory", layer="grouped_experts_swiglu", tokens=t, experts=experts, dim=dim,
             hidden=hidden, group_sizes=sizes, saved_bytes=saved,
             vs_bf16={name: b / saved["bf16"] for name, b in saved.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-m", type=int, default=max(MS), help="skip matmul shapes with a larger M")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--profile", default="ascend-950")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="what to measure (default: all)")
    args = ap.parse_args()
    emit(figure="machine", torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
         native=native.enabled(), isa=native.isa(), load_avg=list(os.getloadavg()))
    ms = [m for m in MS if m <= args.max_m]
    if "quant" in args.parts:
        quant_throughput(args.repeat)
    if "matmul" in args.parts:
        cpu_matmul(ms, min(args.repeat, 3))
    if "sim" in args.parts:
        simulated(ms, args.profile)
    if "memory" in args.parts:
        backward_memory()
    emit(figure="machine_after", load_avg=list(os.getloadavg()))


if __name__ == "__main__":
    main()
