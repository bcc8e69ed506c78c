"""megaloom modules for transformers models: MegaMoE for MoE blocks, MegaGate for their
routers (MXFP8Linear for ``nn.Linear`` comes from :mod:`megaloom.models.plan`).

Every swap keeps the model's own Parameters (by identity) under the original names, so
state_dict keys, optimizer state and checkpoints are unchanged:

- :class:`MegaMoEBlock` keeps the block's ``gate``, ``experts`` and ``shared_experts``
  submodules and runs the routed experts through the MegaMoE graphs, passing the
  transformers weights ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` as
  transposed *views* (MegaMoE's layout is ``[E, H, 2I]`` / ``[E, I, H]``): no copy.
  Under expert parallelism, :meth:`MegaMoEBlock.keep_local_experts` (run after the
  swap) re-registers each rank's ``E / ep`` experts as Parameters that are views of the
  same storage: no copy, but the full tensor's storage stays allocated.
- :class:`MegaGateRouter` is a MegaGate around the router's own ``weight`` Parameter
  (and DeepSeek's ``e_score_correction_bias`` buffer), returning the transformers
  router's ``(logits, weights, indices)``.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from megaloom.models.hf_moe import MoEBlockParts, block_parts
from megaloom.runtime.errors import ConfigError


GATE_SCORES = {"Qwen3MoeTopKRouter": "softmax", "DeepseekV3TopkRouter": "sigmoid"}  # router class -> MegaGate score


def moe_problems(block: nn.Module, ep: int) -> list[str]:
    """Why ``block`` cannot become a :class:`MegaMoEBlock` on ``ep`` ranks (empty: it can)."""
    try:
        parts = block_parts(block)
    except ConfigError as e:
        return [str(e)]
    problems = []
    if parts.act_name != "silu":
        problems.append(f"MegaMoE runs SwiGLU experts; the block's activation is {parts.act_name!r}")
    if parts.num_experts % ep:
        problems.append(f"{parts.num_experts} experts do not split over parallel.ep_size={ep} ranks")
    return problems


def gate_problems(router: nn.Module) -> list[str]:
    """Why ``router`` cannot become a :class:`MegaGateRouter` (empty: it can)."""
    name = type(router).__name__
    if name not in GATE_SCORES:
        return [f"{name} is not a supported router; supported: {', '.join(GATE_SCORES)}"]
    groups, top_groups = getattr(router, "num_group", 1), getattr(router, "topk_group", 1)
    if groups > 1 and top_groups < groups:
        return [f"{name} limits selection to {top_groups} of {groups} expert groups; MegaGate has no group limit "
                "(set n_group=1 or topk_group=n_group)"]
    return []


@functools.cache
def _megagate_cls() -> type:
    """MegaGateRouter, defined on first use (importing the graphs layer only then)."""
    from megaloom.graphs.gate.module import MegaGate

    class MegaGateRouter(MegaGate):
        """MegaGate returning the transformers router's ``(logits, weights, indices)``."""

        def forward(self, x: torch.Tensor):
            out = super().forward(x)
            return out.logits, out.weights, out.indices

    return MegaGateRouter


def make_gate(router: nn.Module, **options: Any) -> nn.Module:
    """A MegaGate over ``router``'s own weight Parameter (and correction-bias buffer), same state_dict keys.

    Its graphs run on a ThreadExecutor whose traces ``gate.graph_traces`` (a GraphTraces) keeps.
    """
    from megaloom.runtime.executors import ThreadExecutor
    from megaloom.train.step_trace import GraphTraces

    problems = gate_problems(router)
    if problems:
        raise ConfigError("; ".join(problems))
    experts, hidden = router.weight.shape
    traces = GraphTraces()
    gate = _megagate_cls()(hidden, experts, int(router.top_k), score=GATE_SCORES[type(router).__name__],
                           scale=float(getattr(router, "routed_scaling_factor", 1.0)),
                           renorm=bool(router.norm_topk_prob), dtype=router.weight.dtype,
                           executor=ThreadExecutor(observers=[traces]), **options)
    gate.graph_traces = traces
    gate.weight = router.weight  # the model's own Parameter
    bias = getattr(router, "e_score_correction_bias", None)
    # MegaGate reads ``bias``; keep it out of the state_dict, under the router's own name when it has one
    gate.register_buffer("bias", bias if bias is not None else gate.bias, persistent=False)
    if bias is not None:
        gate.register_buffer("e_score_correction_bias", bias)
    return gate


class MegaMoEBlock(nn.Module):
    """A transformers MoE block whose routed experts run as the MegaMoE task graphs.

    ``comm`` (a megaloom Communicator) with ``world_size > 1`` enables expert
    parallelism: this rank owns experts ``[rank * E/ep, (rank + 1) * E/ep)``.
    ``options`` go to :class:`megaloom.graphs.moe.module.MegaMoERunner`
    (``executor``, ``units``, ``policy``) or to the spec (``tile_m``, ``schedule``, ...).
    """

    def __init__(self, block: nn.Module, comm: Any = None, gate: nn.Module | None = None, **options: Any):
        super().__init__()
        from megaloom.graphs.moe.module import MegaMoERunner
        from megaloom.graphs.moe.spec import MegaMoESpec

        parts: MoEBlockParts = block_parts(block)
        ep = getattr(comm, "world_size", 1)
        problems = moe_problems(block, ep)
        if problems:
            raise ConfigError(f"{type(block).__name__}: {'; '.join(problems)}")
        for name, child in block.named_children():  # same names, same order: same state_dict keys
            setattr(self, name, gate if name == "gate" and gate is not None else child)
        # self.experts holds gate_up_proj / down_proj: the model's own Parameters
        self.num_experts, self.top_k = parts.num_experts, parts.top_k
        runner_keys = {"executor", "units", "policy", "cache_size"}
        spec = MegaMoESpec(tokens=1, hidden=parts.hidden, intermediate=parts.inter, experts=parts.num_experts,
                           top_k=parts.top_k, ep=ep, dtype=str(parts.gate_up.dtype).removeprefix("torch."),
                           **{k: v for k, v in options.items() if k not in runner_keys})
        self.runner = MegaMoERunner(spec, comm, **{k: v for k, v in options.items() if k in runner_keys})
        self.local_experts = ep == 1  # under EP, true once keep_local_experts() ran

    def keep_local_experts(self) -> None:
        """Under EP: re-register the expert weights as views of this rank's experts only (no copy)."""
        spec, rank = self.runner.spec, self.runner.rank
        if self.local_experts:
            return
        lo, n = rank * spec.experts_local, spec.experts_local
        for name in ("gate_up_proj", "down_proj"):
            local = nn.Parameter(getattr(self.experts, name).detach()[lo:lo + n])  # shares storage
            local.megaloom_ep_sharded = True
            setattr(self.experts, name, local)
        self.local_experts = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from megaloom.graphs.moe.module import MegaMoEFunction

        if not self.local_experts:
            raise ConfigError("MegaMoEBlock under expert parallelism: call keep_local_experts() before forward")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, indices = self.gate(x)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        y = MegaMoEFunction.apply(self.runner, x, indices, weights.to(gate_up.dtype),
                                  gate_up.transpose(1, 2), down.transpose(1, 2)).view(shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(hidden_states)
        return y

    def extra_repr(self) -> str:
        s = self.runner.spec
        return f"experts={s.experts}, top_k={s.top_k}, ep={s.ep}, schedule={s.schedule!r}"
