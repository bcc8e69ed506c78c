"""``MegaGate``: the router as a torch module whose forward and backward run the task graphs.

The graph runs are the custom ops ``megaloom::gate_forward`` and ``megaloom::gate_backward``
(:mod:`megaloom.graphs.common.torch_ops`), so ``torch.compile`` traces a model that routes with
MegaGate without a graph break.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from megaloom.graphs.common.ops import acc_dtype
from megaloom.graphs.common.runner import GraphRunner
from megaloom.graphs.common.torch_ops import GraphOps, json_options
from megaloom.graphs.gate.graph import MEGAGATE, GateSpec, megagate_reference
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.executors import Executor


class GateOutput(NamedTuple):
    weights: torch.Tensor  # [..., k], float32 (float64 for float64 inputs)
    indices: torch.Tensor  # [..., k], int64
    logits: torch.Tensor  # [..., E], float32 (float64 for float64 inputs)


class GateOps(GraphOps):
    """MegaGate's custom ops; the options: the other GateSpec fields as JSON. The selection is held fixed
    in backward; the correction bias gets no gradient."""

    name, family = "gate", MEGAGATE
    inputs, outputs, saved = ("x", "weight", "bias"), ("logits", "weights", "indices"), ("logits", "indices")
    grad_inputs, grad_outputs = ("x", "weight"), ("logits", "weights")

    def spec(self, tensors: list[Tensor], options: str) -> GateSpec:
        x, weight = tensors[:2]
        return GateSpec.from_dict({"tokens": x.shape[0], "hidden": x.shape[1], "experts": weight.shape[0],
                                   "dtype": dtype_name(x.dtype), **json_options(options)})

    def fake(self, runner: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        x, weight = tensors[:2]
        (t, _), k, acc = x.shape, json_options(options)["top_k"], torch_dtype(acc_dtype(dtype_name(x.dtype)))
        return [x.new_empty(t, weight.shape[0], dtype=acc), x.new_empty(t, k, dtype=acc),
                x.new_empty(t, k, dtype=torch.int64)]


GATE_OPS = GateOps()


def run_megagate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                 runner: GraphRunner | None = None, **options) -> GateOutput:
    """Route ``x`` [..., H] with ``weight`` [E, H]; ``bias`` [E] moves the selection only.

    ``options``: the other :class:`GateSpec` fields (score, scale, renorm, n_group, topk_group,
    tile_tokens, weight_cols, weight_rows). The weight is used in x's dtype; gradients flow to x
    and weight. No tokens (``x`` of 0 rows) route through the eager reference.
    """
    options = GATE_OPS.options({"tokens": 1, "hidden": x.shape[-1], "experts": weight.shape[0]}, top_k=top_k, **options)
    runner = runner or GraphRunner()  # alive through the call; autograd keeps it for backward
    return _route(x, weight, bias, runner.key, options)


def _route(x: Tensor, weight: Tensor, bias: Tensor | None, runner: int, options: str) -> GateOutput:
    x2 = x.reshape(-1, x.shape[-1])
    acc = torch_dtype(acc_dtype(dtype_name(x.dtype)))
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=acc, device=x.device)
    if x2.shape[0]:
        logits, weights, indices = GATE_OPS(runner, [x2.contiguous(), weight.to(x.dtype).contiguous(),
                                                     bias.detach().to(acc).contiguous()], options)
    else:
        settings = {k: v for k, v in json_options(options).items() if k not in ("tile_tokens", "weight_cols",
                                                                                "weight_rows")}
        logits, weights, indices = megagate_reference(x2, weight.to(x.dtype), bias.detach().to(acc), **settings)
    return GateOutput(*(t.reshape(*x.shape[:-1], t.shape[-1]) for t in (weights, indices, logits)))


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
        self._options = GATE_OPS.options({"tokens": 1, "hidden": hidden, "experts": experts}, top_k=top_k, **options)
        self.weight = nn.Parameter(torch.empty(experts, hidden, device=device, dtype=dtype))
        self.register_buffer("bias", torch.zeros(experts, device=device, dtype=torch.float32))
        self.runner = GraphRunner(executor, units=units, policy=policy)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> GateOutput:
        return _route(x, self.weight, self.bias, self.runner.key, self._options)

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}{opts}"
