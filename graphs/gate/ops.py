"""Vector tile ops of MegaGate: score + biased top-k selection, and its backward.

| op             | engine | what it computes (one token shard)                                        |
|----------------|--------|---------------------------------------------------------------------------|
| gate_topk      | vector | scores of the logits, top-k of scores + bias, gathered, renormalised, scaled |
| gate_topk_bwd  | vector | d logits from d weights (selection fixed) plus the logits' own gradient      |

Attributes of both: ``top_k``, ``score`` (``softmax``, ``sigmoid`` or ``sqrtsoftplus``:
sqrt(softplus(x)); ``gate_topk`` also takes ``given``: its first operand already holds the scores,
as a ``dvm.fused`` scoring task wrote them), ``scale`` (routed scaling factor), ``renorm`` (renormalise the k
weights to sum 1 before scaling; applied only when ``top_k > 1``), ``n_group`` and
``topk_group`` (group-limited selection, as DeepSeek-V3: the experts form ``n_group`` equal
groups, each scored by the sum of its two best biased scores, and only the experts of the
``topk_group`` best groups can be picked). The correction bias only moves the selection:
weights are gathered from the unbiased scores.

The references are literal torch; ``gate_topk_bwd``'s reference is the
``torch.autograd.functional.vjp`` of ``gate_topk``'s weights, its kernel the analytic
gradient below (tests check one against the other):

    w = scale * s_I / (sum_I s + eps)     ds_I = scale * (g / D - sum(g s_I) / D^2),  D = sum_I s + eps
    softmax: dl = s * (ds - sum(ds s))    sigmoid: dl = ds s (1 - s)    sqrtsoftplus: dl = ds sigmoid(l) / (2 s)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaloom.graphs.common.ops import io_bytes
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import VECTOR, Cost, GradOf, OpDef, TensorSpec, register

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
GIVEN = "given"  # gate_topk's score when a fused scoring task computed the scores
RENORM_EPS = 1e-20  # keeps the renormalisation finite when every selected score underflows


def scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """Routing scores of float logits, by the named score function (``given``: the logits are the scores)."""
    if score == GIVEN:
        return logits
    if score == "softmax":
        return logits.softmax(-1)
    if score == "sigmoid":
        return logits.sigmoid()
    if score == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise GraphError(f"unknown gate score {score!r}; known: {', '.join(SCORES)}")


def select(s: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """Indices [t, k] of the top-k of scores ``s`` + correction bias (sorted, largest first), within the
    ``topk_group`` best of ``n_group`` expert groups (a group's score: the sum of its two best)."""
    biased = s + bias
    if n_group > 1 and topk_group < n_group:
        t, e = biased.shape
        grouped = biased.view(t, n_group, e // n_group)
        group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=s.device)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    return torch.topk(biased, top_k, dim=-1).indices


def combine(s: torch.Tensor, indices: torch.Tensor, top_k: int, scale: float, renorm: bool) -> torch.Tensor:
    """Weights [t, k]: the selected scores, renormalised over the k when asked, times ``scale``."""
    w = s.gather(-1, indices)
    if renorm and top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
    return w * scale


def _topk_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 2 or len(ins[0].shape) != 2 or ins[1].shape != ins[0].shape[1:]:
        raise GraphError(f"gate_topk takes logits [t, E] and bias [E], got {[s.shape for s in ins]}")
    k, e = int(attrs["top_k"]), ins[0].shape[1]
    if not 0 < k <= e:
        raise GraphError(f"gate_topk: top_k={k} outside 1..{e} experts")
    groups, top = int(attrs.get("n_group", 1)), int(attrs.get("topk_group", 1))
    if groups > 1 and (e % groups or not 0 < top <= groups or k > top * (e // groups)):
        raise GraphError(f"gate_topk: top_k={k} from {top} of {groups} groups does not fit {e} experts")
    t = ins[0].shape[0]
    return [TensorSpec((t, k), ins[0].dtype), TensorSpec((t, k), "int64")]


def _topk_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    t, e = ins[0].shape
    k = int(attrs["top_k"])
    return Cost(flops=t * e * (6.0 + k), bytes=io_bytes(ins, outs))


def _topk_ref(logits, bias, top_k: int, score: str, scale: float = 1.0, renorm: bool = True, n_group: int = 1,
              topk_group: int = 1):
    s = scores(logits, score)
    idx = select(s, bias, top_k, n_group, topk_group)
    return combine(s, idx, top_k, scale, renorm), idx


def _topk_kernel(ins, outs, top_k: int, score: str, scale: float = 1.0, renorm: bool = True, n_group: int = 1,
                 topk_group: int = 1) -> None:
    (logits, bias), (w, idx) = ins, outs
    s = scores(logits, score)
    idx.copy_(select(s, bias, top_k, n_group, topk_group))
    torch.gather(s, -1, idx, out=w)
    if renorm and top_k > 1:
        w.div_(w.sum(-1, keepdim=True).add_(RENORM_EPS))
    w.mul_(scale)


def _bwd_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 4 or ins[1].shape != ins[2].shape or ins[3].shape != ins[0].shape:
        raise GraphError(f"gate_topk_bwd takes logits [t, E], indices [t, k], d weights [t, k], d logits [t, E], "
                         f"got {[s.shape for s in ins]}")
    return [TensorSpec(ins[0].shape, ins[0].dtype)]


def _bwd_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    t, e = ins[0].shape
    return Cost(flops=10.0 * t * e, bytes=io_bytes(ins, outs))


def _bwd_ref(logits, indices, g_w, g_logits, top_k: int, score: str, scale: float = 1.0, renorm: bool = True,
             **_groups):
    def weights(lg: torch.Tensor) -> torch.Tensor:
        return combine(scores(lg, score), indices, top_k, scale, renorm)

    _, gl = torch.autograd.functional.vjp(weights, logits, g_w)
    return gl + g_logits


def _bwd_kernel(ins, outs, top_k: int, score: str, scale: float = 1.0, renorm: bool = True, **_groups) -> None:
    (logits, idx, g_w, g_logits), out = ins, outs[0]
    s = scores(logits, score)
    g = g_w * scale
    if renorm and top_k > 1:
        s_sel = s.gather(-1, idx)
        d = s_sel.sum(-1, keepdim=True).add_(RENORM_EPS)
        g = (g - (g * s_sel).sum(-1, keepdim=True) / d) / d
    ds = torch.zeros_like(s).scatter_(-1, idx, g)
    if score == "softmax":
        ds.sub_((ds * s).sum(-1, keepdim=True)).mul_(s)
    elif score == "sigmoid":
        ds.mul_(s * (1 - s))
    else:
        ds.mul_(logits.sigmoid()).div_(2 * s)
    torch.add(ds, g_logits, out=out)


register(OpDef("gate_topk", (VECTOR,), _topk_ref, _topk_shape, _topk_cost, _topk_kernel,
               doc="router scores, top-k of scores + bias, gathered weights renormalised and scaled"))
register(OpDef("gate_topk_bwd", (VECTOR,), _bwd_ref, _bwd_shape, _bwd_cost, _bwd_kernel,
               doc="gradient of gate_topk's weights with respect to the logits, plus the logits' own gradient",
               grad_of=GradOf("gate_topk", "x0 y1 dy0 dx0", "dx0")))
