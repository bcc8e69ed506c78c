"""Parallel set-up for the trainer: data parallel, FSDP (``megaloom.comm.fsdp``) and expert parallel.

Every rank reads its own batch (data parallel over the whole world); ``ep_size`` is 1
or the world size (EP x DP sub-groups are not supported yet). Gradients:

- with ``fsdp``, every module holding parameters (but not MegaMoE experts) is wrapped by
  ``fully_shard`` (uneven dim-0 shards): gradients reduce-scattered (averaged) in backward;
- expert weights owned by one EP rank (``megaloom_ep_sharded`` attribute, set by
  ``MegaMoEBlock.keep_local_experts``): their gradients already sum every rank's tokens
  through the all-to-all, so they are divided by ``ep_size`` (the mean over batches);
- every other parameter is replicated: its gradient is all-reduced and averaged.

The global gradient norm sums the squares of sharded gradients over ranks.
:meth:`Parallel.checkpoint_params` names every tensor with its shard layout, so
checkpoints hold global tensors and load under another world size or layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaloom.runtime.errors import ConfigError


@dataclass(slots=True)
class Parallel:
    """The wrapped model and how to sync it; ``data_rank``/``data_world`` pick batches."""

    model: nn.Module
    comm: Any
    data_rank: int
    data_world: int
    ep_size: int
    sharded: set[int] = field(default_factory=set)   # id() of parameters that are rank-local shards

    @property
    def world(self) -> int:
        return self.comm.world_size

    def sync_grads(self) -> None:
        if self.world == 1:
            return
        replicated = [p for p in self.model.parameters() if p.grad is not None and id(p) not in self.sharded]
        _all_reduce_mean(self.comm, [p.grad for p in replicated], self.world)
        for p in self.model.parameters():  # EP experts: summed over every rank's tokens -> mean over batches
            if p.grad is not None and getattr(p, "megaloom_ep_sharded", False):
                p.grad.div_(self.ep_size)

    def grad_norm(self, params: list[nn.Parameter]) -> float:
        local = torch.zeros(2, dtype=torch.float64)
        for p in params:
            sq = p.grad.detach().double().pow(2).sum()
            local[0 if id(p) in self.sharded else 1] += sq
        if self.world > 1:
            self.comm.all_reduce(local[:1], "sum")
        return float(local.sum().sqrt())

    def mean(self, value: torch.Tensor) -> float:
        t = value.detach().double().reshape(1).clone()
        if self.world > 1:
            self.comm.all_reduce(t, "sum")
        return float(t[0] / self.world)

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor, Any]]:
        """Every parameter and persistent buffer under its unwrapped-model name, with its ShardLayout
        (FSDP shard, expert-parallel slice) or None (replicated): what ``megaloom.comm.checkpoint`` saves."""
        from megaloom.comm.fsdp import ShardedModule
        from megaloom.comm.sharding import ShardLayout

        out: dict[str, tuple[torch.Tensor, Any]] = {}
        wrapped: set[int] = set()
        for path, mod in self.model.named_modules():
            if isinstance(mod, ShardedModule):
                out |= {f"{path}.{fqn}": (mod.shard(fqn), lay) for fqn, lay in mod.layouts.items()}
                out |= {f"{path}.{k}": (b, None) for k, b in mod.inner.state_dict(keep_vars=True).items()
                        if not isinstance(b, nn.Parameter)}
                wrapped |= {id(p) for p in mod.parameters()}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in wrapped:
                continue
            lay = None
            if getattr(t, "megaloom_ep_sharded", False):  # this rank's experts: rows rank*E/ep of E
                lay = ShardLayout.of((t.shape[0] * self.ep_size, *t.shape[1:]), self.ep_size, self.comm.rank, name)
            out[name] = (t, lay)
        return out


def _all_reduce_mean(comm: Any, grads: list[torch.Tensor], world: int) -> None:
    """One flat all-reduce for all ``grads`` (in place), then divide by ``world``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, "sum")
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def setup(model: nn.Module, par: dict, comm: Any) -> Parallel:
    """Check ``parallel`` against the world and the model, then shard as asked (in place)."""
    world, ep = comm.world_size, par["ep_size"]
    if world % ep:
        raise ConfigError(f"parallel.ep_size: {ep} does not divide the world size {world}")
    experts = [p for p in model.parameters() if getattr(p, "megaloom_ep_sharded", False)]
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.ep_size: {ep} needs MoE blocks swapped for MegaMoE with expert parallelism "
                          "(a replace rule with 'with: mega_moe'); none were")
    sharded = {id(p) for p in experts}
    if par["fsdp"] and world > 1:
        sharded |= fsdp_leaves(model, comm)
    return Parallel(model, comm, comm.rank, world, ep, sharded)


def fsdp_leaves(model: nn.Module, comm: Any) -> set[int]:
    """``fully_shard`` every module that holds parameters of its own; returns the shards' ids.

    Each is swapped in place for its ShardedModule (full weights gathered just before its
    forward, gradients reduce-scattered in its backward). Left alone: expert weights of a
    MegaMoE block (EP-sharded, or replicated when ``ep_size`` is 1, since MegaMoE reads them
    directly) and modules without parameters of their own.
    """
    from megaloom.comm.fsdp import fully_shard
    from megaloom.models.swaps import MegaMoEBlock

    keep = {id(m.experts) for m in model.modules() if isinstance(m, MegaMoEBlock)}
    targets, problems = [], []
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        if not name or not own or id(mod) in keep:
            continue
        if len(own) != len(list(mod.parameters())):
            problems.append(f"{name} ({type(mod).__name__}) holds parameters itself and in submodules")
        targets.append((name, mod))
    if problems:
        raise ConfigError("parallel.fsdp: cannot shard module by module: " + "; ".join(problems))
    shards: set[int] = set()
    for name, mod in targets:
        wrapped = fully_shard(mod, comm)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, wrapped)
        shards |= {id(p) for p in wrapped.parameters()}
    return shards
