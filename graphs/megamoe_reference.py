"""The golden MoE expert block in plain eager torch (autograd gives every gradient)."""
from __future__ import annotations

import torch

from megaloom.graphs.ops_moe import swiglu


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t])`` with all experts local.

    Permute rows by expert, run each expert's SwiGLU MLP (``gate_up [E, H, 2I]``,
    ``down [E, I, H]``) on its rows, unpermute, and take the weighted sum over top-k.
    """
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    ys, at = [], 0
    for e, n in enumerate(counts):
        ys.append(swiglu(xs[at:at + n] @ gate_up[e]) @ down[e])
        at += n
    y = torch.cat(ys, 0)
    y_tok = torch.empty_like(y).index_copy(0, order, y).view(T, k, -1)
    return (y_tok * topk_weights[..., None]).sum(1)
