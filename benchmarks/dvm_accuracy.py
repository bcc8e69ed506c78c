"""Accuracy of the native DVM backend's transcendentals over dense sweeps of float32 inputs.

For each op, every ``step``-th float32 in its range (in order of value) runs through a
one-instruction program on the native backend, through torch (eager, contiguous), and
through float64 torch rounded once to float32 (the correctly rounded reference). Prints
per op the largest distance in ULP from each (from the reference also over normal results
only: a subnormal result is far in ULP from a flushed one) and the share of inputs where
native and torch differ at all. One JSON line per op.

    python benchmarks/dvm_accuracy.py [--step 16] [--only exp]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megaloom.ops import dvm, native
from megaloom.ops.dvm.program import Program, instr

RANGES = {"exp": (-104.0, 89.0), "tanh": (-10.0, 10.0), "sigmoid": (-100.0, 100.0), "erf": (-5.0, 5.0),
          "log": (1e-38, 3e38)}
CHUNK = 1 << 24


def ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 bits as integers in the order of the values (-0 and +0 adjacent)."""
    i = x.view(torch.int32).long()
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def floats(code: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ordered`."""
    bits = torch.where(code < 0, (-code) | 0x80000000, code)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    d = (ordered(a) - ordered(b)).abs()
    d[a.isnan() & b.isnan()] = 0
    return d


def sweep(op: str, step: int) -> dict:
    lo, hi = (int(ordered(torch.tensor([v]))) for v in RANGES[op])
    fn = getattr(torch, op)
    worst_cr = worst_normal = worst_torch = differ = n = 0
    t0 = time.perf_counter()
    for start in range(lo, hi + 1, CHUNK * step):
        x = floats(torch.arange(start, min(start + CHUNK * step, hi + 1), step, dtype=torch.int64))
        prog = Program(((tuple(x.shape), "float32"),), (instr(op, [0]),), (1,))
        out = torch.empty_like(x)
        kernel = dvm.compile_program(prog)
        kernel([x], [out])
        cr = fn(x.double()).float()
        d_cr, d_torch = distance(out, cr), distance(out, fn(x))
        normal = cr.abs() >= torch.finfo(torch.float32).tiny
        worst_cr, worst_torch = max(worst_cr, int(d_cr.max())), max(worst_torch, int(d_torch.max()))
        worst_normal = max(worst_normal, int(d_cr[normal].max()) if normal.any() else 0)
        differ += int((d_torch > 0).sum())
        n += x.numel()
    return dict(figure="dvm_accuracy", op=op, range=list(RANGES[op]), step=step, inputs=n, backend=kernel.backend,
                max_ulp_vs_correctly_rounded=worst_cr, max_ulp_vs_correctly_rounded_normal=worst_normal,
                max_ulp_vs_torch=worst_torch, share_differing=differ / n,
                seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=16, help="take every step-th float32 (1: all of them)")
    ap.add_argument("--only", choices=sorted(RANGES), action="append")
    args = ap.parse_args()
    print(json.dumps(dict(figure="machine", torch=torch.__version__, native=native.enabled(), isa=native.isa())))
    for op in args.only or RANGES:
        print(json.dumps(sweep(op, args.step if op != "log" else 4 * args.step)), flush=True)


if __name__ == "__main__":
    main()
