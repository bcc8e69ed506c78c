"""MoE load balancing and per-expert load: an auxiliary loss, or DeepSeek-V3's aux-loss-free bias update.

Every MoE block's router (its ``gate`` / ``router`` child: a transformers router, a MegaGate, a
Linear-like router; under expert parallelism too, where each rank routes its own tokens) gets a
forward hook that keeps the router's logits (the last output ``[T, E]``) and its choice (an integer
output, else the top-k of the logits) of every training forward.

- ``aux_loss``: ``E * sum_e f_e * P_e`` over the routers of a micro-batch, with ``f_e`` the share of
  their tokens whose top-k softmax probabilities include expert ``e`` (summing to k) and ``P_e`` the mean
  softmax probability of ``e`` (Switch Transformer; k when balanced), as transformers'
  ``load_balancing_loss_func`` computes it; times ``moe.aux_loss_coef``, added to the loss.
- ``bias``: after each optimizer step, every router's ``e_score_correction_bias`` (or ``expert_bias``,
  on the router or its block) moves by ``moe.bias_rate`` towards balance: ``+rate`` for experts below
  the mean load of the step, ``-rate`` above (DeepSeek-V3, section 2.1.2), from the loads summed over
  every rank, so replicated routers stay identical.

:meth:`Balance.step_loads` gives each router's per-expert share of the step's tokens (all ranks).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megaloom.models.hf_moe import BIAS_NAMES, ROUTER_NAMES, is_moe_block
from megaloom.runtime.errors import ConfigError


class Balance:
    """Router hooks of ``model`` and the ``moe`` section's balancing (see the module doc)."""

    def __init__(self, moe: dict, model_config: Any):
        routed = bool(getattr(model_config, "output_router_logits", False))
        self.mode = moe["balance"] if moe["balance"] != "auto" else "aux_loss" if routed else "none"
        coef = moe["aux_loss_coef"]
        self.coef = float(getattr(model_config, "router_aux_loss_coef", 0.001) if coef is None else coef)
        self.rate, self.top_k = moe["bias_rate"], int(getattr(model_config, "num_experts_per_tok", 0) or 0)
        model_config.output_router_logits = False  # the trainer adds the loss; transformers' own needs its routers

    def attach(self, model: nn.Module) -> Balance:
        """Hook the routers of ``model`` (as the replacement plan left them); checks the mode fits the model."""
        blocks = [(b, getattr(b, n)) for b in model.modules() if is_moe_block(b) for n in ROUTER_NAMES if hasattr(b, n)]
        self.routers = [r for _, r in blocks]
        self.biases = [next((getattr(m, n) for m in pair for n in BIAS_NAMES if torch.is_tensor(getattr(m, n, None))),
                            None) for pair in blocks]
        if self.mode != "none" and not self.routers:
            raise ConfigError(f"moe.balance: {self.mode} needs MoE blocks (a router and experts); the model has none")
        if self.mode == "bias" and None in self.biases:
            raise ConfigError(f"moe.balance: bias needs a correction bias ({' or '.join(BIAS_NAMES)}) on every "
                              f"router; {type(self.routers[self.biases.index(None)]).__name__} has none")
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        experts = [next(p for p in r.parameters() if p.dim() == 2).shape[0] for r in self.routers]
        self.counts = torch.zeros(len(self.routers), max(experts, default=0), dtype=torch.float64)
        self.recording = False
        for i, router in enumerate(self.routers):
            router.register_forward_hook(lambda mod, args, out, i=i: self._record(i, mod, out))
        return self

    def _record(self, i: int, router: nn.Module, out: Any) -> None:
        if not self.recording or not torch.is_grad_enabled():
            return
        outs = out if isinstance(out, tuple) else (out,)
        experts = self.counts.shape[1]
        logits = [t for t in outs if torch.is_tensor(t) and t.is_floating_point() and t.shape[-1] == experts]
        if not logits:
            raise ConfigError(f"moe: {type(router).__name__} returns no [tokens, {experts}] logits to balance")
        logits = logits[-1].reshape(-1, experts)
        k = int(getattr(router, "top_k", 0) or self.top_k)
        chosen = next((t for t in outs if torch.is_tensor(t) and not t.is_floating_point()), None)
        chosen = logits.topk(k, dim=-1).indices if chosen is None else chosen.reshape(-1, k)
        self.records.append((logits, chosen))
        self.counts[i] += torch.bincount(chosen.flatten(), minlength=experts).double().cpu()

    def forward(self) -> None:
        """Call before each training forward: hooks record that forward only (not a recomputation)."""
        self.records.clear()
        self.recording = bool(self.routers)

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the routers in the last forward (None unless ``aux_loss``)."""
        self.recording = False
        if self.mode != "aux_loss" or not self.records:
            return None
        probs = [torch.softmax(logits.float(), -1) for logits, _ in self.records]
        k, experts, rows = self.records[0][1].shape[-1], probs[0].shape[-1], sum(len(p) for p in probs)
        share = sum(torch.bincount(p.topk(k, -1).indices.flatten(), minlength=experts) for p in probs) / rows
        return experts * (share * sum(p.sum(0) for p in probs) / rows).sum()

    def step_loads(self, reduce) -> torch.Tensor | None:
        """Each router's per-expert share of the step's tokens on every rank (``reduce``: a mean over ranks);
        with ``bias``, the correction biases move towards balance. Resets the counts."""
        if not self.routers:
            return None
        counts, self.counts = reduce(self.counts), torch.zeros_like(self.counts)
        if self.mode == "bias" and counts.sum() > 0:
            with torch.no_grad():
                for bias, load in zip(self.biases, counts):
                    bias.add_(torch.sign(load.mean() - load).to(bias) * self.rate)
        return counts / counts.sum(-1, keepdim=True).clamp_min(1)
