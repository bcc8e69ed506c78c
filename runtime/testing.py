"""Checks every op and executor test shares: relative error, and ``check_op``, which
holds an op's kernel, shape rule and cost against its torch reference."""
from __future__ import annotations

from typing import Any

import torch

from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.registry import TensorSpec, get_op, run_reference


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ``|actual - expected| / |expected|`` in float64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    den = e.norm().item()
    return (a - e).norm().item() / den if den else (a - e).norm().item()


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """NaN (or -1) filled output; ``strided``: a column slice of a wider tensor, like a region view."""
    wide = (*shape[:-1], shape[-1] + 2) if strided and len(shape) >= 2 else shape
    x = torch.full(wide, float("nan") if dtype.is_floating_point else -1).to(dtype)
    return x[..., 1:shape[-1] + 1] if wide != shape else x


def check_op(name: str, inputs: list[torch.Tensor], attrs: dict[str, Any], tol: float = 1e-5) -> list[torch.Tensor]:
    """Run op ``name``'s kernel into fresh outputs and check it against the reference.

    Checks: the shape rule matches the reference outputs; kernel outputs, written into whole
    tensors and into strided column views, match them (relative L2 <= ``tol``; integer
    outputs exactly); the cost is finite, non-negative and not zero. Returns the reference outputs;
    raises AssertionError naming the op and output.
    """


    op = get_op(name)
    specs = op.shape([TensorSpec(tuple(x.shape), dtype_name(x.dtype)) for x in inputs], attrs)
    ref = run_reference(op, inputs, attrs)
    assert len(ref) == len(specs), f"{name}: reference makes {len(ref)} outputs, shape rule {len(specs)}"
    for i, (s, r) in enumerate(zip(specs, ref)):
        assert tuple(r.shape) == s.shape and dtype_name(r.dtype) == s.dtype, (
            f"{name}: output {i} is {tuple(r.shape)} {r.dtype}, shape rule says {s.shape} {s.dtype}")
    for strided in (False, True):  # outputs as whole tensors, then as column slices of wider ones
        outs = [_poisoned(s.shape, torch_dtype(s.dtype), strided) for s in specs]
        op.kernel(inputs, outs, **attrs)
        for i, (o, r) in enumerate(zip(outs, ref)):
            where = f"{name}: output {i}{' (strided)' if strided else ''}"
            if o.dtype.is_floating_point:
                err = rel_l2(o, r)
                assert err <= tol, f"{where}: kernel vs reference relative L2 error {err:.3e} > {tol:.1e}"
            else:
                assert torch.equal(o, r), f"{where}: kernel differs from the reference"
    c = op.cost([TensorSpec(tuple(x.shape), dtype_name(x.dtype)) for x in inputs], specs, attrs)
    figures = (c.flops, c.bytes, c.comm_bytes)
    assert all(0 <= f < float("inf") for f in figures) and sum(figures) > 0, f"{name}: cost {c} is not finite and positive"
    return list(ref)
