"""A small MoE training step on the ranks of a gloo group, at an expert-parallel degree of 1
(every rank holds every expert; expert gradients all-reduced like the others) or of the
world size (each rank holds its share of the experts; tokens go to them and back with
``all_to_all_single``, forward and backward; expert gradients stay on their rank).

Each layer: a dense projection, a top-k router, and the experts (ReLU MLPs, one ``bmm`` per
matrix over the rank's experts) under the ``experts`` annotation. Every expert takes a fixed
capacity of token slots (tokens over capacity dropped, empty slots zero), so both degrees do
the same expert work per rank and the all-to-alls have equal splits.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

D, FFN, EXPERTS, TOP_K, TOKENS, LAYERS = 256, 512, 8, 2, 512, 2
CAPACITY = TOKENS * TOP_K // EXPERTS
"""Token slots per expert on each rank."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits; its gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous())
        return out


class MoELayer(nn.Module):
    """One layer; with ``ep`` > 1 this rank holds experts ``[rank * E / ep, (rank + 1) * E / ep)``."""

    def __init__(self, ep: int, rank: int):
        super().__init__()
        local, first = EXPERTS // ep, rank % ep * (EXPERTS // ep)
        self.ep, self.proj, self.router = ep, nn.Linear(D, D), nn.Linear(D, EXPERTS)
        w1, w2 = torch.randn(EXPERTS, D, FFN) * D ** -0.5, torch.randn(EXPERTS, FFN, D) * FFN ** -0.5
        self.w1 = nn.Parameter(w1[first:first + local].clone())
        self.w2 = nn.Parameter(w2[first:first + local].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.proj(x))
        weights, chosen = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        starts = torch.bincount(flat, minlength=EXPERTS).cumsum(0) - torch.bincount(flat, minlength=EXPERTS)
        pos = torch.arange(flat.numel()) - starts[flat[order]]
        keep = order[pos < CAPACITY]
        slots = flat[keep] * CAPACITY + pos[pos < CAPACITY]
        tokens = keep // TOP_K
        with record_function("experts"):
            h = x.new_zeros(EXPERTS * CAPACITY, D).index_copy(0, slots, x[tokens])
            if self.ep > 1:  # [EXPERTS, C, D] -> [ep sources, local experts, C, D]
                h = _AllToAll.apply(h)
            local = EXPERTS // self.ep
            h = h.view(self.ep, local, CAPACITY, D).transpose(0, 1).reshape(local, self.ep * CAPACITY, D)
            h = torch.bmm(torch.relu(torch.bmm(h, self.w1)), self.w2)
            h = h.view(local, self.ep, CAPACITY, D).transpose(0, 1).reshape(EXPERTS * CAPACITY, D)
            if self.ep > 1:
                h = _AllToAll.apply(h)
        return x + torch.zeros_like(x).index_add(0, tokens, h[slots] * weights.flatten()[keep, None])


def step(ep: int) -> Callable[[], None]:
    """One training step of ``LAYERS`` layers on this rank's tokens, at expert-parallel degree
    ``ep`` (1, or the world size): backward, gradient all-reduces, SGD."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if ep not in (1, world):
        raise ValueError(f"expert-parallel degree {ep}: 1 or the world size ({world})")
    torch.manual_seed(0)
    layers = nn.Sequential(*(MoELayer(ep, rank) for _ in range(LAYERS)))
    dense = [p for n, p in layers.named_parameters() if not n.endswith(("w1", "w2"))]
    experts = [p for n, p in layers.named_parameters() if n.endswith(("w1", "w2"))]
    opt = torch.optim.SGD(layers.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    x = torch.randn(TOKENS, D)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        layers(x).square().mean().backward()
        for p in dense:
            dist.all_reduce(p.grad)
        if ep == 1:  # the experts' data-parallel group: every rank
            with record_function("experts.grad_sync"):
                for p in experts:
                    dist.all_reduce(p.grad)
        opt.step()
    return run
