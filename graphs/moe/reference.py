"""The golden MoE expert block in plain eager torch (autograd gives every gradient): the one
eager MoE of megaloom, in MegaMoE's weight layout. Other layouts pass views: a transformers
block's ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` are ``gate_up.transpose(1, 2)`` /
``down.transpose(1, 2)`` here (see :func:`megaloom.models.hf_moe.block_forward`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                  mx: str | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t])`` with all experts local.

    Permute rows by expert, run each expert's gated MLP ``(act(g) * u) @ down[e]`` with
    ``[g | u] = x @ gate_up[e]`` (``gate_up [E, H, 2I]``, ``down [E, I, H]``; ``act`` SiLU:
    SwiGLU) on its rows, unpermute, and take the weighted sum over top-k (weights in x's dtype).
    ``mx``: the two GEMMs (and their gradients) as MXFP8 grouped linears with this scale rule
    (:func:`megaloom.ops.mxfp8.mx_grouped_linear`), the oracle of MegaMoE's MXFP8 graphs.
    """
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    if mx:
        from megaloom.ops.mxfp8 import mx_grouped_linear

        offs = torch.tensor(counts).cumsum(0).tolist()
        g, u = mx_grouped_linear(xs, gate_up.transpose(1, 2), offs, mx).chunk(2, dim=-1)
        y = mx_grouped_linear(act(g) * u, down.transpose(1, 2), offs, mx)
    else:
        ys, at = [], 0
        for e, n in enumerate(counts):
            g, u = (xs[at:at + n] @ gate_up[e]).chunk(2, dim=-1)
            ys.append((act(g) * u) @ down[e])
            at += n
        y = torch.cat(ys, 0)
    y_tok = torch.empty_like(y).index_copy(0, order, y).view(T, k, -1)
    return (y_tok * topk_weights.to(y.dtype)[..., None]).sum(1)
