"""MXFP8 ops: matmuls against dequantise-then-matmul, grouped ops, registry entries, graphs on executors."""
import math

import pytest
import torch

from megaloom.ops.mxfp8 import (
    dequantize, mx_grouped_matmul, mx_matmul, padded_offsets, quantize, quantize_grouped,
)
from megaloom.ops.mxfp8.matmul import emulation_dtype
from megaloom.runtime import GraphError, ReferenceExecutor, TaskGraph, ThreadExecutor, get_op
from megaloom.runtime.registry import TensorSpec


def deq(q):
    return dequantize(q.data, q.scales, q.axis).double()


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_matmul_layouts_against_dequantised_reference(layout):
    m, k, n = 64, 96, 32
    a = torch.randn(k, m) if layout[0] == "T" else torch.randn(m, k)
    b = torch.randn(n, k) if layout[1] == "T" else torch.randn(k, n)
    qa = quantize(a, "cols" if layout[0] == "T" else "rows")
    qb = quantize(b, "rows" if layout[1] == "T" else "cols")
    ra = deq(qa).t() if layout[0] == "T" else deq(qa)
    rb = deq(qb).t() if layout[1] == "T" else deq(qb)
    y = mx_matmul(qa, qb, layout, torch.float32)
    assert y.shape == (m, n)
    torch.testing.assert_close(y.double(), ra @ rb, rtol=1e-5, atol=1e-4)
    assert mx_matmul(qa, qb, layout, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(GraphError, match="blocked by"):
        mx_matmul(qb, qa, "NT" if layout != "NT" else "TN")


def test_bf16_emulation_equals_float32_up_to_summation_order():
    a, b = torch.randn(64, 256), torch.randn(96, 256)
    qa, qb = quantize(a), quantize(b)
    assert emulation_dtype(qa, qb, torch.bfloat16) == torch.bfloat16
    assert emulation_dtype(qa, qb, torch.float32) == torch.float32
    fast = mx_matmul(qa, qb, "NT", torch.bfloat16)
    exact = mx_matmul(qa, qb, "NT", torch.float32)
    torch.testing.assert_close(fast.float(), exact, rtol=2 ** -7, atol=0)  # within one bf16 rounding
    a[:, 64:96] = 0  # zero blocks (code 0) dequantise exactly, in either axis
    assert emulation_dtype(quantize(a), qb, torch.bfloat16) == torch.bfloat16
    assert emulation_dtype(quantize(a[:32].t().contiguous(), "cols"), qb, torch.bfloat16) == torch.bfloat16
    a[0, :32] = 1e-37  # scale code 0 with non-zero data: not exact in bfloat16, so float32 is used
    qt = quantize(a)
    assert emulation_dtype(qt, qb, torch.bfloat16) == torch.float32
    assert torch.equal(mx_matmul(qt, qb, "NT", torch.bfloat16), mx_matmul(qt, qb, "NT", torch.float32).bfloat16())


OFFS = [40, 40, 72, 128]  # group sizes 40, 0 (empty), 32, 56


def test_grouped_quantize_blocks_never_cross_groups():
    x = torch.randn(128, 64)
    q = quantize_grouped(x, OFFS, "cols")
    assert padded_offsets(OFFS) == [64, 64, 96, 160] and q.data.shape == (160, 64)
    starts = [0, 40, 40, 72]
    pstarts = [0, 64, 64, 96]
    for s, e, p in zip(starts, OFFS, pstarts):
        n = e - s
        if not n:
            continue
        alone = quantize(torch.cat([x[s:e], torch.zeros(-n % 32, 64)]), "cols")
        rows = n + (-n % 32)
        assert torch.equal(q.data[p:p + rows].view(torch.uint8), alone.data.view(torch.uint8))
        assert torch.equal(q.scales[p // 32:(p + rows) // 32].view(torch.uint8), alone.scales.view(torch.uint8))
    assert torch.equal(quantize_grouped(x, OFFS, "rows").data.view(torch.uint8), quantize(x).data.view(torch.uint8))
    with pytest.raises(GraphError, match="non-decreasing"):
        quantize_grouped(x, [64, 32, 128])
    with pytest.raises(GraphError, match="128 rows"):
        quantize_grouped(x, [64, 100])


def test_grouped_matmul_all_layouts():
    t, k, n, g = 128, 64, 32, len(OFFS)
    x, w, dy = torch.randn(t, k), torch.randn(g, n, k), torch.randn(t, n)
    bounds = list(zip([0, *OFFS[:-1]], OFFS))
    qx, qw, qdy = quantize(x), quantize(w), quantize(dy)
    y = mx_grouped_matmul(qx, qw, OFFS, "NT")
    want = torch.cat([deq(qx)[s:e] @ deq(qw)[i].t() for i, (s, e) in enumerate(bounds)])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    qwc = quantize(w, "cols")
    dx = mx_grouped_matmul(qdy, qwc, OFFS, "NN")
    want = torch.cat([deq(qdy)[s:e] @ deq(qwc)[i] for i, (s, e) in enumerate(bounds)])
    torch.testing.assert_close(dx.double(), want, rtol=1e-5, atol=1e-4)
    gdy, gx = quantize_grouped(dy, OFFS), quantize_grouped(x, OFFS)
    dw = mx_grouped_matmul(gdy, gx, OFFS, "TN")
    assert dw.shape == (g, n, k) and (dw[1] == 0).all()  # the empty group has a zero gradient
    pb = list(zip([0, *padded_offsets(OFFS)[:-1]], padded_offsets(OFFS)))
    want = torch.stack([deq(gdy)[s:e].t() @ deq(gx)[s:e] for s, e in pb])
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-4)
    # the padding is all zeros, so grouped weight grads equal the unpadded products
    exact = torch.stack([dy[s:e].t().double() @ x[s:e].double() for s, e in bounds])
    assert (dw.double() - exact).abs().max() < 0.1 * exact.abs().max()


def run_both(g: TaskGraph, inputs: dict) -> tuple[dict, dict]:
    ref = ReferenceExecutor().run(g, inputs).outputs
    thr = ThreadExecutor({"vector": 2, "cube": 1}).run(g, inputs).outputs
    return ref, thr


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), name


def test_linear_graph_on_both_executors(tmp_path):
    """x, w -> quantise (vector) -> mx_matmul NT (cube) -> y; dy -> dual quantise -> NN and TN."""
    m, k, n = 64, 96, 32
    g = TaskGraph("mx_linear")
    x, w, dy = g.input("x", (m, k), "bfloat16"), g.input("w", (n, k), "bfloat16"), g.input("dy", (m, n), "bfloat16")
    y, dx, dw = g.output("y", (m, n), "bfloat16"), g.output("dx", (m, k), "bfloat16"), g.output("dw", (n, k))
    q = {name: (g.buffer(f"{name}_d", shape, "float8_e4m3fn"), g.buffer(f"{name}_s", sshape, "float8_e8m0fnu"))
         for name, shape, sshape in [("xr", (m, k), (m, k // 32)), ("xc", (m, k), (m // 32, k)),
                                     ("wr", (n, k), (n, k // 32)), ("wc", (n, k), (n // 32, k)),
                                     ("dyr", (m, n), (m, n // 32)), ("dyc", (m, n), (m // 32, n))]}
    g.task("mx_quantize_dual", [x], [*q["xr"], *q["xc"]])
    g.task("mx_quantize_dual", [w], [*q["wr"], *q["wc"]])
    g.task("mx_quantize_dual", [dy], [*q["dyr"], *q["dyc"]])
    g.task("mx_matmul", [*q["xr"], *q["wr"]], [y], attrs={"layout": "NT", "out_dtype": "bfloat16"})
    g.task("mx_matmul", [*q["dyr"], *q["wc"]], [dx], attrs={"layout": "NN", "out_dtype": "bfloat16"})
    g.task("mx_matmul", [*q["dyc"], *q["xc"]], [dw], attrs={"layout": "TN"})
    assert {t.engine for t in g.tasks} == {"vector", "cube"}
    inputs = {"x": torch.randn(m, k).bfloat16(), "w": torch.randn(n, k).bfloat16(), "dy": torch.randn(m, n).bfloat16()}
    ref, thr = run_both(g, inputs)
    assert_same(ref, thr)
    g.save(str(tmp_path / "mx.graph"))  # attrs and fp8 dtypes survive the file round trip
    assert_same(ref, ReferenceExecutor().run(TaskGraph.load(str(tmp_path / "mx.graph")), inputs).outputs)
    want = mx_matmul(quantize(inputs["x"]), quantize(inputs["w"]), "NT", torch.bfloat16)
    assert torch.equal(ref["y"], want)
    costs = g.costs()
    assert costs[3].precision == "mxfp8" and costs[3].flops == 2 * m * n * k
    assert costs[3].bytes == m * k + n * k + (m * k + n * k) // 32 + m * n * 2


def test_grouped_graph_and_dequantize_on_both_executors():
    t, k, n = 128, 64, 32
    g = TaskGraph("mx_grouped")
    x, w = g.input("x", (t, k)), g.input("w", (len(OFFS), n, k))
    xd, xs = g.buffer("xd", (t, k), "float8_e4m3fn"), g.buffer("xs", (t, k // 32), "float8_e8m0fnu")
    wd, ws = g.buffer("wd", (len(OFFS), n, k), "float8_e4m3fn"), g.buffer("ws", (len(OFFS), n, k // 32), "float8_e8m0fnu")
    gd, gs = g.output("gd", (160, k), "float8_e4m3fn"), g.output("gs", (5, k), "float8_e8m0fnu")
    y, xback = g.output("y", (t, n)), g.output("xback", (t, k), "bfloat16")
    g.task("mx_quantize", [x], [xd, xs], attrs={"axis": "rows", "scale_mode": "rceil"})
    g.task("mx_quantize", [w], [wd, ws], attrs={"axis": "rows", "scale_mode": "rceil"})
    g.task("mx_quantize_grouped", [x], [gd, gs], attrs={"group_offsets": OFFS})
    g.task("mx_grouped_matmul", [xd, xs, wd, ws], [y], attrs={"group_offsets": OFFS, "layout": "NT"})
    g.task("mx_dequantize", [xd, xs], [xback], attrs={"axis": "rows", "out_dtype": "bfloat16"})
    inputs = {"x": torch.randn(t, k), "w": torch.randn(len(OFFS), n, k)}
    ref, thr = run_both(g, inputs)
    assert_same(ref, thr)
    assert torch.equal(ref["xback"], dequantize(*quantize(inputs["x"], "rows", "rceil")[:2]).bfloat16())
    assert torch.equal(ref["gd"].view(torch.uint8), quantize_grouped(inputs["x"], OFFS).data.view(torch.uint8))


def test_shape_rules_reject_bad_operands():
    spec = TensorSpec
    with pytest.raises(GraphError, match="multiple of 32"):
        get_op("mx_quantize").shape([spec((64, 40), "float32")], {"axis": "rows"})
    with pytest.raises(GraphError, match="quantises"):
        get_op("mx_quantize").shape([spec((64, 64), "int32")], {})
    good = [spec((64, 64), "float8_e4m3fn"), spec((64, 2), "float8_e8m0fnu")]
    with pytest.raises(GraphError, match="layout"):
        get_op("mx_matmul").shape(good + good, {"layout": "TT"})
    with pytest.raises(GraphError, match="blocked by cols"):
        get_op("mx_matmul").shape(good + good, {"layout": "NN"})
    with pytest.raises(GraphError, match="inner dims"):
        get_op("mx_matmul").shape(good + [spec((32, 96), "float8_e4m3fn"), spec((32, 3), "float8_e8m0fnu")], {})
    g = TaskGraph("bad")
    a = g.input("a", (64, 64))
    d, s = g.buffer("d", (64, 64), "float8_e4m3fn"), g.buffer("s", (2, 64), "float8_e8m0fnu")
    g.task("mx_quantize", [a], [d, s], name="q", attrs={"axis": "rows"})
    with pytest.raises(GraphError, match="'q'"):
        g.validate()


def test_every_mx_op_has_positive_finite_cost():
    ins = {"mx_quantize": [TensorSpec((64, 64), "bfloat16")],
           "mx_quantize_dual": [TensorSpec((64, 64), "bfloat16")],
           "mx_quantize_grouped": [TensorSpec((128, 64), "bfloat16")],
           "mx_dequantize": [TensorSpec((64, 64), "float8_e4m3fn"), TensorSpec((64, 2), "float8_e8m0fnu")],
           "mx_matmul": [TensorSpec((64, 64), "float8_e4m3fn"), TensorSpec((64, 2), "float8_e8m0fnu")] * 2,
           "mx_grouped_matmul": [TensorSpec((128, 64), "float8_e4m3fn"), TensorSpec((128, 2), "float8_e8m0fnu"),
                                 TensorSpec((4, 32, 64), "float8_e4m3fn"), TensorSpec((4, 32, 2), "float8_e8m0fnu")]}
    attrs = {"mx_quantize_grouped": {"group_offsets": OFFS}, "mx_grouped_matmul": {"group_offsets": OFFS}}
    for name, specs in ins.items():
        op = get_op(name)
        outs = op.shape(specs, attrs.get(name, {}))
        c = op.cost(specs, outs, attrs.get(name, {}))
        assert math.isfinite(c.flops) and c.flops > 0 and c.bytes > 0, name
        assert (c.precision == "mxfp8") == (op.engine == "cube"), name
        assert op.engine == ("cube" if "matmul" in name else "vector")


def unblock(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of cuBLAS's block-scale layout, from its documented index formula:
    scale (r, c) lives at tile (r // 128, c // 4), inside it at (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4."""
    n_col_tiles = -(-cols // 4)
    out = torch.empty(rows, cols, dtype=torch.uint8)
    flat = flat.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * n_col_tiles + c // 4
            out[r, c] = flat[tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4]
    return out.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_native_path_hands_scaled_mm_canonical_operands(layout, monkeypatch):
    """The sm100 path, run on CPU against a fake ``torch._scaled_mm`` that decodes what it is given."""
    m, k, n = 160, 96, 64
    a = torch.randn(k, m) if layout[0] == "T" else torch.randn(m, k)
    b = torch.randn(k, n) if layout[1] == "N" else torch.randn(n, k)
    qa = quantize(a, "cols" if layout[0] == "T" else "rows")
    qb = quantize(b, "cols" if layout[1] == "N" else "rows")

    def fake_scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype):
        assert a_data.is_contiguous() and b_data.t().is_contiguous()  # row-major A (M,K), column-major B (K,N)
        x = dequantize(a_data, unblock(scale_a, a_data.shape[0], a_data.shape[1] // 32))
        y = dequantize(b_data.t(), unblock(scale_b, b_data.shape[1], b_data.shape[0] // 32))
        return (x @ y.t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm, raising=False)
    got = mx_matmul(qa, qb, layout, torch.float32, native=True)
    torch.testing.assert_close(got, mx_matmul(qa, qb, layout, torch.float32, native=False), rtol=1e-6, atol=1e-5)
