"""``MegaMoE``: a drop-in MoE expert block whose forward and backward run the MegaMoE graphs.

    moe = MegaMoE(hidden=1024, intermediate=512, experts=8, top_k=2)
    y = moe(x, topk_ids, topk_weights)          # [T, H]; autograd to x, weights, parameters

Expert parallel: pass ``comm`` (a :class:`megaloom.comm.Communicator`, e.g.
``TorchCommunicator(group)``); each rank then holds ``experts / world_size`` experts and
exchanges per-expert counts on the host before building (or reusing) its graphs.

The graph runs are the custom ops ``megaloom::moe_forward`` and ``megaloom::moe_backward``
(:mod:`megaloom.graphs.common.torch_ops`), so ``torch.compile`` traces a block that calls
:func:`megamoe` without a graph break (``fullgraph=True`` works). :func:`megamoe` honours
``torch.autocast``: under autocast the experts compute in the autocast dtype (GEMMs accumulate in
float32), as ``F.linear`` would. Double backward (``create_graph=True``) differentiates the first-order gradients of
megaloom's eager reference block (one rank, high precision only).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from megaloom.graphs.common.runner import GraphRunner, runner_for
from megaloom.graphs.common.torch_ops import GraphOps, json_options
from megaloom.graphs.moe.graph import MEGAMOE, saved_names
from megaloom.graphs.moe.layout import Layout, capacity, place, step_inputs
from megaloom.graphs.moe.spec import Counts, MegaMoESpec, Routing, local_counts, make_routing, synthetic_counts
from megaloom.ops.mxfp8.format import SCALE_MODES
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import ConfigError, ExecutionError
from megaloom.runtime.executors import Executor
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import CUBE

GROUPED_TILES = 4  # experts of at most this many row tiles on average: one grouped task per stage


@lru_cache(maxsize=256)  # a spec's checks cost more than a step's routing: once per call shape
def _call_spec(spec: MegaMoESpec, tokens: int, dtype: torch.dtype, mx: str, one_cube: bool) -> MegaMoESpec:
    """The spec of a call; grouped (:class:`MegaMoESpec`) on one rank in high precision, with one cube
    unit (``one_cube``; several run tiles at once), when the mean expert holds at most ``GROUPED_TILES``
    row tiles: there a tile's GEMM costs less than running it as a task of its own, and a grouped task
    runs the same GEMMs, one per expert."""
    few = one_cube and spec.ep == 1 and not mx and tokens * spec.top_k <= GROUPED_TILES * spec.tile_m * spec.experts
    return replace(spec, tokens=tokens, dtype=dtype_name(dtype), precision="mxfp8" if mx else "none",
                   scale_mode=mx or spec.scale_mode, grouped=spec.grouped or few)


@lru_cache(maxsize=256)
def _layout(spec: MegaMoESpec, rank: int) -> tuple[Layout, Counts]:
    """The dynamic graphs' layout of ``spec`` and the balanced counts that set their simulated sizes."""
    return Layout(spec, rank), synthetic_counts(spec, rank=rank)


class MegaMoERunner(GraphRunner):
    """A :class:`GraphRunner` of one MegaMoE spec: host routing, then the forward and backward
    graphs, built and validated once per call spec (tokens, dtype, precision): they are dynamic graphs
    (:mod:`.layout`) that take each step's routing as run-time inputs. ``executor``, ``units``,
    ``policy``: as for GraphRunner."""

    def __init__(self, spec: MegaMoESpec, comm: Any = None, *, executor: str | Executor = "thread",
                 units: Mapping[str, int] | None = None, policy: Any = None, cache_size: int = 64):
        world = getattr(comm, "world_size", 1)
        if spec.ep != world:
            raise ConfigError(f"MegaMoE spec has ep={spec.ep} but the communicator has {world} ranks")
        if world > 1 and not spec.ordered_comm:
            raise ConfigError("MegaMoE on several ranks needs ordered_comm=True: every rank must issue "
                              "its collectives in one order")
        super().__init__(executor, units=units, policy=policy, comm=comm, cache_size=cache_size)
        self.spec, self.one_cube = spec, (self.units or getattr(executor, "units", None) or {}).get(CUBE, 1) == 1

    def spec_for(self, tokens: int, dtype: torch.dtype, mx: str) -> MegaMoESpec:
        """The spec of a call: ``tokens`` rows of ``dtype``, expert GEMMs in MXFP8 with scale rule ``mx``
        (empty: in ``dtype``)."""
        return _call_spec(self.spec, tokens, dtype, mx, self.one_cube)

    def route(self, topk_ids: torch.Tensor, dtype: torch.dtype | None = None, mx: str = ""
              ) -> tuple[MegaMoESpec, Routing]:
        """The call's spec (:meth:`spec_for`; dtype default: the spec's) and host routing: this rank's
        counts, exchanged with every rank when ``ep > 1``."""
        spec = self.spec_for(int(topk_ids.shape[0]), dtype or torch_dtype(self.spec.dtype), mx)
        all_counts = None
        if spec.ep > 1:
            all_counts = self.comm.exchange(local_counts(topk_ids, spec.experts))
        return spec, make_routing(topk_ids.cpu(), spec, self.rank, all_counts)

    def dynamic_graph(self, spec: MegaMoESpec, direction: str, **kw: Any) -> TaskGraph:
        """The cached dynamic graph of ``spec`` (built and validated on the first call)."""
        return self.graph(MEGAMOE, spec, direction, _layout(spec, self.rank)[1], dynamic=True, **kw)

    def forward(self, spec: MegaMoESpec, routing: Routing, x: torch.Tensor, w: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, save: bool = True) -> RunResult:
        g = self.dynamic_graph(spec, "fwd", save=save)
        plan, _ = step_inputs(_layout(spec, self.rank)[0], routing)
        return self.run(g, {"x": x, **plan, "w": w, "gate_up": gate_up, "down": down}, "fwd", contiguous=False)

    def backward(self, spec: MegaMoESpec, routing: Routing, dout: torch.Tensor, w: torch.Tensor,
                 saved: Mapping[str, torch.Tensor], gate_up: torch.Tensor, down: torch.Tensor) -> RunResult:
        g = self.dynamic_graph(spec, "bwd")
        lay = _layout(spec, self.rank)[0]
        plan, rows = step_inputs(lay, routing)
        ws = place(rows, w.reshape(-1).index_select(0, routing.flat).unsqueeze(1), lay)
        return self.run(g, {"dout": dout, **plan, "ws": ws, **saved, "gate_up": gate_up, "down": down}, "bwd",
                        contiguous=False)


class MoEOps(GraphOps):
    """MegaMoE's custom ops; the options: ``{"mx": scale rule of MXFP8 expert GEMMs or "", "save": bool}``.
    The forward returns ``out``, plus with ``save`` the activations (:func:`saved_names`) and the host
    routing (``tok``, ``flat``, ``pos`` and the counts ``[W, E]``) its backward reads."""

    name, family = "moe", MEGAMOE
    inputs, outputs = ("x", "topk_ids", "w", "gate_up", "down"), ("out",)
    grad_inputs, grad_outputs = ("x", "w", "gate_up", "down"), ("out",)

    def forward(self, r: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        x, topk_ids, w, gate_up, down = tensors
        mx, save = (json_options(options)[k] for k in ("mx", "save"))
        spec, routing = r.route(topk_ids, x.dtype, mx)
        res = r.forward(spec, routing, x.contiguous(), w.contiguous(), gate_up, down, save)
        if not save:
            return [res["out"]]
        counts = torch.tensor(routing.counts.counts, dtype=torch.int64)
        return [res["out"], *(res[n] for n in saved_names(spec)), routing.tok, routing.flat, routing.pos, counts]

    def fake(self, r: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        x, topk_ids, _, _, down = tensors
        mx, save = (json_options(options)[k] for k in ("mx", "save"))
        (t, h), k, i = x.shape, topk_ids.shape[1], down.shape[1]
        out = x.new_empty(t, h)
        if not save:
            return [out]
        spec = r.spec_for(1, x.dtype, mx)
        rows = capacity(spec, t)[1]  # the static capacity of the recv layout
        if mx:  # token-axis FP8 copies of xr and a (expert blocks start on multiples of 32)
            fp8, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
            acts = [x.new_empty(rows, h, dtype=fp8), x.new_empty(rows // 32, h, dtype=e8m0), x.new_empty(rows, 2 * i),
                    x.new_empty(rows, i, dtype=fp8), x.new_empty(rows // 32, i, dtype=e8m0)]
        else:
            acts = [x.new_empty(rows, h), x.new_empty(rows, 2 * i), x.new_empty(rows, i)]
        ids, i64 = topk_ids.new_empty(t * k, dtype=torch.int64), torch.int64
        return [out, *acts, x.new_empty(t * k if spec.ep > 1 else rows, h), ids, torch.empty_like(ids),
                topk_ids.new_empty(t, k, dtype=i64), topk_ids.new_empty(spec.ep, spec.experts, dtype=i64)]

    def backward(self, r: GraphRunner, grads: list[Tensor], saved: list[Tensor], options: str) -> list[Tensor]:
        """``[dx, d topk_weights, d gate_up, d down]`` from the saved activations and routing."""
        (dout,), (_, _, w, gate_up, down) = grads, saved[:5]
        spec = r.spec_for(int(dout.shape[0]), dout.dtype, json_options(options)["mx"])
        names = saved_names(spec)
        acts, (tok, flat, pos, counts) = saved[5:5 + len(names)], saved[5 + len(names):]
        counts = Counts(r.rank, spec.ep, spec.experts_local, tuple(map(tuple, counts.tolist())))
        res = r.backward(spec, Routing(counts, tok, flat, pos), dout, w, dict(zip(names, acts)), gate_up, down)
        return [res["dx"], res["dw"], res["d_gate_up"], res["d_down"]]

    def differentiable_backward(self, ctx, grads: list[Tensor]) -> list[Tensor | None]:
        """The gradients of megaloom's eager reference block, with a graph (one rank, high precision)."""
        from megaloom.graphs.moe.reference import moe_reference

        if json_options(ctx.options)["mx"]:
            raise ExecutionError("MegaMoE double backward (create_graph=True) is not supported with MXFP8 experts")
        if runner_for(ctx.runner).world_size > 1:
            raise ExecutionError("MegaMoE double backward (create_graph=True) needs every expert on one rank; "
                                 "under expert parallelism the experts live on other ranks")
        x, topk_ids, *rest = ctx.saved_tensors[:5]
        with torch.enable_grad():
            ins = [t if t.requires_grad else t.detach().requires_grad_() for t in (x, *rest)]
            out = moe_reference(ins[0], topk_ids, ins[1], ins[2], ins[3])
            dx, dw, dgu, ddn = torch.autograd.grad(out, ins, grads[0], create_graph=True)
        return [dx, None, dw, dgu, ddn]


MOE_OPS = MoEOps()
_OPTIONS = {(mx, save): json.dumps({"mx": mx, "save": save}) for mx in ("", *SCALE_MODES) for save in (False, True)}


def megamoe(runner: MegaMoERunner, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor,
            down: Tensor, mx: str | None = None) -> Tensor:
    """``out [T, H] = sum_j w[t, j] MLP_{ids[t, j]}(x[t])`` through the MegaMoE graphs of ``runner``.

    ``x [T, H]``, ``topk_ids`` / ``topk_weights [T, k]``, ``gate_up [E_local, H, 2I]``, ``down
    [E_local, I, H]`` (views are fine: they are passed without a copy). Under ``torch.autocast``
    every operand is cast to the autocast dtype (differentiably: gradients reach float32
    parameters in float32); otherwise x and the weights must share a dtype. ``T`` may be 0. ``mx``:
    the expert GEMMs in MXFP8 with this scale rule (``"floor"`` or ``"rceil"``).
    """
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x, gate_up, down = x.to(dt), gate_up.to(dt), down.to(dt)
    if not x.dtype == gate_up.dtype == down.dtype:
        raise ConfigError(f"MegaMoE: hidden states are {x.dtype}, expert weights {gate_up.dtype} / {down.dtype} "
                          "(cast the module with .to(dtype), or run under torch.autocast)")
    ids = topk_ids.reshape(x.shape[0], runner.spec.top_k)
    w = topk_weights.reshape(ids.shape).to(x.dtype)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, gate_up, down))
    options = _OPTIONS.get((mx or "", save))
    if options is None:
        raise ConfigError(f"MegaMoE: mx must be one of {', '.join(SCALE_MODES)} or None, got {mx!r}")
    return MOE_OPS(runner.key, [x, ids, w, gate_up, down], options)[0]


class MegaMoE(nn.Module):
    """Drop-in MoE expert block: ``forward(hidden_states [T, H], topk_ids [T, k], topk_weights [T, k])``.

    Parameters ``gate_up [E_local, H, 2I]`` (gate then up projection) and ``down
    [E_local, I, H]`` are ordinary ``nn.Parameter`` s of this rank's experts
    (``E_local = experts / world_size``). Top-k weights are used in the compute dtype (the
    parameters', or autocast's). ``options``: tiling and schedule fields of
    :class:`MegaMoESpec` (``tile_m``, ``cube_split``, ``wgrad_split``, ``schedule``,
    ``group_size``, ``ordered_comm``).
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
        out = megamoe(self.runner, hidden_states.reshape(-1, shape[-1]), topk_ids, topk_weights, self.gate_up,
                      self.down)
        return out.view(*shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, experts={s.experts}, top_k={s.top_k}, "
                f"ep={s.ep}, schedule={s.schedule!r}")
