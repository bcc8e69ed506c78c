"""Ready-made programs against torch autograd, as graph nodes on both executors."""
import pytest
import torch
import torch.nn.functional as F

from megaloom.ops import dvm
from megaloom.runtime import ReferenceExecutor, TaskGraph, ThreadExecutor


def run(prog, *xs):
    outs = [torch.empty(s, dtype=getattr(torch, d)) for s, d in prog.out_specs()]
    dvm.compile_program(prog)(list(xs), outs)
    return outs


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("bfloat16", 2e-2)])
def test_swiglu_forward_and_backward_match_autograd(dtype, tol):
    g = torch.Generator().manual_seed(0)
    gate, up, dh = (torch.randn(64, 96, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    gg, uu = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = F.silu(gg) * uu
    h.backward(dh)
    t = getattr(torch, dtype)
    (got_h,) = run(dvm.library.swiglu((64, 96), dtype), gate.to(t), up.to(t))
    dgate, dup = run(dvm.library.swiglu_backward((64, 96), dtype), dh.to(t), gate.to(t), up.to(t))
    for got, want in ((got_h, h.detach()), (dgate, gg.grad), (dup, uu.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    (s,) = run(dvm.library.silu((64, 96), dtype), gate.to(t))
    torch.testing.assert_close(s.double(), F.silu(gate), rtol=tol, atol=tol)
    (y,) = run(dvm.library.gelu_tanh((64, 96), dtype), gate.to(t))
    torch.testing.assert_close(y.double(), F.gelu(gate, approximate="tanh"), rtol=tol, atol=tol * 3)


def test_fused_swiglu_nodes_on_tiles_in_a_graph():
    """One fused node per 32-row tile, forward and backward, on both executors."""
    T, H = 128, 64
    g = TaskGraph("swiglu")
    gate, up, dh = (g.input(n, (T, H)) for n in ("gate", "up", "dh"))
    h, dgate, dup = (g.output(n, (T, H)) for n in ("h", "dgate", "dup"))
    fwd, bwd = dvm.library.swiglu((32, H)), dvm.library.swiglu_backward((32, H))
    for i in range(0, T, 32):
        rows = slice(i, i + 32)
        g.task("dvm.fused", [gate[rows], up[rows]], [h[rows]], attrs={"program": fwd.to_attrs()})
        g.task("dvm.fused", [dh[rows], gate[rows], up[rows]], [dgate[rows], dup[rows]], attrs={"program": bwd.to_attrs()})
    feed = {n: torch.randn(T, H, generator=torch.Generator().manual_seed(k)) for k, n in enumerate(("gate", "up", "dh"))}
    want = ReferenceExecutor().run(g, feed).outputs
    got = ThreadExecutor().run(g, feed).outputs
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_operand_shapes_view_regions_as_the_programs_values():
    """A [T, n, n] buffer's entries written as [t, 1] values; sizes that differ are refused by name."""
    from megaloom.runtime.errors import GraphError

    g = TaskGraph("views")
    x, res = g.input("x", (8, 3)), g.output("res", (8, 3, 1))
    prog = dvm.library.silu((8, 1))
    for j in range(3):
        g.task("dvm.fused", [x[:, j:j + 1]], [res[:, j:j + 1, :]],
               attrs={"program": prog.to_attrs(), "operand_shapes": [[8, 1], [8, 1, 1]]})
    feed = {"x": torch.randn(8, 3, generator=torch.Generator().manual_seed(0))}
    for ex in (ReferenceExecutor(), ThreadExecutor()):
        torch.testing.assert_close(ex.run(g, feed)["res"][..., 0], F.silu(feed["x"]), rtol=1e-6, atol=1e-6)
    bad = TaskGraph("bad")
    xb, yb = bad.input("x", (8, 1)), bad.output("y", (4, 1))
    with pytest.raises(GraphError, match="operand_shapes .* do not have the sizes"):
        bad.task("dvm.fused", [xb], [yb], attrs={"program": prog.to_attrs(), "operand_shapes": [[8, 1], [4, 1]]})
        bad.validate()


def test_reduced_dtypes_compute_in_float32_and_round_once():
    """bf16 SwiGLU (and its gradient) run in float32 registers with one rounding per output: more
    accurate than the bf16 eager chain, and still the swiglu pattern function natively."""
    from megaloom.ops import native
    from megaloom.ops.dvm.native import Lowered

    g = torch.Generator().manual_seed(3)
    gate, up, dh = (torch.randn(64, 96, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    fwd, bwd = dvm.library.swiglu((64, 96), "bfloat16"), dvm.library.swiglu_backward((64, 96), "bfloat16")
    assert [i.op for i in fwd.code] == ["cast", "cast", "sigmoid", "mul", "mul", "cast"]
    assert fwd.out_specs() == [((64, 96), "bfloat16")] and dvm.library.opmath(dvm.library.swiglu((4, 4))).code == \
        dvm.library.swiglu((4, 4)).code  # float32 programs are left as they are
    if native.enabled():  # the casts up are register aliases; the chain is the swiglu pattern function
        assert [o.op for o in Lowered(fwd).ops] == ["swiglu", "copy"]
        computed_up = dvm.Program((((8,), "float32"),) * 2, (dvm.instr("neg", [1]), dvm.instr("sigmoid", [0]),
                                                           dvm.instr("mul", [0, 3]), dvm.instr("mul", [4, 2])), (5,))
        assert [o.op for o in Lowered(computed_up).ops] == ["neg", "swiglu"]  # the pattern keeps up's definition
        x = [torch.randn(8, generator=g), torch.randn(8, generator=g)]
        torch.testing.assert_close(run(computed_up, *x)[0], computed_up.run_reference(x)[0], rtol=2e-6, atol=1e-7)
    b = [t.to(torch.bfloat16) for t in (gate, up, dh)]
    (h,) = run(fwd, b[0], b[1])
    dgate, dup = run(bwd, b[2], b[0], b[1])
    exact = F.silu(b[0].double()) * b[1].double()
    once = (F.silu(b[0].float()) * b[1].float()).bfloat16()
    eager = F.silu(b[0]) * b[1]
    torch.testing.assert_close(h, once, rtol=2 ** -7, atol=1e-6)  # within one bf16 ulp of rounding once
    assert (h.double() - exact).norm() < (eager.double() - exact).norm()
    gg = b[0].double().requires_grad_()
    (F.silu(gg) * b[1].double()).backward(b[2].double())
    s = torch.sigmoid(b[0])
    eager_dgate = b[2] * b[1] * (s * (1 + b[0] * (1 - s)))
    assert (dgate.double() - gg.grad).norm() < (eager_dgate.double() - gg.grad).norm()
    torch.testing.assert_close(dup, (b[2].float() * F.silu(b[0].float())).bfloat16(), rtol=2 ** -7, atol=1e-6)
