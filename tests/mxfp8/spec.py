"""A straightforward float64 implementation of the OCP MX v1.0 MXFP8 (E4M3) rules, block by block.

Independent of ``megaloom.ops.mxfp8.format``: codes are decoded from their bit fields, the
shared exponent comes from ``math.frexp`` and exact comparisons, rounding from ``round``
(ties to even) on float64 values.
"""
from __future__ import annotations

import math

import torch


def e4m3_value(code: int) -> float:
    """Value of an E4M3 (fn) code: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = 2.0 ** -6 * (m / 8) if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


CODE_OF = {(abs(e4m3_value(c)), math.copysign(1, e4m3_value(c)) < 0): c for c in range(256) if not math.isnan(e4m3_value(c))}


def e4m3_round(v: float) -> int:
    """Code of ``v`` rounded to nearest even on the E4M3 grid, saturated to +-448."""
    a = abs(v)
    if a >= 448:
        r = 448.0
    elif a == 0:
        r = 0.0
    else:
        quantum = 2.0 ** (max(math.frexp(a)[1] - 1, -6) - 3)
        r = min(round(a / quantum) * quantum, 448.0)
    return CODE_OF[(r, math.copysign(1, v) < 0)]


def shared_exponent(amax: float, mode: str) -> int:
    if amax == 0:
        return -127
    if mode == "floor":
        e = math.frexp(amax)[1] - 1 - 8
    else:
        e = math.ceil(math.log2(amax / 448))
        while 448 * 2.0 ** (e - 1) >= amax:
            e -= 1
        while 448 * 2.0 ** e < amax:
            e += 1
    return min(max(e, -127), 127)


def quantize_rows(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data codes uint8, scale codes uint8) of a 2-D tensor blocked along its last dim."""
    rows = x.double().tolist()
    data, scales = [], []
    for row in rows:
        drow, srow = [], []
        for b in range(0, len(row), 32):
            block = row[b:b + 32]
            if not all(math.isfinite(v) for v in block):
                drow += [0x7F] * 32
                srow.append(0xFF)
                continue
            e = shared_exponent(max(abs(v) for v in block), mode)
            drow += [e4m3_round(v / 2.0 ** e) for v in block]
            srow.append(e + 127)
        data.append(drow)
        scales.append(srow)
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


def quantize_ref(x: torch.Tensor, axis: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    if axis == "rows":
        return quantize_rows(x, mode)
    d, s = quantize_rows(x.t(), mode)
    return d.t().contiguous(), s.t().contiguous()
