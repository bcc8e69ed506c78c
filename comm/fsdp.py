"""``fully_shard``: keep only this rank's uneven dim-0 shard of every parameter.

Forward gathers each full parameter (padded all-gather, narrowed back); backward
reduce-scatters its gradient (padded, ``avg`` over ranks by default, narrowed to the
shard). With each rank training on its own equal slice of the batch, a step on the
shards equals a step of the unsharded module on the whole batch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megaloom.comm.communicator import Communicator, check_reduce_op
from megaloom.comm.sharding import ShardLayout, gather_uneven, reduce_scatter_uneven


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, comm: Communicator, layout: ShardLayout, op: str) -> torch.Tensor:
        ctx.comm, ctx.layout, ctx.op = comm, layout, op
        full = shard.new_empty(layout.shape)
        gather_uneven(comm, shard.detach(), list(layout.sizes), full)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(ctx.layout.local_shape)
        reduce_scatter_uneven(ctx.comm, grad.contiguous(), list(ctx.layout.sizes), out, ctx.op)
        return out, None, None, None


def _key(fqn: str) -> str:
    return fqn.replace(".", "__")


class ShardedModule(nn.Module):
    """A module whose parameters are uneven shards; see :func:`fully_shard`.

    ``parameters()`` yields the shards (give them to any element-wise optimizer);
    ``layouts`` maps each parameter's name in the wrapped module to its :class:`ShardLayout`.
    """

    def __init__(self, module: nn.Module, comm: Communicator, reduce_op: str = "avg"):
        super().__init__()
        self.comm, self.reduce_op = comm, check_reduce_op(reduce_op)
        object.__setattr__(self, "inner", module)  # not a submodule: parameters() are the shards only
        self.layouts: dict[str, ShardLayout] = {}
        self.shards = nn.ParameterDict()
        for fqn, p in list(module.named_parameters()):
            lay = ShardLayout.of(tuple(p.shape), comm.world_size, comm.rank, fqn)
            self.layouts[fqn] = lay
            self.shards[_key(fqn)] = nn.Parameter(lay.shard(p.detach()).clone(), requires_grad=p.requires_grad)
            p.requires_grad_(False)
            p.data = p.data.new_empty(0)  # the full copy is gathered on demand

    def shard(self, fqn: str) -> nn.Parameter:
        """This rank's shard of parameter ``fqn`` of the wrapped module."""
        return self.shards[_key(fqn)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        full = {fqn: _Gather.apply(self.shard(fqn), self.comm, lay, self.reduce_op) for fqn, lay in self.layouts.items()}
        return torch.func.functional_call(self.inner, full, args, kwargs)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter, gathered (a collective: call it on every rank)."""
        out = {}
        for fqn, lay in self.layouts.items():
            out[fqn] = torch.empty(lay.shape, dtype=self.shard(fqn).dtype)
            gather_uneven(self.comm, self.shard(fqn).detach(), list(lay.sizes), out[fqn])
        return out


def fully_shard(module: nn.Module, comm: Communicator, reduce_op: str = "avg") -> ShardedModule:
    """Shard every parameter of ``module`` over ``comm``'s ranks (dim 0, first N mod W ranks +1 row).

    A parameter with fewer rows than ranks raises CommError naming it. The module's own
    parameters are emptied; use the returned wrapper for forward, backward and the optimizer.
    """
    return ShardedModule(module, comm, reduce_op)
