"""``MegaMoE``: a drop-in MoE expert block whose forward and backward run the MegaMoE graphs.

    moe = MegaMoE(hidden=1024, intermediate=512, experts=8, top_k=2)
    y = moe(x, topk_ids, topk_weights)          # [T, H]; autograd to x, weights, parameters

Expert parallel: pass ``comm`` (a :class:`megaloom.comm.Communicator`, e.g.
``TorchCommunicator(group)``); each rank then holds ``experts / world_size`` experts and
exchanges per-expert counts on the host before building (or reusing) its graphs.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

import torch
from torch import nn

from megaloom.graphs.common.runner import GraphRunner
from megaloom.graphs.moe.graph import MEGAMOE
from megaloom.graphs.moe.spec import MegaMoESpec, Routing, local_counts, make_routing
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.executors import Executor
from megaloom.runtime.executors.base import RunResult

SAVED = ("xr", "gu", "a", "yc")


class MegaMoERunner(GraphRunner):
    """A :class:`GraphRunner` of one MegaMoE spec: host routing, then the forward and backward
    graphs, built once per (spec, counts). ``executor``, ``units``, ``policy``: as for GraphRunner."""

    def __init__(self, spec: MegaMoESpec, comm: Any = None, *, executor: str | Executor = "thread",
                 units: Mapping[str, int] | None = None, policy: Any = None, cache_size: int = 64):
        world = getattr(comm, "world_size", 1)
        if spec.ep != world:
            raise ConfigError(f"MegaMoE spec has ep={spec.ep} but the communicator has {world} ranks")
        if world > 1 and not spec.ordered_comm:
            raise ConfigError("MegaMoE on several ranks needs ordered_comm=True: every rank must issue "
                              "its collectives in one order")
        super().__init__(executor, units=units, policy=policy, comm=comm, cache_size=cache_size)
        self.spec = spec

    def route(self, topk_ids: torch.Tensor) -> tuple[MegaMoESpec, Routing]:
        """Host routing: this rank's counts, exchanged with every rank when ``ep > 1``."""
        spec = replace(self.spec, tokens=int(topk_ids.shape[0]))
        all_counts = None
        if spec.ep > 1:
            all_counts = self.comm.exchange(local_counts(topk_ids, spec.experts))
        return spec, make_routing(topk_ids.cpu(), spec, self.rank, all_counts)

    def forward(self, spec: MegaMoESpec, routing: Routing, x: torch.Tensor, w: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, save: bool = True) -> RunResult:
        g = self.graph(MEGAMOE, spec, "fwd", routing.counts, save=save)
        return self.run(g, {"x": x, "tok": routing.tok, "pos": routing.pos, "w": w, "gate_up": gate_up,
                            "down": down}, "fwd", contiguous=False)

    def backward(self, spec: MegaMoESpec, routing: Routing, dout: torch.Tensor, w: torch.Tensor,
                 saved: Mapping[str, torch.Tensor], gate_up: torch.Tensor, down: torch.Tensor) -> RunResult:
        g = self.graph(MEGAMOE, spec, "bwd", routing.counts)
        ws = w.reshape(-1).index_select(0, routing.flat).unsqueeze(1)
        return self.run(g, {"dout": dout, "tok": routing.tok, "pos": routing.pos, "ws": ws, **saved,
                            "gate_up": gate_up, "down": down}, "bwd", contiguous=False)


class MegaMoEFunction(torch.autograd.Function):
    """``out = MoE(x; ids, w, gate_up, down)`` through the MegaMoE graphs; ids get no gradient."""

    @staticmethod
    def forward(ctx, runner: MegaMoERunner, x, topk_ids, topk_weights, gate_up, down):
        spec, routing = runner.route(topk_ids)
        save = any(ctx.needs_input_grad)
        # executor threads have grad mode on: hand them detached tensors
        x, topk_weights, gate_up, down = (t.detach() for t in (x, topk_weights, gate_up, down))
        res = runner.forward(spec, routing, x.contiguous(), topk_weights.contiguous(), gate_up, down, save)
        if save:
            ctx.runner, ctx.spec, ctx.routing = runner, spec, routing
            ctx.save_for_backward(topk_weights, gate_up, down, *(res[n] for n in SAVED))
        return res["out"]

    @staticmethod
    def backward(ctx, dout):
        w, gate_up, down, *saved = ctx.saved_tensors
        res = ctx.runner.backward(ctx.spec, ctx.routing, dout.contiguous(), w, dict(zip(SAVED, saved)), gate_up, down)
        return None, res["dx"], None, res["dw"], res["d_gate_up"], res["d_down"]


class MegaMoE(nn.Module):
    """Drop-in MoE expert block: ``forward(hidden_states [T, H], topk_ids [T, k], topk_weights [T, k])``.

    Parameters ``gate_up [E_local, H, 2I]`` (gate then up projection) and ``down
    [E_local, I, H]`` are ordinary ``nn.Parameter`` s of this rank's experts
    (``E_local = experts / world_size``). Top-k weights are used in the parameter dtype.
    ``options``: tiling and schedule fields of :class:`MegaMoESpec` (``tile_m``,
    ``cube_split``, ``wgrad_split``, ``schedule``, ``group_size``, ``ordered_comm``).
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, *, comm: Any = None,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str | None = None,
                 executor: str | Executor = "thread", units: Mapping[str, int] | None = None,
                 policy: Any = None, **options: Any):
        super().__init__()
        if {"tokens", "ep"} & set(options):
            raise ConfigError("MegaMoE takes tokens from the input and ep from the communicator")
        spec = MegaMoESpec.from_dict(dict(tokens=1, hidden=hidden, intermediate=intermediate, experts=experts,
                                          top_k=top_k, ep=getattr(comm, "world_size", 1), dtype=dtype_name(dtype),
                                          **options))
        self.runner = MegaMoERunner(spec, comm, executor=executor, units=units, policy=policy)
        el, dt = spec.experts_local, torch_dtype(spec.dtype)
        self.gate_up = nn.Parameter(torch.empty(el, hidden, 2 * intermediate, dtype=dt, device=device))
        self.down = nn.Parameter(torch.empty(el, intermediate, hidden, dtype=dt, device=device))
        self.reset_parameters()

    @property
    def spec(self) -> MegaMoESpec:
        return self.runner.spec

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up, std=1.0 / math.sqrt(self.spec.hidden))
        nn.init.normal_(self.down, std=1.0 / math.sqrt(self.spec.intermediate))

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if x.dtype != self.gate_up.dtype:
            raise ConfigError(f"MegaMoE: hidden states are {x.dtype}, parameters {self.gate_up.dtype}")
        ids = topk_ids.reshape(x.shape[0], -1)
        w = topk_weights.reshape(ids.shape).to(self.gate_up.dtype)
        out = MegaMoEFunction.apply(self.runner, x, ids, w, self.gate_up, self.down)
        return out.view(shape)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, experts={s.experts}, top_k={s.top_k}, "
                f"ep={s.ep}, schedule={s.schedule!r}")
