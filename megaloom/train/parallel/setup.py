"""Parallel set-up of the trainer's model, and the gradient bookkeeping of a step.

Applied in place, in this order, after the replacement plan (which already gave MegaMoE
its expert-parallel communicator and kept each rank's experts):

1. tensor parallel over ``tp`` (:mod:`.tensor`), 2. context parallel over ``cp``
   (:mod:`.context`), 3. activation recomputation (:mod:`.recompute`, what it saves is
   measured and logged), 4. FSDP2 over ``dp x cp`` (:mod:`.fsdp`).

Gradients of a step (loss of every rank = the mean over its tokens):

- FSDP units: reduce-scattered and averaged over ``dp x cp`` by FSDP2;
- without FSDP: every gradient but the experts' is all-reduced and averaged over ``dp x cp``
  (tensor-parallel shards and replicated weights alike: ``tp`` ranks agree already);
- experts split by expert parallelism (``megaloom_ep_sharded``): the all-to-all already summed
  the gradient over the ``ep`` ranks' tokens; it is summed over the ``edp`` replicas and
  divided by ``dp x cp``.

The global gradient norm adds each rank's squares divided by how many ranks hold the same
piece, in one all-reduce. :meth:`Parallel.checkpoint_params` names every tensor with its
layout (DTensors carry their own; expert slices a ShardLayout), so checkpoints hold global
tensors and load under another world size or layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from megaloom.runtime.errors import ConfigError
from megaloom.train.optim import is_dtensor
from megaloom.train.parallel import context, recompute, tensor
from megaloom.train.parallel.clock import CommClock
from megaloom.train.parallel.mesh import Mesh


@dataclass(slots=True)
class Parallel:
    """The parallel model and how to feed and sync it."""

    model: nn.Module
    comm: Any
    mesh: Mesh
    clock: CommClock
    fsdp_units: list[nn.Module] = field(default_factory=list)
    ep_params: list[nn.Parameter] = field(default_factory=list)
    recompute: recompute.Recompute | None = None

    @property
    def world(self) -> int:
        return self.comm.world_size

    def inputs(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels, position ids) of ``tokens [B, S+1]`` (its part of the sequence under CP)."""
        return context.split(tokens, positions, self.mesh.coord("cp"), self.mesh.dims.cp)

    def set_sync(self, sync: bool) -> None:
        """Whether the next backward reduces gradients (False while accumulating micro-batches)."""
        if self.fsdp_units:
            self.model.set_requires_gradient_sync(sync)

    def sync_grads(self) -> None:
        ep_ids = {id(p) for p in self.ep_params}
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:  # a replicated DTensor weight fed by sharded inputs may hold partial sums
            if is_dtensor(p.grad) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        dims = self.mesh.dims
        if self.mesh.dp_cp is not None and not self.fsdp_units:
            _all_reduce(self.mesh.dp_cp, [_local(p.grad) for p in params if id(p) not in ep_ids], dims.dp_cp)
        experts = [p.grad for p in params if id(p) in ep_ids]
        if experts:
            if self.mesh.edp is not None:
                _all_reduce(self.mesh.edp, experts, 1)
            for g in experts:
                g.div_(dims.dp_cp)

    def grad_norm(self, params: list[nn.Parameter]) -> float:
        """Global L2 norm of the gradients of ``params`` (a collective)."""
        ep_ids = {id(p) for p in self.ep_params}
        total = torch.zeros(1, dtype=torch.float64)
        for p in params:
            g = p.grad  # each piece is held by world / pieces ranks
            pieces = (math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_shard())
                      if is_dtensor(g) else self.mesh.dims.ep if id(p) in ep_ids else 1)
            total += _local(g).detach().double().pow(2).sum() * pieces / self.world
        if self.world > 1:
            self.comm.all_reduce(total, "sum")
        return float(total.sqrt())

    def mean(self, value: torch.Tensor) -> float | torch.Tensor:
        """Mean of ``value`` over every rank: a float for one element, else a float64 tensor (a collective)."""
        t = value.detach().double().clone().reshape(-1)
        if self.world > 1:
            self.comm.all_reduce(t, "sum")
        t = (t / self.world).view(value.shape)
        return float(t) if t.numel() == 1 else t

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor, Any]]:
        """Every parameter and persistent buffer under its name in the model, with its layout: a DTensor
        (FSDP / TP) carries its own, an expert-parallel slice gets a ShardLayout, the rest None (replicated)."""
        from megaloom.comm.sharding import ShardLayout

        ep_ids = {id(p) for p in self.ep_params}
        ep, rank = self.mesh.dims.ep, self.mesh.coord("ep")
        return {name: (t, ShardLayout.of((t.shape[0] * ep, *t.shape[1:]), ep, rank, name) if id(t) in ep_ids else None)
                for name, t in self.model.state_dict(keep_vars=True).items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _all_reduce(comm: Any, grads: list[torch.Tensor], divide: int) -> None:
    """One flat all-reduce (sum) of ``grads`` in place, then divide by ``divide``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, "sum")
    flat.div_(divide)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def setup(model: nn.Module, par: dict, comm: Any, mesh: Mesh, clock: CommClock, log: Callable[[str], None],
          probe: Callable[[], Any]) -> Parallel:
    """Apply ``parallel`` (TP, CP, recomputation, FSDP) to ``model`` in place. ``probe()`` runs one forward
    of this rank's first micro-batch: with recomputation, what it keeps for backward is measured with it."""
    dims = mesh.dims
    experts = [p for p in model.parameters() if getattr(p, "megaloom_ep_sharded", False)]
    if dims.ep > 1 and not experts:
        raise ConfigError(f"parallel.ep_size: {dims.ep} needs MoE blocks swapped for MegaMoE with expert parallelism "
                          "(a replace rule with 'with: mega_moe'); none were")
    if dims.tp > 1:
        layout = tensor.apply(model, mesh.tp_mesh)
        log(f"tensor parallel over {dims.tp} ranks: {sum(k == 'colwise' for k in layout.values())} column-, "
            f"{sum(k == 'rowwise' for k in layout.values())} row-parallel Linear layers")
    if dims.cp > 1:
        n = context.apply(model, mesh.cp)
        log(f"context parallel over {dims.cp} ranks: {n} attention modules exchange keys and values")
    targets = recompute.targets(model, par["recompute"])
    rc = recompute.Recompute(targets) if targets else None
    if rc is not None:  # what it saves, measured on the probe
        with torch.random.fork_rng():
            rc.enabled = False
            kept = recompute.saved_bytes(model, probe)
            rc.enabled = True
            less = recompute.saved_bytes(model, probe, rc)
        mib = 2 ** 20
        log(f"recompute {len(rc.names)} module(s) ({rc.names[0]}{', ...' if len(rc.names) > 1 else ''}): activations "
            f"kept for backward per micro-batch {kept / mib:.2f} MiB -> {less / mib:.2f} MiB "
            f"({(kept - less) / mib:.2f} MiB saved)")
    units = []
    if par["fsdp"] and dims.dp_cp > 1:
        from megaloom.train.parallel import fsdp
        units = fsdp.apply(model, mesh.fsdp_mesh, par, set(experts), clock)
        log(f"FSDP2 over {dims.dp_cp} ranks: {len(units)} units (decoder layers and the root)")
    return Parallel(model, comm, mesh, clock, units, experts, rc)

