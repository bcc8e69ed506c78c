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

_DTYPE = {"float": "float32", "double": "float64", "half": "float16", "long int": "int64", "long": "int64",
          "int": "int32", "signed char": "int8", "char": "int8", "unsigned char": "uint8", "byte": "uint8",
          **{n: n for n in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "bool")}}
_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|linear|matmul)$")
_GROUPED = "aten::_grouped_mm"
_SDPA = re.compile(r"^aten::_?(?:scaled_dot_product|_scaled_dot_product)\w*attention\w*$")
_CONV = re.compile(r"^aten::(_?convolution|conv[123]d)$")
_CONV_BWD = "aten::convolution_backward"
WIRE = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0}
"""Bytes each rank puts on the wire per byte of message, by collective, in a group of ``n`` (ring algorithms)."""
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
    return _DTYPE.get(t.lower().removeprefix("c10::")) if isinstance(t, str) else None


def _tensors(args: dict) -> list[tuple[list[int], str]]:
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list):
        return []
    types = [dtype_name(t) for t in types] if isinstance(types, list) else []
    types += ["float32"] * (len(dims) - len(types))
    return [(d, dt) for d, dt in zip(dims, types)
            if dt and isinstance(d, list) and d and all(type(v) is int and v >= 0 for v in d)]


def _concrete(args: dict, i: int) -> list[int] | None:
    """Recorded input ``i`` when it is a list of integers (``"[1, 1]"``), else None."""
    vals = args.get("Concrete Inputs")
    v = vals[i] if isinstance(vals, list) and i < len(vals) else None
    listed = isinstance(v, str) and v.strip().startswith("[")
    return ([int(x) for x in re.findall(r"-?\d+", v)] or None) if listed else None


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
    if not all(v is not None and len(v) in (1, nd) for v in (stride, pad, dil)):
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


def _attention(name: str, ts: list[tuple[list[int], str]]) -> Work | None:
    """Scaled dot-product attention: ``4*b*h*sq*sk*d`` flops forward, 2.5 times that backward
    (five matrix products instead of two); the tensors read and written once."""
    if "backward" in name:
        ts = ts[1:]  # the output's gradient comes first
    if len(ts) < 3 or not len(ts[0][0]) == len(ts[1][0]) >= 3:
        return None
    (q, dt), (k, _) = ts[0], ts[1]
    flops = 4.0 * prod(q) * k[-2] * (2.5 if "backward" in name else 1.0)
    return Work(flops, float(itemsize(dt) * sum(prod(d) for d, _ in ts[:3]) * 2), 0.0, precision_of(dt))


def op_work(name: str, args: dict) -> Work | None:
    """Figures of one CPU op from its recorded shapes, or None when it has none."""
    if not (ts := _tensors(args)):
        return None
    if _GEMM.match(name):
        return _gemm(name, ts)
    if name == _GROUPED and len(ts) >= 2:  # [m, k] x [g, k, n], [g, m, k] x [g, k, n] or [k, m] x [m, n]
        (a, dt), (b, _) = ts[0], ts[1]
        out = prod(a) // a[-1] * b[-1] * (b[0] if len(a) == len(b) == 2 else 1)
        return Work(2.0 * prod(a) * b[-1], float(itemsize(dt) * (prod(a) + prod(b) + out)), 0.0, precision_of(dt))
    if _SDPA.match(name):
        return _attention(name, ts)
    if _CONV.match(name):
        return _conv(args, ts)
    if name == _CONV_BWD:
        return _conv_backward(ts)
    sizes = [prod(d) * itemsize(dt) for d, dt in ts]
    return Work(float(max(prod(d) for d, _ in ts)), float(sum(sizes) + max(sizes)), 0.0, precision_of(ts[0][1]))


def has_formula(name: str) -> bool:
    """Whether ``name`` is an op with its own formula (GEMM, convolution, attention), looked for up the stack."""
    return bool(_GEMM.match(name) or _CONV.match(name) or _SDPA.match(name)) or name in (_CONV_BWD, _GROUPED)


def total(works: list[Work | None]) -> Work | None:
    """The sum of several ops' figures (at the first one's precision), or None when none has any."""
    ws = [w for w in works if w is not None]
    return Work(sum(w.flops for w in ws), sum(w.bytes for w in ws), sum(w.comm_bytes for w in ws), ws[0].precision,
                ws[0].link) if ws else None


def sources_work(sources: list, dims: dict[int, int] | None = None) -> Work | None:
    """The summed figures of a task's ``sources`` tag (``[name, Input Dims, Input type, Concrete
    Inputs]`` per op), with each tensor dimension renamed by ``dims``."""
    def swap(d):
        return [swap(x) for x in d] if isinstance(d, list) else dims.get(d, d) if dims else d

    return total([op_work(n, {"Input Dims": swap(d), "Input type": t, "Concrete Inputs": c}) for n, d, t, c in sources])


def reshape(sources: list, dims: dict[int, int]) -> tuple[float, float] | None:
    """Flops and bytes factors of a task whose ops' dimensions are renamed by ``dims``."""
    a, b = sources_work(sources), sources_work(sources, dims)
    if a is None or b is None:
        return None
    return (b.flops / a.flops if a.flops else 1.0), (b.bytes / a.bytes if a.bytes else 1.0)


def source(s_name: str, args: dict) -> list:
    """The ``sources`` entry of one op: what :func:`sources_work` needs to recompute its figures."""
    return [s_name, args.get("Input Dims"), args.get("Input type"), args.get("Concrete Inputs")]


def comm_work(kind: str | None, args: dict, world_size: int | None) -> Work | None:
    """Figures of a collective from ``Collective name`` style arguments, or None."""
    elems = [v for v in (args.get("In msg nelems"), args.get("Out msg nelems")) if type(v) is int and v >= 0]
    dt, n = dtype_name(args.get("dtype")), args.get("Group size", world_size)
    if kind not in WIRE or dt is None or type(n) is not int or n < 1 or not elems:
        return None
    wire = float(max(elems) * itemsize(dt)) * WIRE[kind](n) if n > 1 else 0.0  # of the largest message
    return Work(0.0, float(sum(elems) * itemsize(dt)), wire, precision_of(dt), "inter" if n > NODE_GPUS else "intra")


def tensor_bytes(args: dict) -> float:
    """Bytes of an op's first tensor input (a gradient, for ``AccumulateGrad``), or 0."""
    ts = _tensors(args)
    return float(prod(ts[0][0]) * itemsize(ts[0][1])) if ts else 0.0


def backend_work(kind: str, args: dict, world_size: int | None) -> Work | None:
    """Figures of a backend's own collective annotation (``gloo:all_reduce``) from its tensor's shape."""
    if not (ts := _tensors(args)):
        return None
    n = prod(ts[0][0])
    return comm_work("send_recv" if kind in ("send", "recv") else kind,
                     {"In msg nelems": n, "Out msg nelems": n, "dtype": ts[0][1]}, world_size)


def copy_work(name: str, args: dict) -> Work | None:
    """Figures of a memcpy or memset from its ``bytes`` argument, or None."""
    if type(n := args.get("bytes")) is not int or n < 0:
        return None
    upper = name.upper()
    if any(k in upper for k in ("HTOD", "DTOH", "HTOH")):
        return Work(0.0, 0.0, float(n), "fp32", "host")
    if "PTOP" in upper:
        return Work(0.0, 0.0, float(n), "fp32", "intra")
    return Work(0.0, float(n if upper.startswith("MEMSET") else 2 * n), 0.0, "fp32")
