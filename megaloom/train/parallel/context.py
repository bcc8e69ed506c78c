"""Context parallelism for attention: each rank holds ``S / cp`` consecutive positions of every sequence.

Everything but attention works token by token, so only attention needs the other ranks:
its keys and values are all-gathered along the sequence (rank order is position order),
and this rank's queries attend causally to the positions before them:

    q  [B, H, S/cp, d]  positions  r*S/cp ... (r+1)*S/cp - 1
    K, V  all-gathered  [B, Hkv, S, d]      backward: gradients reduce-scattered (summed)

It plugs in as a transformers attention function (``AttentionInterface`` entry
``megaloom_cp``), so the model code is untouched; rotary embeddings get the global
positions through ``position_ids``. Supported: the attention of Qwen3-MoE and DeepSeek-V3
(MLA: keys and values of different head sizes) without sliding windows.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.runtime.errors import ConfigError

NAME = "megaloom_cp"
SUPPORTED = ("Qwen3MoeAttention", "DeepseekV3Attention")


class _GatherSequence(torch.autograd.Function):
    """``[B, H, s, d]`` on each rank -> ``[B, H, cp*s, d]``; backward sums the gradient over ranks and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.comm = comm
        local = x.movedim(2, 0).contiguous()
        full = local.new_empty((comm.world_size * local.shape[0], *local.shape[1:]))
        comm.all_gather(full, local)
        return full.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        full = grad.movedim(2, 0).contiguous()
        local = full.new_empty((full.shape[0] // comm.world_size, *full.shape[1:]))
        comm.reduce_scatter(local, full, "sum")
        return local.movedim(0, 2), None


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **_kwargs: Any):
    """The transformers attention-function signature; ``module.megaloom_cp`` is the context-parallel communicator."""
    comm = module.megaloom_cp
    key, value = _GatherSequence.apply(key, comm), _GatherSequence.apply(value, comm)
    s = query.shape[2]
    q_pos = torch.arange(s, device=query.device) + comm.rank * s
    causal = torch.arange(key.shape[2], device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def apply(model: nn.Module, comm: Any) -> int:
    """Route ``model``'s attention through :func:`attention` over ``comm``; returns the number of attention modules."""
    from transformers import AttentionInterface

    found = [m for m in model.modules() if type(m).__name__ in SUPPORTED]
    others = sorted({type(m).__name__ for m in model.modules()
                     if type(m).__name__.endswith("Attention") and type(m).__name__ not in SUPPORTED})
    if not found or others:
        raise ConfigError(f"parallel.cp_size: context parallelism supports {', '.join(SUPPORTED)}; "
                          f"the model has {', '.join(others) or 'no attention of these kinds'}")
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", False):
        raise ConfigError("parallel.cp_size: context parallelism does not support sliding-window attention "
                          "(model.config.use_sliding_window)")
    AttentionInterface.register(NAME, attention)
    for m in found:
        m.megaloom_cp = comm
    model.set_attn_implementation(NAME)
    return len(found)


def split(tokens: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``tokens [B, S+1]`` -> this rank's (inputs, labels, position ids) of part ``rank`` of ``size``."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if size == 1:
        return inputs, labels, None
    s = inputs.shape[1] // size
    part = slice(rank * s, (rank + 1) * s)
    positions = torch.arange(rank * s, (rank + 1) * s).expand(inputs.shape[0], -1)
    return inputs[:, part], labels[:, part], positions
