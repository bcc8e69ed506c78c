"""The op-test helpers can fail: check_grads catches a wrong backward op and a wrong relation."""
import pytest
import torch

from megaloom.runtime import Cost, GraphError, OpDef, register
from megaloom.runtime.registry import GradOf
from megaloom.runtime.testing import backward_ops, check_grads, check_op


def _same(ins, attrs):
    return [ins[0]]


def _cost(ins, outs, attrs):
    return Cost(flops=float(ins[0].numel), bytes=1.0)


def _copy_into(fn):
    return lambda ins, outs, **a: outs[0].copy_(fn(*ins, **a))


def _square_bwd(x, g, acc, scale=1.0):
    return acc + 2 * scale * x * g


def _setup(bwd_kernel) -> None:
    register(OpDef("test_square", ("vector",), lambda x, scale=1.0: scale * x * x, _same, _cost,
                   _copy_into(lambda x, scale=1.0: scale * x * x)), replace=True)
    register(OpDef("test_square_bwd", ("vector",), _square_bwd, _same, _cost, _copy_into(bwd_kernel),
                   grad_of=GradOf("test_square", "x0 dy0 dx0", "dx0")), replace=True)


def test_a_right_backward_op_passes():
    _setup(_square_bwd)
    x = torch.randn(5, 3, dtype=torch.float64)
    assert backward_ops("test_square")[0].name == "test_square_bwd"
    (y,) = check_op("test_square", [x], {"scale": 1.5}, grads=True, grad_tol=1e-12)
    assert torch.equal(y, 1.5 * x * x)


def test_a_wrong_kernel_or_relation_fails():
    _setup(lambda x, g, acc, scale=1.0: acc + 2 * x * g)  # forgets the scale
    with pytest.raises(AssertionError, match="test_square_bwd: output 0: kernel vs reference"):
        check_grads("test_square", [torch.randn(4, 2)], {"scale": 3.0})
    register(OpDef("test_square_bwd", ("vector",), _square_bwd, _same, _cost, _copy_into(_square_bwd),
                   grad_of=GradOf("test_square", "x0 dy0 dx0", "dx0")), replace=True)
    check_grads("test_square", [torch.randn(4, 2)], {"scale": 3.0})
    register(OpDef("test_square_bwd", ("vector",), lambda x, g, acc, scale=1.0: 2 * scale * x * g, _same, _cost,
                   _copy_into(lambda x, g, acc, scale=1.0: 2 * scale * x * g),  # drops the summed gradient
                   grad_of=GradOf("test_square", "x0 dy0 dx0", "dx0")), replace=True)
    with pytest.raises(AssertionError, match="reference dx0 vs torch.autograd of test_square"):
        check_grads("test_square", [torch.randn(4, 2)], {})


def test_grads_need_a_declared_backward_op_and_a_valid_relation():
    with pytest.raises(AssertionError, match="no registered op declares grad_of='silu'"):
        check_op("silu", [torch.randn(3)], {}, grads=True)
    with pytest.raises(GraphError, match="bad operand 'z0'"):
        GradOf("f", "x0 z0", "dx0")
    with pytest.raises(GraphError, match="outputs must be input gradients"):
        GradOf("f", "x0", "y0")
