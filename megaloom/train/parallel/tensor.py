"""Tensor parallelism (``torch.distributed.tensor.parallel``) with a plan read off the module names.

Inside attention and dense MLP blocks (the transformers names of Qwen3, Qwen3-MoE,
DeepSeek-V3 and Llama-style models):

    column parallel (output features split)   q_proj k_proj v_proj q_b_proj kv_b_proj gate_proj up_proj
    row parallel (input features split)       o_proj down_proj
    per-head norms (q_norm, k_norm)           weight replicated, input split on its head dim

so each rank computes whole heads and a slice of each MLP, and one all-reduce after
``o_proj`` / ``down_proj`` gives every rank the full output. Everything else (embedding,
norms, routers, experts, ``lm_head``) stays replicated. DeepSeek's ``kv_a_proj_with_mqa``
too, but the rotary key part of its output is shared by all heads, so each rank's heads
give it only part of its gradient: that part is summed over the ranks in backward.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megaloom.runtime.errors import ConfigError

COLWISE = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
HEAD_NORMS = ("q_norm", "k_norm")
SHARED_ROPE = ("kv_a_proj_with_mqa",)  # DeepSeek MLA: output [..., kv_lora_rank + qk_rope_head_dim]
HEAD_COUNTS = {"q_proj": "num_attention_heads", "q_b_proj": "num_attention_heads", "kv_b_proj": "num_attention_heads",
               "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}


def plan(model: nn.Module, tp: int) -> dict[str, str]:
    """``{module name: 'colwise' | 'rowwise' | 'head_norm'}``; a ConfigError names every module that
    cannot split over ``tp`` ranks."""
    config = getattr(model, "config", None)
    out, problems = {}, []
    for name, mod in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(mod, nn.Linear) and leaf in COLWISE + ROWWISE:
            features = mod.out_features if leaf in COLWISE else mod.in_features
            heads_key = HEAD_COUNTS.get(leaf) if ".self_attn." in f".{name}." else None
            heads = getattr(config, heads_key, None) if heads_key else None
            if heads is not None and heads % tp:
                problems.append(f"parallel.tp_size={tp} does not divide model.config.{heads_key}={heads} ({name})")
            elif features % tp:
                problems.append(f"parallel.tp_size={tp} does not divide the {features} "
                                f"{'output' if leaf in COLWISE else 'input'} features of {name}")
            out[name] = "colwise" if leaf in COLWISE else "rowwise"
        elif leaf in HEAD_NORMS and f"{name.rpartition('.')[0]}.{leaf[0]}_proj" in out:
            out[name] = "head_norm"
        elif isinstance(mod, nn.Linear) and leaf in SHARED_ROPE:
            out[name] = "shared_rope"
    if not out:
        problems.append(f"parallel.tp_size={tp}: the model has no attention or MLP projections named "
                        f"{', '.join(COLWISE + ROWWISE)}")
    if problems:
        raise ConfigError("tensor parallelism cannot split the model:\n  " + "\n  ".join(problems))
    return out


def apply(model: nn.Module, tp_mesh: Any) -> dict[str, str]:
    """Parallelize ``model`` in place over ``tp_mesh`` (a 1-D DeviceMesh); returns the plan."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    layout = plan(model, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              # [B, S, heads, head_dim] on this rank's heads: Shard(2); the weight's gradient is summed over ranks
              "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True)}
    parallelize_module(model, tp_mesh, {name: styles[kind]() for name, kind in layout.items() if kind in styles})
    rope = getattr(model.config, "qk_rope_head_dim", 0)
    for name, kind in layout.items():
        if kind == "shared_rope":
            model.get_submodule(name).register_forward_hook(
                lambda _m, _a, out: _SumTailGrad.apply(out, rope, tp_mesh.get_group()))
    return layout


class _SumTailGrad(torch.autograd.Function):
    """Identity; backward sums the gradient of the last ``n`` features over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
        ctx.n, ctx.group = n, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        tail = grad[..., grad.shape[-1] - ctx.n:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., grad.shape[-1] - ctx.n:] = tail
        return grad, None, None
