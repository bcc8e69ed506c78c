"""Work figures of imported device ops: flops, bytes, comm bytes and precision.

* Kernels take them from the CPU op that launched them (``record_shapes=True`` gives its
  ``Input Dims`` and ``Input type``): GEMMs ``2*m*n*k`` flops and their three matrices'
  bytes; convolutions from input, weight and output shapes; any other op reads each tensor
  input once and writes one output the size of its largest input. When one op launches
  several kernels, its figures are shared among them by recorded duration.
* Collectives take message size, dtype and group size from the kernel's own arguments or
  those of the launching ``record_param_comms`` op, and are charged the bytes each rank puts
  on the wire (ring algorithms: ``2(n-1)/n`` of the message for all-reduce, ``(n-1)/n`` for
  all-gather, reduce-scatter and all-to-all, the message for broadcast and send/recv).
* Copies take ``bytes`` from their own arguments: host <-> device copies cross the ``host``
  link, device copies read and write device memory.

Ops without figures keep their recorded duration in every what-if; the report counts them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Any

from megaloom.ops.basic import precision as precision_of
from megaloom.runtime.dtypes import itemsize

_DTYPE = {"float": "float32", "double": "float64", "c10::half": "float16", "c10::bfloat16": "bfloat16",
          "half": "float16", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "float64": "float64",
          "long int": "int64", "long": "int64", "int": "int32", "bool": "bool", "signed char": "int8", "char": "int8",
          "unsigned char": "uint8", "byte": "uint8", "c10::float8_e4m3fn": "float8_e4m3fn",
          "float8_e4m3fn": "float8_e4m3fn"}
_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|linear|matmul)$")
_CONV = re.compile(r"^aten::(_?convolution|conv[123]d)$")
_CONV_BWD = "aten::convolution_backward"
_WIRE = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0}
NODE_GPUS = 8
"""A group wider than this spans nodes: its collectives cross the ``inter`` link."""


@dataclass(slots=True)
class Work:
    """What one op (or one kernel) does."""

    flops: float = 0.0
    bytes: float = 0.0
    comm_bytes: float = 0.0
    precision: str = "fp32"
    link: str = "intra"


def dtype_name(t: Any) -> str | None:
    """A profiler type string (``float``, ``c10::BFloat16``, ``Float``) as a megaloom dtype, or None."""
    return _DTYPE.get(t.lower()) if isinstance(t, str) else None


def _tensors(args: dict) -> list[tuple[list[int], str]]:
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list):
        return []
    types = types if isinstance(types, list) else []
    out = []
    for i, d in enumerate(dims):
        dt = dtype_name(types[i]) if i < len(types) else "float32"
        if dt and isinstance(d, list) and d and all(type(v) is int and v >= 0 for v in d):
            out.append((d, dt))
    return out


def _concrete(args: dict, i: int) -> list[int] | int | None:
    vals = args.get("Concrete Inputs")
    if not isinstance(vals, list) or i >= len(vals) or not isinstance(vals[i], str):
        return None
    nums = [int(x) for x in re.findall(r"-?\d+", vals[i])]
    if not nums:
        return None
    return nums if vals[i].strip().startswith("[") else nums[0]


def _gemm(name: str, ts: list[tuple[list[int], str]]) -> Work | None:
    mats = [(d, dt) for d, dt in ts if len(d) in (2, 3)]
    if name in ("aten::addmm", "aten::baddbmm", "aten::addbmm") and len(mats) >= 3:
        mats = mats[1:]  # the added input comes first
    if len(mats) < 2:
        return None
    (a, dt), (b, _) = mats[0], mats[1]
    batch = a[0] if len(a) == 3 else 1
    m, k = a[-2], a[-1]
    n = b[-2] if name == "aten::linear" else b[-1]  # linear's weight is [out, in]
    return Work(2.0 * batch * m * n * k, float(itemsize(dt) * batch * (m * k + k * n + m * n)), 0.0, precision_of(dt))


def _conv_flops(x: list[int], w: list[int], out_spatial: list[int]) -> float:
    return 2.0 * x[0] * w[0] * prod(out_spatial) * w[1] * prod(w[2:])


def _conv(args: dict, ts: list[tuple[list[int], str]]) -> Work | None:
    if len(ts) < 2 or len(ts[0][0]) < 3 or len(ts[1][0]) != len(ts[0][0]):
        return None
    (x, dt), (w, _) = ts[0], ts[1]
    nd = len(x) - 2
    stride, pad, dil = (_concrete(args, i) for i in (3, 4, 5))
    if not all(isinstance(v, list) and len(v) in (1, nd) for v in (stride, pad, dil)):
        return None  # without the recorded stride / padding / dilation the output shape is unknown
    pick = lambda v, j: v[j] if len(v) == nd else v[0]  # noqa: E731
    out = [(x[2 + j] + 2 * pick(pad, j) - pick(dil, j) * (w[2 + j] - 1) - 1) // pick(stride, j) + 1 for j in range(nd)]
    if min(out) <= 0:
        return None
    y = x[0] * w[0] * prod(out)
    return Work(_conv_flops(x, w, out), float(itemsize(dt) * (prod(x) + prod(w) + y)), 0.0, precision_of(dt))


def _conv_backward(ts: list[tuple[list[int], str]]) -> Work | None:
    if len(ts) < 3 or not len(ts[0][0]) == len(ts[1][0]) == len(ts[2][0]) >= 3:
        return None
    (gy, dt), (x, _), (w, _) = ts[0], ts[1], ts[2]
    nbytes = itemsize(dt) * (prod(gy) + 2 * prod(x) + 2 * prod(w))  # reads dy, x, w; writes dx, dw
    return Work(2.0 * _conv_flops(x, w, gy[2:]), float(nbytes), 0.0, precision_of(dt))


def op_work(name: str, args: dict) -> Work | None:
    """Figures of one CPU op from its recorded shapes, or None when it has none."""
    ts = _tensors(args)
    if not ts:
        return None
    if _GEMM.match(name):
        return _gemm(name, ts)
    if _CONV.match(name):
        return _conv(args, ts)
    if name == _CONV_BWD:
        return _conv_backward(ts)
    sizes = [prod(d) * itemsize(dt) for d, dt in ts]
    return Work(float(max(prod(d) for d, _ in ts)), float(sum(sizes) + max(sizes)), 0.0, precision_of(ts[0][1]))


def has_formula(name: str) -> bool:
    """Whether ``name`` is an op with its own formula (GEMM or convolution), looked for up the stack."""
    return bool(_GEMM.match(name) or _CONV.match(name)) or name == _CONV_BWD


def comm_work(kind: str | None, args: dict, world_size: int | None) -> Work | None:
    """Figures of a collective from ``Collective name`` style arguments, or None."""
    nin, nout = args.get("In msg nelems"), args.get("Out msg nelems")
    dt = dtype_name(args.get("dtype"))
    n = args.get("Group size", world_size)
    if kind not in _WIRE or dt is None or type(n) is not int or n < 1:
        return None
    elems = [v for v in (nin, nout) if type(v) is int and v >= 0]
    if not elems:
        return None
    size = float(max(elems) * itemsize(dt))
    wire = size * _WIRE[kind](n) if n > 1 else 0.0
    return Work(0.0, float(sum(elems) * itemsize(dt)), wire, precision_of(dt), "inter" if n > NODE_GPUS else "intra")


def copy_work(name: str, args: dict) -> Work | None:
    """Figures of a memcpy or memset from its ``bytes`` argument, or None."""
    n = args.get("bytes")
    if type(n) is not int or n < 0:
        return None
    upper = name.upper()
    if "HTOD" in upper or "DTOH" in upper or "HTOH" in upper:
        return Work(0.0, 0.0, float(n), "fp32", "host")
    if "PTOP" in upper:
        return Work(0.0, 0.0, float(n), "fp32", "intra")
    return Work(0.0, float(n if upper.startswith("MEMSET") else 2 * n), 0.0, "fp32")
