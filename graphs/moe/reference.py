"""The golden MoE expert block in plain eager torch (autograd gives every gradient): the one
eager MoE of megaloom, in MegaMoE's weight layout. Other layouts pass views: a transformers
block's ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` are ``gate_up.transpose(1, 2)`` /
``down.transpose(1, 2)`` here (see :func:`megaloom.models.hf_moe.block_forward`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t])`` with all experts local.

    Permute rows by expert, run each expert's gated MLP ``(act(g) * u) @ down[e]`` with
    ``[g | u] = x @ gate_up[e]`` (``gate_up [E, H, 2I]``, ``down [E, I, H]``; ``act`` SiLU:
    SwiGLU) on its rows, unpermute, and take the weighted sum over top-k (weights in x's dtype).
    """
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    ys, at = [], 0
    for e, n in enumerate(counts):
        g, u = (xs[at:at + n] @ gate_up[e]).chunk(2, dim=-1)
        ys.append((act(g) * u) @ down[e])
        at += n
    y = torch.cat(ys, 0)
    y_tok = torch.empty_like(y).index_copy(0, order, y).view(T, k, -1)
    return (y_tok * topk_weights.to(y.dtype)[..., None]).sum(1)
