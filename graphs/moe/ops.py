"""MoE tile ops: row gather, grouped-GEMM tiles, SwiGLU and its gradient, top-k sums.

| op                | engine | what it computes                                                    |
|-------------------|--------|---------------------------------------------------------------------|
| moe_gather        | vector | ``src[idx]`` (times ``scale[:, None]`` when given): permute rows    |
| moe_gmm           | cube   | ``x @ w`` (``w`` one expert's ``[1, k, n]`` slice; ``trans_w``)       |
| moe_wgrad         | cube   | ``a^T @ b`` into one expert's ``[1, k, n]`` weight-gradient slice     |
| swiglu            | vector | ``silu(g) * u`` with ``[g | u]`` the two halves of the last dim     |
| swiglu_grad       | vector | ``[dg | du]`` of :func:`swiglu` given the upstream gradient         |
| moe_unpermute_sum | vector | ``sum_k w[t, k] * rows[pos[t, k]]`` (``w`` optional: plain sum)      |
| moe_topk_grad     | vector | ``dw[t, k] = <dout[t], rows[pos[t, k]]>``: gradient of top-k weights |
| moe_dyn           | any    | op ``attrs["op"]`` on the live rows of a tile or expert block (plan row) |
| moe_exchange      | comm   | an all-to-all round of an expert, split sizes from a plan row         |

Index operands (``idx``, ``pos``) are int64 regions of graph buffers, so one graph
serves every routing with the same per-expert counts. With ``fuse_vector`` the graphs run
SwiGLU and its gradient as ``dvm.fused`` tiles instead (:func:`swiglu_program`) over the
gate and up halves of ``gu``; ``swiglu`` / ``swiglu_grad`` stay the unfused path and oracle.
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from megaloom.comm.ops import communicator
from megaloom.graphs.common.ops import io_bytes
from megaloom.ops import dvm
from megaloom.ops.basic import precision
from megaloom.ops.mxfp8.format import BLOCK
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import (
    COMM, CUBE, VECTOR, Cost, GradOf, OpDef, TensorSpec, get_op, register, run_reference,
)
from megaloom.scheduler.cost import DURATION_ATTR


def _expect(cond: bool, op: str, msg: str, ins: list[TensorSpec]) -> None:
    if not cond:
        raise GraphError(f"{op}: {msg}; operands {[(s.shape, s.dtype) for s in ins]}")


def _matrix(w: torch.Tensor, trans: bool = False) -> torch.Tensor:
    """One expert's weight slice ``[1, k, n]`` (or a plain ``[k, n]``) as a matrix (transposed with ``trans``)."""
    m = w[0] if w.dim() == 3 else w
    return m.t() if trans else m


# -- moe_gather ----------------------------------------------------------------------
def _gather_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) in (2, 3) and len(ins[0].shape) == 2 and len(ins[1].shape) == 1 and ins[1].dtype == "int64",
            "moe_gather", "takes src [N, H], idx [n] int64 and an optional scale [n, 1]", ins)
    n = ins[1].shape[0]
    if len(ins) == 3:
        _expect(ins[2].shape == (n, 1) and ins[2].dtype == ins[0].dtype, "moe_gather",
                "scale must be [n, 1] of the source dtype", ins)
    return [TensorSpec((n, ins[0].shape[1]), ins[0].dtype)]


def _gather_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    o = outs[0]
    return Cost(flops=o.numel if len(ins) == 3 else 0.0, bytes=2.0 * o.nbytes + ins[1].nbytes,
                precision=precision(o.dtype))


def _gather_ref(src: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    return src[idx] if scale is None else src[idx] * scale


def _gather_kernel(ins, outs) -> None:
    torch.index_select(ins[0], 0, ins[1], out=outs[0])
    if len(ins) == 3:
        outs[0].mul_(ins[2])


# -- moe_gmm / moe_wgrad -------------------------------------------------------------
def _gmm_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) == 2 and len(ins[0].shape) == 2 and len(ins[1].shape) in (2, 3)
            and (len(ins[1].shape) == 2 or ins[1].shape[0] == 1), "moe_gmm",
            "takes x [m, k] and one expert's weight [1, k, n] or [k, n]", ins)
    k, n = ins[1].shape[-2:]
    if attrs.get("trans_w"):
        k, n = n, k
    _expect(ins[0].shape[1] == k, "moe_gmm", f"inner dims differ (trans_w={bool(attrs.get('trans_w'))})", ins)
    _expect(ins[0].dtype == ins[1].dtype, "moe_gmm", "operand dtypes differ", ins)
    return [TensorSpec((ins[0].shape[0], n), ins[0].dtype)]


def _gmm_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    """``2 m k n`` of a GEMM tile or (``moe_wgrad``, ``k`` and ``m`` swapped) a weight-gradient tile."""
    m, k = ins[0].shape
    return Cost(flops=2.0 * m * k * outs[0].shape[-1], bytes=io_bytes(ins, outs), precision=precision(ins[0].dtype))


def _gmm_ref(x: torch.Tensor, w: torch.Tensor, trans_w: bool = False) -> torch.Tensor:
    return x @ _matrix(w, trans_w)


def _gmm_kernel(ins, outs, trans_w: bool = False) -> None:
    torch.mm(ins[0], _matrix(ins[1], trans_w), out=outs[0])


def _wgrad_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) == 2 and len(ins[0].shape) == 2 and len(ins[1].shape) == 2
            and ins[0].shape[0] == ins[1].shape[0] and ins[0].dtype == ins[1].dtype, "moe_wgrad",
            "takes a [m, k] and b [m, n] of one dtype", ins)
    return [TensorSpec((1, ins[0].shape[1], ins[1].shape[1]), ins[0].dtype)]


def _wgrad_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.t() @ b)[None]


def _wgrad_kernel(ins, outs) -> None:
    torch.mm(ins[0].t(), ins[1], out=outs[0][0])


# -- swiglu --------------------------------------------------------------------------
def _halves(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    i = gu.shape[-1] // 2
    return gu[..., :i], gu[..., i:]


def _swiglu_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) == 1 and len(ins[0].shape) == 2 and ins[0].shape[1] % 2 == 0, "swiglu",
            "takes gate_up [m, 2I]", ins)
    return [TensorSpec((ins[0].shape[0], ins[0].shape[1] // 2), ins[0].dtype)]


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gu = [gate | up]`` along the last dim."""
    g, u = _halves(gu)
    return F.silu(g) * u


def _swiglu_kernel(ins, outs) -> None:
    g, u = _halves(ins[0])
    torch.mul(F.silu(g), u, out=outs[0])


def _chain_cost(ins: list[TensorSpec], flops_per: float, passes: int) -> Cost:
    """An unfused SwiGLU tile: each torch call of its kernel reads its operands from memory and writes its
    result, ``passes`` ``[m, I]`` tensors in all (forward: silu 2, mul 3; gradient: its nine calls, 24)."""
    half = ins[0].numel // 2
    return Cost(flops=flops_per * half, bytes=float(passes * ins[0].nbytes // 2), precision=precision(ins[0].dtype))


def swiglu_program(rows: int, inter: int, dtype: str, backward: bool = False) -> dict:
    """``dvm.fused`` attrs of a SwiGLU tile of ``rows x inter``: forward ``(gate, up) -> a``,
    backward ``(da, gate, up) -> (dgate, dup)`` (:mod:`megaloom.ops.dvm.library`)."""
    make = dvm.library.swiglu_backward if backward else dvm.library.swiglu
    return {"program": make((rows, inter), dtype).to_attrs()}


def _swiglu_grad_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) == 2 and len(ins[0].shape) == 2 and ins[1].shape == (ins[0].shape[0], ins[0].shape[1] // 2)
            and ins[0].dtype == ins[1].dtype, "swiglu_grad", "takes gate_up [m, 2I] and grad [m, I]", ins)
    return [ins[0]]


def swiglu_grad(gu: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` w.r.t. ``gu`` given ``da``, as ``[dgate | dup]``."""
    g, u = _halves(gu)
    s = torch.sigmoid(g)
    silu = g * s
    return torch.cat([da * u * (s * (1 + g * (1 - s))), da * silu], dim=-1)


def _swiglu_grad_kernel(ins, outs) -> None:
    gu, da = ins
    g, u = _halves(gu)
    dg, du = _halves(outs[0])
    s = torch.sigmoid(g)
    torch.mul(da, g * s, out=du)
    torch.mul(da * u, s * (1 + g * (1 - s)), out=dg)


# -- top-k sums ----------------------------------------------------------------------
def _unpermute_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) in (2, 3) and len(ins[0].shape) == 2 and len(ins[1].shape) == 2 and ins[1].dtype == "int64",
            "moe_unpermute_sum", "takes rows [S, H], pos [t, k] int64 and optional weights [t, k]", ins)
    if len(ins) == 3:
        _expect(ins[2].shape == ins[1].shape and ins[2].dtype == ins[0].dtype, "moe_unpermute_sum",
                "weights must be [t, k] of the rows' dtype", ins)
    return [TensorSpec((ins[1].shape[0], ins[0].shape[1]), ins[0].dtype)]


def _topk_cost(rows: TensorSpec, pos: TensorSpec, other: TensorSpec) -> Cost:
    """2 t k H flops; reads t k gathered rows, ``pos`` and ``other`` (the output or dout)."""
    (t, k), h = pos.shape, rows.shape[1]
    return Cost(flops=2.0 * t * k * h, bytes=float(t * k * h * TensorSpec((1,), rows.dtype).nbytes
                                                    + pos.nbytes + other.nbytes), precision=precision(rows.dtype))


def moe_unpermute_sum(rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * rows[pos[t, k]]`` (weights 1 when ``w`` is None)."""
    t, k = pos.shape
    g = rows.index_select(0, pos.reshape(-1)).view(t, k, rows.shape[1])
    return (g if w is None else g * w[..., None]).sum(1)


def _topk_grad_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _expect(len(ins) == 3 and len(ins[0].shape) == 2 and len(ins[2].shape) == 2 and ins[2].dtype == "int64"
            and ins[0].shape[0] == ins[2].shape[0] and ins[0].shape[1] == ins[1].shape[1], "moe_topk_grad",
            "takes dout [t, H], rows [S, H] and pos [t, k] int64", ins)
    return [TensorSpec(ins[2].shape, ins[0].dtype)]


def moe_topk_grad(dout: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``dw[t, k] = <dout[t], rows[pos[t, k]]>``."""
    t, k = pos.shape
    g = rows.index_select(0, pos.reshape(-1)).view(t, k, rows.shape[1])
    return (g * dout[:, None, :]).sum(-1)


register(OpDef("moe_gather", (VECTOR, COMM), _gather_ref, _gather_shape, _gather_cost, _gather_kernel,
               doc="rows of src picked by idx (times scale): MoE permute / dispatch packing"))
register(OpDef("moe_gmm", (CUBE,), _gmm_ref, _gmm_shape, _gmm_cost, _gmm_kernel,
               doc="one grouped-GEMM tile: x @ w[e] (w[e]^T when trans_w)"))
register(OpDef("moe_wgrad", (CUBE,), _wgrad_ref, _wgrad_shape, _gmm_cost, _wgrad_kernel,
               doc="expert weight-gradient tile: a^T @ b into [1, k, n]"))
register(OpDef("swiglu", (VECTOR,), swiglu, _swiglu_shape, lambda i, o, a: _chain_cost(i, 5.0, 5),
               _swiglu_kernel, doc="silu(gate) * up"))
register(OpDef("swiglu_grad", (VECTOR,), swiglu_grad, _swiglu_grad_shape, lambda i, o, a: _chain_cost(i, 12.0, 24),
               _swiglu_grad_kernel, doc="[dgate | dup] of swiglu", grad_of=GradOf("swiglu", "x0 dy0", "dx0")))
register(OpDef("moe_unpermute_sum", (VECTOR,), moe_unpermute_sum, _unpermute_shape,
               lambda i, o, a: _topk_cost(i[0], i[1], o[0]),
               lambda ins, outs: outs[0].copy_(moe_unpermute_sum(*ins)),
               doc="weighted sum over the top-k expert outputs of each token"))
register(OpDef("moe_topk_grad", (VECTOR,), moe_topk_grad, _topk_grad_shape,
               lambda i, o, a: _topk_cost(i[1], i[2], i[0]),
               lambda ins, outs: outs[0].copy_(moe_topk_grad(*ins)), doc="gradient of the top-k weights",
               grad_of=GradOf("moe_unpermute_sum", "dy0 x0 x1", "dx2")))


# -- dynamic tiles (graphs built once per spec: the routing arrives as int64 plan rows) -----------
# ``moe_dyn`` runs op ``op`` on the live rows of its regions. Its inputs: the plan row, the inner op's
# inputs, then (``rmw``) the old contents of its outputs, which it writes only in part. ``codes``:
# ``t`` (a tile: plan row (expert, rows, 0)), ``b`` (an expert's block: (first row, rows, end), rows
# relative to ``base``) or ``g`` (grouped: every expert's block row; the op runs once per expert with
# rows), then the :class:`Cut` of each inner input, ``|``, of each output.
_OWN = ("op", "codes", "base", "sim", "rmw", DURATION_ATTR)  # moe_dyn's own attrs; the rest are the op's


class Cut(str, Enum):
    """How a ``moe_dyn`` task cuts one operand to its live rows (in attrs: the one-letter value)."""

    ROWS = "r"  # the live rows
    PADDED = "p"  # the live rows padded to 32
    SCALES = "s"  # the 32-row scale blocks of the padded rows
    EXPERT = "e"  # the live expert's slice of a per-expert stack (an output: zeroed for an expert without rows)
    WHOLE = "-"  # as is


def _live(meta: torch.Tensor, kind: str, base: int) -> list[tuple[int, int, int]]:
    """(first row, rows, expert) of each part of a task, from its plan rows: the one of a tile or block,
    or (``g``) one per expert."""
    rows = meta.reshape(-1, 3).tolist()
    if kind == "g":
        return [(s, n, e) for e, (s, n, _) in enumerate(rows)]
    a, b, _ = rows[0]
    return [(0, b, a) if kind == "t" else (a - base, b, 0)]


def _narrow(x, code: str, s: int, n: int, e: int):
    """Operand ``x`` (a tensor or TensorSpec) cut by ``code`` (a :class:`Cut` value) for ``n`` live rows from
    row ``s`` of expert ``e``."""
    if code == Cut.ROWS:
        lo, hi = s, s + n
    elif code == Cut.PADDED:
        lo, hi = s, s + -(-n // BLOCK) * BLOCK
    elif code == Cut.SCALES:
        lo, hi = s // BLOCK, (s + -(-n // BLOCK) * BLOCK) // BLOCK
    elif code == Cut.EXPERT:
        lo, hi = (e, e + 1) if x.shape[0] > 1 else (0, 1)
    else:
        return x
    if isinstance(x, TensorSpec):
        return TensorSpec((hi - lo, *x.shape[1:]), x.dtype)
    return x[lo:hi]


def _split(attrs: dict) -> tuple[str, str, str, dict, list, list]:
    """(kind, input codes, output codes, the inner op's attrs, and the (index, code) of each input and of each
    output that the live rows cut) of a moe_dyn task."""
    kind, (cin, cout) = attrs["codes"][0], attrs["codes"][1:].split("|")
    cuts = [[(j, c) for j, c in enumerate(codes) if c != Cut.WHOLE] for codes in (cin, cout)]
    return kind, cin, cout, {k: v for k, v in attrs.items() if k not in _OWN}, *cuts


def _dyn_parts(ins, outs, split: tuple, n: int, s: int = 0, e: int = 0):
    """The inner op's inputs, outputs and attrs for ``n`` live rows (``ins``: the task's; ``split``: :func:`_split`)."""
    _, cin, _, inner, cut_in, cut_out = split
    i, o = list(ins[1:1 + len(cin)]), list(outs)  # only the operands the live rows cut are narrowed
    for lst, cuts in ((i, cut_in), (o, cut_out)):
        for j, c in cuts:
            lst[j] = _narrow(lst[j], c, s, n, e)
    return i, o, {**inner, "group_offsets": [n]} if "group_offsets" in inner else inner


def _dyn_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _, cin, cout, inner, _, _ = _split(attrs)
    rmw, experts = attrs.get("rmw", False), ins[0].numel // 3
    _expect(ins[0].dtype == "int64" and ins[0].numel == 3 * experts > 0 and len(ins) == 1 + len(cin) + rmw * len(cout),
            "moe_dyn", f"takes plan rows (3 int64 each), the operands of {attrs['op']!r} coded {attrs['codes']!r}"
            + (" and its outputs" if rmw else ""), ins)
    outs = get_op(attrs["op"]).shape([_narrow(x, c, 0, 0, 0) if c == Cut.EXPERT else x
                                      for x, c in zip(ins[1:1 + len(cin)], cin)], inner)
    outs = [TensorSpec((experts, *o.shape[1:]), o.dtype) if c == Cut.EXPERT else o for o, c in zip(outs, cout)]
    _expect(len(outs) == len(cout) and (not rmw or list(ins[1 + len(cin):]) == outs), "moe_dyn",
            f"codes {attrs['codes']!r} do not fit op {attrs['op']!r}", ins)
    return outs


def _dyn_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    n = attrs.get("sim", 0)
    if not n:
        return Cost(precision=precision(outs[0].dtype))
    i, o, a = _dyn_parts(ins, outs, _split(attrs), n)
    return get_op(attrs["op"]).cost(i, o, a)


def _dyn_bind(attrs: dict):
    """The kernel ``fn(ins, outs)`` of one moe_dyn task: its codes, inner op and the operands it cuts read
    once, when the dispatch plan is built; each run reads the plan row and narrows those to the live rows."""
    split = _split(attrs)
    kind, cout = split[0], split[2]
    d, base = get_op(attrs["op"]), attrs.get("base", 0)
    zeroed = [j for j, c in enumerate(cout) if c == Cut.EXPERT]

    def run(ins, outs) -> None:
        for s, n, e in _live(ins[0], kind, base):
            if not n:
                for j in zeroed:
                    _narrow(outs[j], Cut.EXPERT, s, n, e).zero_()
                continue
            i, o, a = _dyn_parts(ins, outs, split, n, s, e)
            if d.kernel is not None:
                d.kernel(i, o, **a)
            else:
                for out, r in zip(o, run_reference(d, i, a)):
                    out.copy_(r)
    return run


def _dyn_ref(*ins, **attrs):
    """The task's outputs: live rows by the inner op's reference, other rows as they were (``rmw``) or zeros."""
    split = _split(attrs)
    kind, cin = split[:2]
    specs = _dyn_shape([TensorSpec(tuple(x.shape), dtype_name(x.dtype)) for x in ins], attrs)
    old = ins[1 + len(cin):]
    full = [x.clone() for x in old] or [torch.zeros(sp.shape, dtype=torch_dtype(sp.dtype)) for sp in specs]
    for s, n, e in (part for part in _live(ins[0], kind, attrs.get("base", 0)) if part[1]):  # parts with rows
        i, o, a = _dyn_parts(ins, full, split, n, s, e)
        for out, r in zip(o, run_reference(get_op(attrs["op"]), i, a)):
            out.copy_(r)
    return tuple(full)


# -- moe_exchange: one all-to-all round (round 0: the own rows, a local copy) of a dynamic graph ---
def _exchange_rows(row: torch.Tensor, chunk: int, tile: int) -> tuple[int, int, int, int] | None:
    """(src from, src to, dst from, dst to) of chunk ``chunk`` (``tile`` rows; 0: all) of a plan row, or
    None when no rank moves rows in it (every rank skips it alike)."""
    s0, sn, d0, dn, most = row.reshape(-1).tolist()
    lo = chunk * tile
    hi = lo + tile if tile else most
    if lo >= most:
        return None
    return s0 + min(lo, sn), s0 + min(hi, sn), d0 + min(lo, dn), d0 + min(hi, dn)


def _exchange_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    """The destination: the old rows (3rd input) or, for the first task writing it, ``rows`` rows."""
    _expect(len(ins) in (2, 3) and ins[0].dtype == "int64" and ins[0].numel == 5 and ins[1].dtype == ins[-1].dtype
            and ins[1].shape[1:] == ins[-1].shape[1:] and (len(ins) == 3 or "rows" in attrs), "moe_exchange",
            "takes a plan row (5 int64), the source rows and the old destination rows (or attr rows)", ins)
    return [ins[2] if len(ins) == 3 else TensorSpec((attrs["rows"], *ins[1].shape[1:]), ins[1].dtype)]


def _exchange_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    row = outs[0].nbytes / max(1, outs[0].shape[0])
    moved = row * attrs.get("sim", 0)
    return Cost(bytes=2.0 * moved, comm_bytes=0.0 if attrs["to"] < 0 else moved,
                precision=precision(outs[0].dtype))


def _exchange_into(src: torch.Tensor, dst: torch.Tensor, row: torch.Tensor, attrs: dict, ctx) -> None:
    at = _exchange_rows(row, attrs.get("chunk", 0), attrs.get("tile", 0))
    if at is None:
        return
    a, b, c, d = at
    if attrs["to"] < 0:  # the own rows
        dst[c:d].copy_(src[a:b])
        return
    send, recv = [0] * attrs["world"], [0] * attrs["world"]
    send[attrs["to"]], recv[attrs["frm"]] = b - a, d - c
    communicator(ctx).all_to_all(dst[c:d], src[a:b], send, recv)


def _exchange_ref(row, src, old=None, ctx=None, **attrs):
    out = old.clone() if old is not None else src.new_zeros((attrs["rows"], *src.shape[1:]))
    _exchange_into(src, out, row, attrs, ctx)
    return out


register(OpDef("moe_dyn", (CUBE, VECTOR), _dyn_ref, _dyn_shape, _dyn_cost,
               lambda ins, outs, **attrs: _dyn_bind(attrs)(ins, outs),
               extra={"in_place": True, "bind": _dyn_bind},
               doc="op attrs['op'] on the live rows of a tile or expert block, read from a plan row"))
register(OpDef("moe_exchange", (COMM, VECTOR), _exchange_ref, _exchange_shape, _exchange_cost,
               lambda ins, outs, ctx=None, **attrs: _exchange_into(ins[1], outs[0], ins[0], attrs, ctx),
               context=True, extra={"in_place": True},
               doc="one all-to-all round (chunk) of an expert with run-time split sizes; own rows: a copy"))
