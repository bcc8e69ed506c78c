"""The built-in ops against their torch references (kernel, shape rule, cost)."""
import pytest
import torch

from megaloom.runtime import GraphError, TensorSpec, get_op
from megaloom.runtime.testing import check_op


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_layouts(trans_a, trans_b):
    a = torch.randn(5, 3) if trans_a else torch.randn(3, 5)
    b = torch.randn(4, 5) if trans_b else torch.randn(5, 4)
    (y,) = check_op("matmul", [a, b], {"trans_a": trans_a, "trans_b": trans_b})
    want = (a.t() if trans_a else a) @ (b.t() if trans_b else b)
    assert torch.allclose(y, want, atol=1e-6)
    specs = [TensorSpec(tuple(a.shape), "float32"), TensorSpec(tuple(b.shape), "float32")]
    out = get_op("matmul").shape(specs, {"trans_a": trans_a, "trans_b": trans_b})
    assert get_op("matmul").cost(specs, out, {"trans_a": trans_a, "trans_b": trans_b}).flops == 2 * 3 * 5 * 4


def test_matmul_inner_dim_mismatch_names_the_layout():
    specs = [TensorSpec((5, 3), "float32"), TensorSpec((5, 4), "float32")]
    with pytest.raises(GraphError, match=r"inner dims differ.*\(trans_b\)"):
        get_op("matmul").shape(specs, {"trans_b": True})


@pytest.mark.parametrize("op, shapes", [("add", [(4, 6), (1, 6)]), ("mul", [(4, 6), (4, 1)]), ("silu", [(4, 6)]),
                                        ("copy", [(4, 6)])])
def test_vector_ops(op, shapes):
    ins = [torch.randn(s) for s in shapes]
    (y,) = check_op(op, ins, {})
    want = {"add": lambda: ins[0] + ins[1], "mul": lambda: ins[0] * ins[1],
            "silu": lambda: torch.nn.functional.silu(ins[0]), "copy": lambda: ins[0]}[op]()
    assert torch.equal(y, want)
