"""Context parallelism for attention: each rank holds ``S / cp`` consecutive positions of every sequence.

Everything but attention works token by token, so only attention needs the other ranks:
its keys and values are all-gathered along the sequence (rank order is position order),
and this rank's queries attend causally to the positions before them, within their document
(packed rows: a document starts where ``position_ids``, gathered too, restart at 0) and within
the layer's sliding window if it has one:

    q  [B, H, S/cp, d]  row positions  r*S/cp ... (r+1)*S/cp - 1
    K, V  all-gathered  [B, Hkv, S, d]      backward: gradients reduce-scattered (summed)

It plugs in as a transformers attention function (``AttentionInterface`` entry
``megaloom_cp``), so the model code is untouched; rotary embeddings get the positions through
``position_ids``. Supported: every model whose attention runs through transformers' SDPA
interface (``_supports_sdpa``; keys and values may differ in head size, as in MLA), without
attention sinks or chunked attention.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.runtime.errors import ConfigError

NAME = "megaloom_cp"


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
              attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
              sliding_window: int | None = None, position_ids: torch.Tensor | None = None, **kwargs: Any):
    """The transformers attention-function signature; ``module.megaloom_cp`` is the context-parallel communicator."""
    comm = module.megaloom_cp
    if position_ids is None or kwargs.get("s_aux") is not None:
        raise ConfigError(f"parallel.cp_size: {type(module).__name__} passes no position_ids to its attention, or "
                          "attention sinks, which context parallelism does not take")
    key, value = _GatherSequence.apply(key, comm), _GatherSequence.apply(value, comm)
    positions = _GatherSequence.apply(position_ids.expand(query.shape[0], -1)[:, None, :, None], comm)[:, 0, :, 0]
    docs = (positions == 0).cumsum(1)  # [B, S]: the document of every position (its positions restart at 0)
    s = query.shape[2]
    q_idx = torch.arange(s, device=query.device) + comm.rank * s
    k_idx = torch.arange(key.shape[2], device=query.device)
    mask = (k_idx[None, :] <= q_idx[:, None]) & (docs[:, q_idx, None] == docs[:, None, :])
    if sliding_window:
        mask &= (q_idx[:, None] - k_idx[None, :] < sliding_window)[None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def apply(model: nn.Module, comm: Any) -> int:
    """Route ``model``'s attention through :func:`attention` over ``comm``; returns the number of attention modules."""
    from transformers import AttentionInterface

    found = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    chunked = getattr(model.config, "attention_chunk_size", None)
    if not found or not getattr(model, "_supports_sdpa", False) or chunked:
        raise ConfigError(f"parallel.cp_size: context parallelism takes attention through transformers' SDPA "
                          f"interface; {type(model).__name__} has " + ("chunked attention" if chunked else
                          "no such attention"))
    AttentionInterface.register(NAME, attention)
    for m in found:
        m.megaloom_cp = comm
    model.set_attn_implementation(NAME)
    return len(found)


def split(tokens: torch.Tensor, positions: torch.Tensor | None, rank: int, size: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens [B, S+1]`` and their ``positions`` in their documents (None: one document a row) -> this
    rank's (inputs, labels, position ids) of part ``rank`` of ``size``; a document's first token is no label (-100)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens) if positions is None else positions
    labels = tokens[:, 1:].masked_fill(positions[:, 1:] == 0, -100)
    s = (tokens.shape[1] - 1) // size
    part = slice(rank * s, (rank + 1) * s)
    return tokens[:, part], labels[:, part], positions[:, part]
