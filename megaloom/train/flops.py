"""Model FLOPs per trained token, and the peak rate MFU divides by.

Training a token costs 3x its forward (backward: twice the forward's matmuls):

    forward = 2 x (the matrices a token goes through: every weight of 2 or more dimensions but the
                   embeddings', the routed experts' counted top_k / E)
            + 2 x layers x seq_len x heads x (qk_head_dim + v_head_dim)      (scores and weighted sum)

Counted from shapes alone, so every model counts, MoE blocks megaloom swaps or not. The attention
term counts the whole sequence, as the usual MFU definition does (PaLM, appendix B), also under a
causal mask. Embedding look-ups are free. Counted on the whole (unsharded) model, before any split.
"""
from __future__ import annotations

import torch
from torch import nn

from megaloom.models.hf_moe import ROUTER_NAMES, is_moe_block
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.registry import CUBE


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a transformers causal LM."""
    cfg, share = model.config, {}  # id of a module among routed experts -> the share of them a token runs through
    for block in model.modules():
        if is_moe_block(block):
            router = next(getattr(block, n) for n in ROUTER_NAMES if hasattr(block, n))
            experts = next(p for p in router.parameters() if p.dim() == 2).shape[0]
            top_k = getattr(router, "top_k", None) or getattr(block, "top_k", None) or cfg.num_experts_per_tok
            share |= {id(m): top_k / experts for m in block.experts.modules()}
    weights = sum(p.numel() * share.get(id(m), 1.0) for m in model.modules() if not isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False) if p.dim() >= 2)
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    qk = getattr(cfg, "qk_nope_head_dim", 0) + getattr(cfg, "qk_rope_head_dim", 0) or head
    v = getattr(cfg, "v_head_dim", None) or head
    return 3 * (2 * weights + 2 * layers * seq_len * heads * (qk + v))


def peak_flops(hardware: str | None, dtype: str) -> tuple[float | None, str]:
    """(peak matmul FLOP/s of one rank, where it comes from) from hardware profile ``hardware`` (None: no MFU).
    ``auto``: ``cpu`` without CUDA, else the profile whose name is in the GPU's name (``h100`` in "NVIDIA H100
    80GB HBM3"), or None."""
    from megaloom.scheduler.profile import list_profiles, load_profile

    if hardware == "auto":
        gpu = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else None
        hardware = next((p for p in list_profiles() if p != "cpu" and p in gpu), None) if gpu else "cpu"
    if hardware is None:
        return None, "no hardware profile"
    try:
        profile = load_profile(hardware)
    except ConfigError as e:
        raise ConfigError(f"run.hardware: {e}") from None
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    return profile.peak(CUBE, precision), (f"hardware profile {hardware!r}, peak.cube {precision} "
                                             f"({profile.sources.get('peak.cube', 'no source given')})")
