"""MoE routers read by structure and checked by behaviour, for MegaGate.

A router (see :func:`megaloom.models.hf_moe.is_router`) is turned into MegaGate settings
from what it holds: ``e_score_correction_bias`` (a selection-only bias; its presence means
sigmoid scores, as in DeepSeek-V3), ``norm_topk_prob`` (renormalise the k weights),
``routed_scaling_factor``, and ``num_group`` / ``n_group`` with ``topk_group`` (group-limited
selection). What the attributes leave open (score function, renormalisation) is tried in turn.
Each candidate is checked against the router's own forward on a probe: a shallow twin of the
router with random float32 weights (and bias), so the check is not fooled by a zero-initialised
router; the routing matrices (weights scattered over experts) must agree to 1e-5. A router no
candidate matches is refused.
"""
from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

from megaloom.models.hf_moe import is_router, max_rel_err

PROBE_TOKENS = 64
RTOL = 1e-5


def _twin(router: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A shallow copy of ``router`` with its own weight (and bias) tensors; the router is untouched."""
    twin = copy.copy(router)
    twin._parameters, twin._buffers = dict(router._parameters), dict(router._buffers)
    twin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        twin.e_score_correction_bias = bias
    return twin


def _dense(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(indices.shape[0], experts).scatter_(1, indices.long(), weights.float())


def _candidates(router: nn.Module, biased: bool) -> list[dict[str, Any]]:
    groups = int(getattr(router, "num_group", getattr(router, "n_group", 1)) or 1)
    scale = getattr(router, "routed_scaling_factor", None) or getattr(router, "router_scaling_factor", None)
    base = {"scale": float(scale or 1.0), "n_group": groups,
            "topk_group": int(getattr(router, "topk_group", groups) or groups)}
    scores = ("sigmoid", "softmax") if biased else ("softmax", "sigmoid")
    renorm = getattr(router, "norm_topk_prob", None)
    renorms = (bool(renorm),) if renorm is not None else (True, False)
    return [{**base, "score": s, "renorm": r} for s, r in itertools.product(scores, renorms)]


def gate_settings(router: nn.Module, block_bias: bool = False) -> tuple[dict[str, Any] | None, list[str]]:
    """MegaGate settings (score, scale, renorm, n_group, topk_group) that reproduce ``router``, or the problems;
    ``block_bias``: the router takes its block's correction bias as a second argument."""
    from megaloom.graphs.gate.graph import megagate_reference

    name = type(router).__name__
    if not is_router(router):
        return None, [f"{name} is not a router (a module with a 2-D weight Parameter and an integer top_k)"]
    experts, hidden = router.weight.shape
    has_bias = block_bias or getattr(router, "e_score_correction_bias", None) is not None
    cands = _candidates(router, has_bias)
    g = cands[0]
    if g["n_group"] < 1 or experts % g["n_group"] or not 1 <= g["topk_group"] <= g["n_group"]:
        return None, [f"{name}: {g['topk_group']} of {g['n_group']} expert groups does not fit {experts} experts"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_TOKENS, hidden, generator=gen)
    weight = torch.randn(experts, hidden, generator=gen) / hidden ** 0.5
    bias = 0.1 * torch.randn(experts, generator=gen) if has_bias else torch.zeros(experts)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            _, w, idx = _twin(router, weight, bias if has_bias and not block_bias else None)(x, *[bias] * block_bias)
        except Exception as e:  # a router that does not run like a transformers router is not understood
            return None, [f"{name}: its forward could not be probed ({type(e).__name__}: {e})"]
        want = _dense(w, idx, experts)
        for c in cands:
            _, mw, mi = megagate_reference(x, weight, bias, top_k=int(router.top_k), **c)
            if max_rel_err(_dense(mw, mi, experts), want) <= RTOL:
                return c, []
    tried = ", ".join(f"{c['score']}{' renormalised' if c['renorm'] else ''}" for c in cands)
    return None, [f"{name}: its routing matches no MegaGate setting (tried {tried} top-k with scale "
                  f"{g['scale']:g}, {g['topk_group']} of {g['n_group']} groups)"]
