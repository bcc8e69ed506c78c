"""Optimizers of the trainer: AdamW, SGD, and Muon for weight matrices with AdamW for the rest.

:class:`Muon` is ``torch.optim.Muon``'s update (momentum, Newton-Schulz orthogonalisation
and learning-rate adjustment are torch's own functions) on parameters the trainer may
have sharded. The orthogonalisation needs a whole matrix, so:

- a DTensor matrix (an FSDP2 or tensor-parallel shard) has its update all-gathered, each
  rank orthogonalises the whole matrix and keeps its own shard of the result;
- a stack of expert matrices ``[E, A, B]`` is orthogonalised matrix by matrix; when it is
  split only along the expert dimension (FSDP2 shards, expert-parallel slices), every rank
  holds whole matrices and works on its own, without communication.

Either way a sharded step equals the unsharded one. ``make_optimizer`` with ``muon``
gives Muon the 2-D weights (but embeddings and the output head) and the expert stacks,
AdamW everything else, stepped together as one :class:`Chained` optimizer.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from megaloom.runtime.errors import ConfigError


class Chained:
    """Optimizers over disjoint parameters stepped as one: a shared ``state`` and one ``param_groups`` list."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        self.state: defaultdict = defaultdict(dict)
        for opt in optimizers:
            self.state.update(opt.state)
            opt.state = self.state  # parameters are disjoint, so one mapping serves all
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _torch_muon():
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError:  # pragma: no cover - torch < 2.9
        raise ConfigError("optimizer.name: muon needs torch.optim.Muon (torch >= 2.9)") from None
    return _zeropower_via_newtonschulz, _adjust_lr


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for 2-D matrices and ``[E, A, B]`` stacks, plain or DTensor (see the module doc)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None):
        self._ns, self._adjust = _torch_muon()
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))
        bad = [tuple(p.shape) for group in self.param_groups for p in group["params"] if p.ndim not in (2, 3)]
        if bad:
            raise ValueError(f"Muon takes matrices or stacks of them, got a parameter of shape {bad[0]}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mu)  # element-wise: shards need nothing from other ranks
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = self._orthogonalise(update, group)
                local = p.to_local() if is_dtensor(p) else p
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(ortho, alpha=-self._adjust(lr, group["adjust_lr_fn"], p.shape[-2:]))

    def _orthogonalise(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        """This rank's part of the orthogonalised ``update`` (in the layout of its parameter)."""
        def ns(t: torch.Tensor) -> torch.Tensor:  # a matrix, or a stack of them matrix by matrix
            if t.ndim == 3:
                return torch.stack([ns(m) for m in t])
            return self._ns(t, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if not is_dtensor(update):
            return ns(update)
        if update.ndim == 3 and all(not pl.is_shard() or pl.dim == 0 for pl in update.placements):
            return ns(update.to_local())  # whole expert matrices on this rank
        return _local_part(ns(update.full_tensor()), update)


def is_dtensor(t: Any) -> bool:
    """True for a torch DTensor (FSDP2 and tensor-parallel parameters and their gradients)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_part(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The part of global ``full`` that DTensor ``like`` keeps on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        full = full.narrow(dim, start, size)
    return full


def muon_params(model: nn.Module) -> set[int]:
    """ids of the parameters Muon takes: matrices and expert stacks, not embeddings or the output head."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    skip |= {id(p) for p in head.parameters()} if head is not None else set()
    return {id(p) for p in model.parameters() if p.ndim in (2, 3) and id(p) not in skip}


def make_optimizer(model: nn.Module, opt: dict) -> Any:
    """The optimizer a validated ``optimizer`` section describes, over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if opt["name"] == "sgd":
        return torch.optim.SGD(params, lr=opt["lr"], momentum=opt["momentum"], weight_decay=opt["weight_decay"])

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                 weight_decay=opt["weight_decay"], foreach=False)
    if opt["name"] == "adamw":
        return adamw(params)
    take = muon_params(model)
    matrices = [p for p in params if id(p) in take]
    muon = Muon(matrices, lr=opt["lr"], weight_decay=opt["weight_decay"], momentum=opt["muon_momentum"],
                adjust_lr_fn=opt["muon_adjust_lr"])
    rest = [p for p in params if id(p) not in take]
    return Chained(muon, adamw(rest)) if rest else muon
