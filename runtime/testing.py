"""Checks every op and executor test shares: relative error; ``check_op``, which holds an
op's kernel, shape rule and cost against its torch reference; and ``check_grads``, which
holds the backward ops of a forward op against ``torch.autograd`` of its reference."""
from __future__ import annotations

from typing import Any

import torch

from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.registry import OpDef, TensorSpec, all_ops, get_op, run_reference


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ``|actual - expected| / |expected|`` in float64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    return (a - e).norm().item() / (e.norm().item() or 1.0)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """NaN (or -1) filled output; ``strided``: a column slice of a wider tensor, like a region view."""
    wide = (*shape[:-1], shape[-1] + 2) if strided and len(shape) >= 2 else shape
    x = torch.full(wide, float("nan") if dtype.is_floating_point else -1).to(dtype)
    return x[..., 1:shape[-1] + 1] if wide != shape else x


def _check_kernel(name: str, inputs: list[torch.Tensor], attrs: dict[str, Any], tol: float,
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`check_op`'s checks; returns the reference outputs and the kernel's (whole tensors)."""
    op = get_op(name)
    in_specs = [TensorSpec(tuple(x.shape), dtype_name(x.dtype)) for x in inputs]
    specs = op.shape(in_specs, attrs)
    ref = run_reference(op, inputs, attrs)
    assert len(ref) == len(specs), f"{name}: reference makes {len(ref)} outputs, shape rule {len(specs)}"
    for i, (s, r) in enumerate(zip(specs, ref)):
        assert tuple(r.shape) == s.shape and dtype_name(r.dtype) == s.dtype, (
            f"{name}: output {i} is {tuple(r.shape)} {r.dtype}, shape rule says {s.shape} {s.dtype}")
    kernel_outs: list[torch.Tensor] = []
    for strided in (False, True):  # outputs as whole tensors, then as column slices of wider ones
        outs = [_poisoned(s.shape, torch_dtype(s.dtype), strided) for s in specs]
        op.kernel(inputs, outs, **attrs)
        kernel_outs = kernel_outs or outs
        for i, (o, r) in enumerate(zip(outs, ref)):
            where = f"{name}: output {i}{' (strided)' if strided else ''}"
            if o.dtype.is_floating_point:
                err = rel_l2(o, r)
                assert err <= tol, f"{where}: kernel vs reference relative L2 error {err:.3e} > {tol:.1e}"
            else:
                assert torch.equal(o, r), f"{where}: kernel differs from the reference"
    c = op.cost(in_specs, specs, attrs)
    assert c.valid() and c.flops + c.bytes + c.comm_bytes > 0, f"{name}: cost {c} is not finite and positive"
    return list(ref), kernel_outs


def check_op(name: str, inputs: list[torch.Tensor], attrs: dict[str, Any], tol: float = 1e-5, *,
             grads: bool = False, grad_tol: float | None = None) -> list[torch.Tensor]:
    """Run op ``name``'s kernel into fresh outputs and check it against the reference.

    Checks: the shape rule matches the reference outputs; kernel outputs, written into whole
    tensors and into strided column views, match them (relative L2 <= ``tol``; integer
    outputs exactly); the cost is finite, non-negative and not zero. With ``grads``, also
    :func:`check_grads` on the same inputs (``grad_tol``, default ``tol``). Returns the
    reference outputs; raises AssertionError naming the op and output.
    """
    ref, _ = _check_kernel(name, inputs, attrs, tol)
    if grads:
        check_grads(name, inputs, attrs, tol if grad_tol is None else grad_tol)
    return ref


def backward_ops(name: str) -> list[OpDef]:
    """Every registered op whose ``grad_of`` names the forward op ``name``."""
    return [op for op in all_ops().values() if op.grad_of is not None and op.grad_of.op == name]


def check_grads(name: str, inputs: list[torch.Tensor], attrs: dict[str, Any], tol: float = 1e-5) -> list[str]:
    """Hold every backward op of the forward op ``name`` against ``torch.autograd``.

    For each op declaring ``grad_of=GradOf(name, ...)``: random gradients (seeded) for the
    forward outputs it reads and the input gradients it adds to; the expected input gradients
    from ``torch.autograd.grad`` through ``name``'s reference on ``inputs`` (``attrs`` go to
    both ops); then :func:`check_op`'s checks of the backward op, and its reference and kernel
    outputs against the expected gradients (relative L2 <= ``tol``). Returns the backward
    ops' names; a forward op with none raises AssertionError.
    """
    ops = backward_ops(name)
    assert ops, f"{name}: no registered op declares grad_of={name!r}"
    gen = torch.Generator().manual_seed(0)
    for bwd in ops:
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        ys = run_reference(get_op(name), leaves, attrs)
        operands, dy, dx = [], {}, {}
        for sym in bwd.grad_of.inputs:
            kind, i = sym.rstrip("0123456789"), int(sym.lstrip("xyd"))
            like = (ys if kind in ("y", "dy") else inputs)[i]
            if kind in ("x", "y"):
                operands.append(like.detach())
                continue
            operands.append(torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype))
            into = dy if kind == "dy" else dx
            into[i] = into.get(i, 0.0) + operands[-1].double()
        wrt = [int(s[2:]) for s in bwd.grad_of.outputs]
        got = torch.autograd.grad([ys[j] for j in dy], [leaves[i] for i in wrt],
                                  [dy[j].to(ys[j].dtype) for j in dy], allow_unused=True)
        want = [(torch.zeros_like(leaves[i]) if g is None else g).double() + dx.get(i, 0.0) for g, i in zip(got, wrt)]
        ref, kernel = _check_kernel(bwd.name, operands, attrs, tol)
        for sym, w, r, k in zip(bwd.grad_of.outputs, want, ref, kernel):
            for what, out in (("reference", r), ("kernel", k)):
                assert out.numel() == w.numel(), f"{bwd.name}: {sym} has {tuple(out.shape)}, input is {tuple(w.shape)}"
                err = rel_l2(out.reshape(w.shape), w)
                assert err <= tol, (f"{bwd.name}: {what} {sym} vs torch.autograd of {name}: "
                                    f"relative L2 error {err:.3e} > {tol:.1e}")
    return [op.name for op in ops]
