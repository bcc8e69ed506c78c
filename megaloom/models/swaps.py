"""megaloom modules for transformers models: MegaMoE for MoE blocks, MegaGate for their
routers (MXFP8Linear for ``nn.Linear`` comes from :mod:`megaloom.models.plan`).

Every swap keeps the model's own Parameters (by identity) under the original names, so
state_dict keys, optimizer state and checkpoints are unchanged:

- :class:`MegaMoEBlock` keeps the block's children (router, experts, shared expert and its
  gate) under their names and runs the routed experts through the MegaMoE graphs. The experts
  become a :class:`FusedExperts` (the same ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
  Parameters, passed to the graphs as transposed *views*: no copy) or a :class:`ListExperts`
  (the same MLP modules; their weights are stacked each step). Under expert parallelism,
  :meth:`MegaMoEBlock.keep_local_experts` (run after the swap) re-registers each rank's
  ``E / ep`` fused experts as Parameters of their own (a copy of those
  rows), so the full tensor is freed once nothing else holds it.
- :class:`MegaGateRouter` is a MegaGate around the router's own ``weight`` Parameter
  (and a ``e_score_correction_bias`` buffer), returning the router's ``(logits, weights,
  indices)``, with the settings :func:`megaloom.models.routers.gate_settings` found.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from megaloom.models.hf_moe import (MoEBlockParts, behaviour_problems, block_forward, block_parts, expert_weights,
                                    is_silu, read_block)
from megaloom.models.routers import gate_settings
from megaloom.runtime.errors import ConfigError


def moe_problems(block: nn.Module, ep: int) -> list[str]:
    """Why ``block`` cannot become a :class:`MegaMoEBlock` on ``ep`` ranks (empty: it can), its
    forward checked against the one rebuilt from its parts."""
    parts, problems = read_block(block)
    if parts is None:
        return problems
    if not is_silu(parts.act):
        problems.append(f"MegaMoE runs SwiGLU experts; the experts' activation {parts.act!r} is not SiLU")
    if parts.num_experts % ep:
        problems.append(f"{parts.num_experts} experts do not split over parallel.ep_size={ep} ranks")
    if ep > 1 and not parts.fused:
        problems.append("expert parallelism needs fused 3-D expert weights; this block's experts are a ModuleList")
    return problems + behaviour_problems(block, parts)


@functools.cache
def _megagate_cls() -> type:
    """MegaGateRouter, defined on first use (importing the graphs layer only then)."""
    from megaloom.graphs.gate.module import MegaGate

    class MegaGateRouter(MegaGate):
        """MegaGate returning the transformers router's ``(logits, weights, indices)``."""

        def forward(self, x: torch.Tensor, block_bias: torch.Tensor | None = None):
            out = super().forward(x)  # a block's correction bias is the gate's own ``bias`` already
            return out.logits, out.weights, out.indices

    return MegaGateRouter


def make_gate(router: nn.Module, block_bias: torch.Tensor | None = None, **options: Any) -> nn.Module:
    """A MegaGate over ``router``'s own weight Parameter (and correction-bias buffer, or its block's
    ``block_bias``), same state_dict keys."""
    settings, problems = gate_settings(router, block_bias is not None)
    if problems:
        raise ConfigError("; ".join(problems))
    experts, hidden = router.weight.shape
    gate = _megagate_cls()(hidden, experts, int(router.top_k), dtype=router.weight.dtype, **settings, **options)
    gate.weight = router.weight  # the model's own Parameter
    bias = getattr(router, "e_score_correction_bias", None)
    # MegaGate reads ``bias``; keep it out of the state_dict, under the router's own name when it has one
    gate.register_buffer("bias", next(b for b in (block_bias, bias, gate.bias) if b is not None), persistent=False)
    if bias is not None:
        gate.register_buffer("e_score_correction_bias", bias)
    return gate


class RoutedExperts(nn.Module):
    """The routed experts of a :class:`MegaMoEBlock`: ``weights()`` in MegaMoE's layout, and
    ``mx`` (None, or the MXFP8 scale mode when ``low_precision`` selected them)."""

    mx: str | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_weights(self)

    @property
    def hidden(self) -> int:
        return self.weights()[1].shape[2]

    @property
    def intermediate(self) -> int:
        return self.weights()[1].shape[1]

    def with_mx(self, scale_mode: str) -> RoutedExperts:
        """The same experts (same Parameters and modules) with their GEMMs in MXFP8."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        for key in ("_parameters", "_buffers", "_modules"):
            new.__dict__[key] = dict(self.__dict__[key])
        new.mx = scale_mode
        return new

    def extra_repr(self) -> str:
        return f"mxfp8={self.mx}" if self.mx else ""


class FusedExperts(RoutedExperts):
    """Fused experts: the block's own ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` Parameters."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj


class ListExperts(RoutedExperts, nn.ModuleList):
    """Experts as the block's own ModuleList of gated MLPs (same modules, same state_dict keys)."""

    def __init__(self, experts: nn.ModuleList):
        nn.ModuleList.__init__(self, list(experts))


def routed_experts(experts: nn.Module) -> RoutedExperts:
    """The routed experts a :class:`MegaMoEBlock` holds for a block's ``experts`` (same Parameters)."""
    return ListExperts(experts) if isinstance(experts, nn.ModuleList) else FusedExperts(experts)


class MegaMoEBlock(nn.Module):
    """An MoE block whose routed experts run as the MegaMoE task graphs.

    ``comm`` (a megaloom Communicator) with ``world_size > 1`` enables expert
    parallelism: this rank owns experts ``[rank * E/ep, (rank + 1) * E/ep)``.
    ``gate`` replaces the router (a :func:`make_gate` MegaGate). ``options`` go to
    :class:`megaloom.graphs.moe.module.MegaMoERunner` (``executor``, ``units``, ``policy``,
    ``cache_size``) or to the spec (``tile_m``, ``schedule``, ...).
    """

    def __init__(self, block: nn.Module, comm: Any = None, gate: nn.Module | None = None, **options: Any):
        super().__init__()
        from megaloom.graphs.moe.module import MegaMoERunner
        from megaloom.graphs.moe.spec import MegaMoESpec

        parts: MoEBlockParts = block_parts(block)
        ep = getattr(comm, "world_size", 1)
        if parts.num_experts % ep or (ep > 1 and not parts.fused):
            raise ConfigError(f"{type(block).__name__}: cannot split its experts over {ep} ranks")
        experts = routed_experts(parts.experts)
        for name, child in block.named_children():  # same names, same order: same state_dict keys
            if child is parts.router and gate is not None:
                child = gate
            setattr(self, name, experts if child is parts.experts else child)
        for name, buf in block.named_buffers(recurse=False):  # the block's correction bias, the same tensor
            self.register_buffer(name, buf)
        # the parts as this block holds them (its router and experts), for block_forward
        self.parts = dataclasses.replace(parts, router=gate or parts.router, experts=experts)
        self.router_name, self.num_experts, self.top_k = parts.router_name, parts.num_experts, parts.top_k
        runner_keys = {"executor", "units", "policy", "cache_size"}
        gate_up = next(experts.parameters())
        spec = MegaMoESpec(tokens=1, hidden=parts.hidden, intermediate=parts.inter, experts=parts.num_experts,
                           top_k=parts.top_k, ep=ep, dtype=str(gate_up.dtype).removeprefix("torch."),
                           **{k: v for k, v in options.items() if k not in runner_keys})
        self.runner = MegaMoERunner(spec, comm, **{k: v for k, v in options.items() if k in runner_keys})
        self.local_experts = ep == 1  # under EP, true once keep_local_experts() ran

    def keep_local_experts(self) -> None:
        """Under EP: re-register the expert weights as this rank's experts only (copied, the full tensors dropped)."""
        if self.local_experts:
            return
        n = self.runner.spec.experts_local
        lo = self.runner.rank * n
        for name in ("gate_up_proj", "down_proj"):
            local = nn.Parameter(getattr(self.experts, name).detach()[lo:lo + n].clone())
            local.megaloom_ep_sharded = True
            setattr(self.experts, name, local)
        self.local_experts = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from megaloom.graphs.moe.module import megamoe

        if not self.local_experts:
            raise ConfigError("MegaMoEBlock under expert parallelism: call keep_local_experts() before forward")
        gate_up, down = self.experts.weights()
        return block_forward(self.parts, hidden_states, self,
                             lambda x, indices, weights: megamoe(self.runner, x, indices, weights, gate_up, down,
                                                                self.experts.mx))

    def extra_repr(self) -> str:
        s = self.runner.spec
        return f"experts={s.experts}, top_k={s.top_k}, ep={s.ep}, schedule={s.schedule!r}"
