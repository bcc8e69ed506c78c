"""Each DVM primitive: kernel and reference against plain torch, shape rule, cost, errors."""
from __future__ import annotations

import pytest
import torch

from megaloom.ops.dvm.primitives import PRIMITIVES, bind, infer
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import TensorSpec, get_op

TORCH = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "exp": torch.exp, "log": torch.log,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "erf": torch.erf, "add": torch.add, "sub": torch.sub, "mul": torch.mul,
    "div": torch.div, "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}


def _operands(name: str, g: torch.Generator):
    a = torch.rand(6, 5, generator=g) + 0.25
    b = torch.rand(6, 5, generator=g) + 0.25
    if name == "where":
        return [a > 0.7, a, b]
    return [a, b][:PRIMITIVES[name].arity]


@pytest.mark.parametrize("name", sorted(set(PRIMITIVES) - {"cast"}))
def test_kernel_and_reference_match_torch(name):
    g = torch.Generator().manual_seed(0)
    xs = _operands(name, g)
    want = torch.where(*xs) if name == "where" else TORCH[name](*xs)
    op = get_op("dvm." + name)
    ref = op.reference(*xs)
    out = torch.empty_like(want)
    op.kernel(xs, [out])
    assert torch.equal(ref, want) and torch.equal(out, want)
    (spec,) = op.shape([TensorSpec(tuple(x.shape), str(x.dtype)[6:]) for x in xs], {})
    assert spec.shape == tuple(want.shape) and spec.dtype == str(want.dtype)[6:]
    cost = op.cost([TensorSpec((6, 5), "float32")] * len(xs), [spec], {})
    assert cost.flops > 0 and cost.bytes > 0


@pytest.mark.parametrize("name,pos,s,want", [
    ("sub", 0, 2.0, lambda x: 2.0 - x), ("sub", 1, 2.0, lambda x: x - 2.0),
    ("div", 0, 3.0, lambda x: torch.full_like(x, 3.0) / x), ("pow", 0, 2.0, lambda x: 2.0 ** x), ("pow", 1, 3.0, lambda x: x ** 3.0),
    ("maximum", 1, 0.5, lambda x: torch.clamp_min(x, 0.5)), ("minimum", 0, 0.5, lambda x: torch.clamp_max(x, 0.5)),
    ("lt", 0, 0.5, lambda x: 0.5 < x), ("ge", 1, 0.5, lambda x: x >= 0.5), ("add", 0, 1, lambda x: 1 + x),
])
def test_scalar_operands(name, pos, s, want):
    x = torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    attrs = {"scalar": s, "scalar_pos": pos}
    got = get_op("dvm." + name).reference(x, **attrs)
    assert torch.equal(got, want(x))


def test_where_with_scalar_and_cast():
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    got = get_op("dvm.where").reference(x > 0, x, scalar=0.0, scalar_pos=2)
    assert torch.equal(got, torch.relu(x))
    got = get_op("dvm.where").reference(x > 0, x, scalar=-1.0, scalar_pos=1)
    assert torch.equal(got, torch.where(x > 0, -1.0, x))
    c = get_op("dvm.cast").reference(x, dtype="bfloat16")
    assert c.dtype == torch.bfloat16 and torch.equal(c, x.bfloat16())


@pytest.mark.parametrize("name,specs,attrs,match", [
    ("exp", [((3,), "int32")], {}, "does not take dtype"),
    ("add", [((3,), "float32"), ((3,), "float16")], {}, "dtypes differ"),
    ("add", [((3,), "float32"), ((4,), "float32")], {}, "do not broadcast"),
    ("add", [((3,), "int32")], {"scalar": 0.5}, "change the dtype"),
    ("where", [((3,), "float32"), ((3,), "float32"), ((3,), "float32")], {}, "must be bool"),
    ("neg", [((3,), "float32")], {"scalar": 1.0}, "out of range"),
    ("add", [((3,), "float32")], {"scalar": "x"}, "int or float"),
    ("nope", [((3,), "float32")], {}, "unknown DVM primitive"),
])
def test_bad_operands_raise_named_errors(name, specs, attrs, match):
    with pytest.raises(GraphError, match=match):
        infer(name, specs, attrs)


def test_bind_writes_out_in_place():
    x = torch.randn(8)
    out = torch.empty(8)
    assert bind("exp", {}, "float32")(out, x) is out and torch.equal(out, torch.exp(x))
