"""``MegaGate``: the router as a torch module whose forward and backward run the task graphs."""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn

from megaloom.graphs.common.ops import acc_dtype
from megaloom.graphs.common.runner import GraphRunner
from megaloom.graphs.gate.graph import MEGAGATE, GateSpec
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.executors import Executor


class GateOutput(NamedTuple):
    weights: torch.Tensor  # [..., k], float32 (float64 for float64 inputs)
    indices: torch.Tensor  # [..., k], int64
    logits: torch.Tensor  # [..., E], float32 (float64 for float64 inputs)


class MegaGateFunction(torch.autograd.Function):
    """Autograd function over the graphs: (x [T, H], weight [E, H], bias [E]) -> (logits, weights, indices)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: GateSpec, runner: GraphRunner):
        out = runner.run(runner.graph(MEGAGATE, spec, "fwd"), {"x": x, "weight": weight, "bias": bias}, "fwd").outputs
        ctx.save_for_backward(x, weight, out["logits"], out["indices"])
        ctx.mark_non_differentiable(out["indices"])
        ctx.spec, ctx.runner = spec, runner
        return out["logits"], out["weights"], out["indices"]

    @staticmethod
    def backward(ctx, g_logits, g_weights, _g_indices):
        x, weight, logits, indices = ctx.saved_tensors
        spec: GateSpec = ctx.spec
        if g_logits is None:
            g_logits = torch.zeros_like(logits)
        if g_weights is None:
            g_weights = torch.zeros(indices.shape, dtype=logits.dtype, device=logits.device)
        out = ctx.runner.run(ctx.runner.graph(MEGAGATE, spec, "bwd"), {
            "x": x, "weight": weight, "logits": logits, "indices": indices,
            "grad_weights": g_weights.to(logits.dtype), "grad_logits": g_logits.to(logits.dtype)}, "bwd").outputs
        return out["grad_x"], out["grad_weight"], None, None, None


def run_megagate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                 runner: GraphRunner | None = None, **options) -> GateOutput:
    """Route ``x`` [..., H] with ``weight`` [E, H]; ``bias`` [E] moves the selection only.

    ``options``: the other :class:`GateSpec` fields (score, scale, renorm, tile_tokens,
    weight_cols, weight_rows). The weight is used in x's dtype; gradients flow to x and weight.
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    spec = GateSpec.from_dict({"tokens": x2.shape[0], "hidden": hidden, "experts": weight.shape[0], "top_k": top_k,
                               "dtype": dtype_name(x.dtype), **options})
    acc = torch_dtype(acc_dtype(spec.dtype))
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=acc, device=x.device)
    logits, weights, indices = MegaGateFunction.apply(x2, weight.to(x.dtype), bias.detach().to(acc), spec,
                                                      runner or GraphRunner())
    lead = x.shape[:-1]
    return GateOutput(weights.reshape(*lead, top_k), indices.reshape(*lead, top_k), logits.reshape(*lead, -1))


class MegaGate(nn.Module):
    """MoE router: ``weight`` [E, H] is an ``nn.Parameter``; ``bias`` [E] (the per-expert
    correction bias, updated outside autograd) is a float32 buffer.

    ``options``: the other :class:`GateSpec` fields (score, scale, renorm, tile_tokens,
    weight_cols, weight_rows); ``executor``, ``units``, ``policy``: what runs the graphs
    (see :class:`~megaloom.graphs.common.runner.GraphRunner`; default: a ThreadExecutor with
    one unit per engine kind).
    """

    def __init__(self, hidden: int, experts: int, top_k: int, *, executor: str | Executor = "thread",
                 units: Mapping[str, int] | None = None, policy: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **options):
        super().__init__()
        self.hidden, self.experts, self.top_k, self.options = hidden, experts, top_k, dict(options)
        GateSpec.from_dict({"tokens": 1, "hidden": hidden, "experts": experts, "top_k": top_k, **options})  # check
        self.weight = nn.Parameter(torch.empty(experts, hidden, device=device, dtype=dtype))
        self.register_buffer("bias", torch.zeros(experts, device=device, dtype=torch.float32))
        self.runner = GraphRunner(executor, units=units, policy=policy)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> GateOutput:
        return run_megagate(x, self.weight, self.bias, top_k=self.top_k, runner=self.runner, **self.options)

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}{opts}"
