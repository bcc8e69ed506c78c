"""``MegaGate``: the router as a torch module whose forward and backward run the task graphs.

The graph runs are ``torch.library`` custom ops (``megaloom::gate_forward``,
``megaloom::gate_backward``) with fake implementations and an autograd formula, so
``torch.compile`` traces a model that routes with MegaGate without a graph break.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from megaloom.graphs.common.ops import acc_dtype
from megaloom.graphs.common.runner import GraphRunner, runner_for
from megaloom.graphs.gate.graph import MEGAGATE, GateSpec, megagate_reference
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.executors import Executor


class GateOutput(NamedTuple):
    weights: torch.Tensor  # [..., k], float32 (float64 for float64 inputs)
    indices: torch.Tensor  # [..., k], int64
    logits: torch.Tensor  # [..., E], float32 (float64 for float64 inputs)


def _spec(x: Tensor, weight: Tensor, options: str) -> GateSpec:
    return GateSpec.from_dict({"tokens": x.shape[0], "hidden": x.shape[1], "experts": weight.shape[0],
                               "dtype": dtype_name(x.dtype), **json.loads(options)})


@torch.library.custom_op("megaloom::gate_forward", mutates_args=())
def _gate_forward(x: Tensor, weight: Tensor, bias: Tensor, runner: int, options: str) -> list[Tensor]:
    """``[logits, weights, indices]`` of ``x [T, H]`` routed by ``weight [E, H]``; ``options``: the
    other GateSpec fields as JSON."""
    r = runner_for(runner)
    out = r.run(r.graph(MEGAGATE, _spec(x, weight, options), "fwd"), {"x": x, "weight": weight, "bias": bias},
                "fwd").outputs
    return [out["logits"], out["weights"], out["indices"]]


@_gate_forward.register_fake
def _(x, weight, bias, runner, options):
    k, acc = json.loads(options)["top_k"], torch_dtype(acc_dtype(dtype_name(x.dtype)))
    t = x.shape[0]
    return [x.new_empty(t, weight.shape[0], dtype=acc), x.new_empty(t, k, dtype=acc),
            x.new_empty(t, k, dtype=torch.int64)]


@torch.library.custom_op("megaloom::gate_backward", mutates_args=())
def _gate_backward(x: Tensor, weight: Tensor, logits: Tensor, indices: Tensor, grad_weights: Tensor,
                   grad_logits: Tensor, runner: int, options: str) -> list[Tensor]:
    """``[grad_x, grad_weight]``: the selection held fixed."""
    r = runner_for(runner)
    out = r.run(r.graph(MEGAGATE, _spec(x, weight, options), "bwd"), {
        "x": x, "weight": weight, "logits": logits, "indices": indices,
        "grad_weights": grad_weights, "grad_logits": grad_logits}, "bwd").outputs
    return [out["grad_x"], out["grad_weight"]]


@_gate_backward.register_fake
def _(x, weight, logits, indices, grad_weights, grad_logits, runner, options):
    return [torch.empty_like(x), torch.empty_like(weight)]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, runner, options = inputs
    ctx.runner, ctx.options, ctx.keep = runner, options, runner_for(runner)
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(x, weight, output[0], output[2])


def _backward(ctx, grads):
    x, weight, logits, indices = ctx.saved_tensors
    g_logits, g_weights = grads[0], grads[1]
    g_logits = torch.zeros_like(logits) if g_logits is None else g_logits.to(logits.dtype)
    g_weights = (torch.zeros(indices.shape, dtype=logits.dtype, device=logits.device) if g_weights is None
                 else g_weights.to(logits.dtype))
    gx, gw = _gate_backward(x, weight, logits, indices, g_weights.contiguous(), g_logits.contiguous(), ctx.runner,
                            ctx.options)
    return gx, gw, None, None, None


_gate_forward.register_autograd(_backward, setup_context=_setup_context)


def run_megagate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                 runner: GraphRunner | None = None, **options) -> GateOutput:
    """Route ``x`` [..., H] with ``weight`` [E, H]; ``bias`` [E] moves the selection only.

    ``options``: the other :class:`GateSpec` fields (score, scale, renorm, n_group, topk_group,
    tile_tokens, weight_cols, weight_rows). The weight is used in x's dtype; gradients flow to x
    and weight. No tokens (``x`` of 0 rows) route through the eager reference.
    """
    GateSpec.from_dict({"tokens": 1, "hidden": x.shape[-1], "experts": weight.shape[0], "top_k": top_k, **options})
    runner = runner or GraphRunner()  # alive through the call; autograd keeps it for backward
    return _route(x, weight, bias, runner.key, _options_json(top_k, options))


def _options_json(top_k: int, options: Mapping[str, Any]) -> str:
    return json.dumps({"top_k": top_k, **options}, sort_keys=True)


def _route(x: Tensor, weight: Tensor, bias: Tensor | None, runner: int, options: str) -> GateOutput:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    acc = torch_dtype(acc_dtype(dtype_name(x.dtype)))
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=acc, device=x.device)
    if x2.shape[0]:
        logits, weights, indices = _gate_forward(x2.contiguous(), weight.to(x.dtype).contiguous(),
                                                 bias.detach().to(acc).contiguous(), runner, options)
    else:
        settings = {k: v for k, v in json.loads(options).items() if k not in ("tile_tokens", "weight_cols",
                                                                              "weight_rows")}
        logits, weights, indices = megagate_reference(x2, weight.to(x.dtype), bias.detach().to(acc), **settings)
    lead = x.shape[:-1]
    k, e = weights.shape[-1], logits.shape[-1]
    return GateOutput(weights.reshape(*lead, k), indices.reshape(*lead, k), logits.reshape(*lead, e))


class MegaGate(nn.Module):
    """MoE router: ``weight`` [E, H] is an ``nn.Parameter``; ``bias`` [E] (the per-expert
    correction bias, updated outside autograd) is a float32 buffer.

    ``options``: the other :class:`GateSpec` fields (score, scale, renorm, n_group, topk_group,
    tile_tokens, weight_cols, weight_rows); ``executor``, ``units``, ``policy``: what runs the graphs
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
        self._options = _options_json(top_k, options)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> GateOutput:
        return _route(x, self.weight, self.bias, self.runner.key, self._options)

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}{opts}"
