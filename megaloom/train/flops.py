"""Model FLOPs per trained token, and the peak rate MFU divides by.

Training a token costs 3x its forward (backward: twice the forward's matmuls):

    forward = 2 x (weights of every Linear, the routers, and top_k / E of each MoE block's experts)
            + 2 x layers x seq_len x heads x (qk_head_dim + v_head_dim)      (scores and weighted sum)

The attention term counts the whole sequence, as the usual MFU definition does (PaLM,
appendix B), also under a causal mask. Embedding look-ups are free. Counted on the whole
(unsharded) model, before any parallel split.
"""
from __future__ import annotations

import torch
from torch import nn

from megaloom.models.hf_moe import block_parts, is_moe_block


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a transformers causal LM."""
    weights, inside = 0.0, set()
    for name, mod in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if is_moe_block(mod):
            parts = block_parts(mod)
            weights += 3 * parts.hidden * parts.inter * parts.top_k + parts.router.weight.numel()
            for extra in (parts.shared, parts.shared_gate):
                if extra is not None:
                    weights += sum(m.weight.numel() for m in extra.modules() if isinstance(m, nn.Linear))
            inside.add(name)
        elif isinstance(mod, nn.Linear):
            weights += mod.weight.numel()
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    qk = getattr(cfg, "qk_nope_head_dim", 0) + getattr(cfg, "qk_rope_head_dim", 0) or head
    v = getattr(cfg, "v_head_dim", None) or head
    return 3 * (2 * weights + 2 * layers * seq_len * heads * (qk + v))


def peak_flops(hardware: str | None, dtype: str) -> float | None:
    """Peak matmul FLOP/s of one rank from hardware profile ``hardware`` (None: no MFU). ``auto``: ``cpu``
    without CUDA, else the profile whose name is in the GPU's name (``h100`` in "NVIDIA H100 80GB HBM3"), or None."""
    from megaloom.scheduler.profile import list_profiles, load_profile

    if hardware == "auto":
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name().lower()
            hardware = next((p for p in list_profiles() if p != "cpu" and p in gpu), None)
        else:
            hardware = "cpu"
    if hardware is None:
        return None
    return load_profile(hardware).peak("cube", {"float32": "fp32", "bfloat16": "bf16"}[dtype])
