"""Hugging Face ``transformers`` models: build them locally, and read their MoE blocks.

A :class:`MoEBlockParts` is everything a megaloom MoE needs from a transformers MoE
block, taken by identity (no copies): the router module, the stacked expert weights
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (the model's own Parameters),
the activation, and an optional shared-expert MLP added to the routed output.

Supported blocks (transformers >= 5 layout, experts stored as 3-D tensors):
``Qwen3MoeSparseMoeBlock`` (softmax top-k router) and ``DeepseekV3MoE`` (grouped
sigmoid router with score correction bias, plus shared experts). Both routers return
``(logits, top-k weights, top-k indices)`` and are reused as they are.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megaloom.runtime.errors import ConfigError

MODEL_KINDS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}

# transformers class name of an MoE block -> its number-of-experts config attribute
MOE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": "num_experts",
    "DeepseekV3MoE": "n_routed_experts",
}


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("model: the 'transformers' package is needed (pip install 'megaloom[train]')") from e
    return transformers


def build_model(model_cfg: dict, seed: int) -> nn.Module:
    """A transformers causal LM from a validated ``model`` section, on CPU, in train mode.

    ``kind`` qwen3_moe / deepseek_v3: the config class gets ``model.config`` as keyword
    arguments (unknown names are a ConfigError listing the allowed ones) and weights are
    drawn with ``seed``. ``kind: path``: ``from_pretrained`` on a local directory only.
    """
    tf = _transformers()
    dtype = getattr(torch, model_cfg["dtype"])
    torch.manual_seed(seed)
    if model_cfg["kind"] == "path":
        path = model_cfg["path"]
        if not os.path.isdir(path):
            raise ConfigError(f"model.path: {path!r} is not a local directory")
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: cannot load {path!r}: {e}") from None
    else:
        config_name, model_name = MODEL_KINDS[model_cfg["kind"]]
        config_cls = getattr(tf, config_name)
        kwargs = dict(model_cfg["config"])
        allowed = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
        allowed |= set(config_cls.attribute_map) | set(config_cls().to_dict())
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise ConfigError(
                f"model.config: unknown key(s) {', '.join(unknown)} for {config_name}; allowed: {', '.join(sorted(allowed))}")
        try:
            config = config_cls(**kwargs)
        except Exception as e:  # transformers validates fields with its own exception types
            raise ConfigError(f"model.config: {config_name} rejected the values: {e}") from None
        with _default_dtype(dtype):
            model = getattr(tf, model_name)(config)
    model.train()
    return model


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype, self.prev = dtype, torch.get_default_dtype()

    def __enter__(self):
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.prev)


@dataclass(slots=True)
class MoEBlockParts:
    """The pieces of one transformers MoE block, by identity."""

    router: nn.Module              # called on [T, H]; returns (logits, weights [T, k], indices [T, k])
    gate_up: nn.Parameter          # [E, 2I, H]: rows [:I] gate projection, [I:] up projection
    down: nn.Parameter             # [E, H, I]
    act: Callable[[torch.Tensor], torch.Tensor]
    act_name: str
    top_k: int
    shared: nn.Module | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def inter(self) -> int:
        return self.down.shape[2]


def is_moe_block(module: nn.Module) -> bool:
    return type(module).__name__ in MOE_BLOCKS


def block_parts(block: nn.Module) -> MoEBlockParts:
    """Read a supported MoE block; a ConfigError names the class and what is missing."""
    name = type(block).__name__
    if name not in MOE_BLOCKS:
        raise ConfigError(f"{name} is not a supported MoE block; supported: {', '.join(MOE_BLOCKS)}")
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or router is None:
        raise ConfigError(f"{name}: expected .gate and .experts.gate_up_proj/.down_proj (transformers >= 5 layout)")
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        raise ConfigError(f"{name}: expert weight shapes {tuple(gate_up.shape)} / {tuple(down.shape)} do not pair up")
    act = experts.act_fn
    act_name = getattr(getattr(block, "config", None), "hidden_act", None) or _act_name(act)
    return MoEBlockParts(router=router, gate_up=gate_up, down=down, act=act, act_name=act_name,
                         top_k=int(router.top_k), shared=getattr(block, "shared_experts", None))


def _act_name(act: nn.Module) -> str:
    n = type(act).__name__.lower()
    return "silu" if "silu" in n else n.removesuffix("activation")


def block_forward(parts: MoEBlockParts, hidden: torch.Tensor,
                  experts: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The block's forward rebuilt from its parts: route, run the experts, add the shared MLP.

    ``experts(x, indices, weights)`` defaults to the golden eager MoE
    (:func:`megaloom.graphs.moe.reference.moe_reference`) on the block's own weights, passed as
    transposed views into its layout.
    """
    shape = hidden.shape
    x = hidden.reshape(-1, shape[-1])
    _, weights, indices = parts.router(x)
    if experts is None:
        from megaloom.graphs.moe.reference import moe_reference

        y = moe_reference(x, indices, weights, parts.gate_up.transpose(1, 2), parts.down.transpose(1, 2), parts.act)
    else:
        y = experts(x, indices, weights)
    y = y.reshape(shape)
    if parts.shared is not None:
        y = y + parts.shared(hidden)
    return y
