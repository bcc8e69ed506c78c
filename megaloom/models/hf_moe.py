"""Hugging Face ``transformers`` models: build them locally, and read their MoE blocks by structure.

An MoE block is recognised by what it holds, not by its class name:

- a **router** child (``gate`` or ``router``): a module with a 2-D ``weight [E, H]`` and an
  integer ``top_k`` that returns ``(logits, top-k weights, top-k indices)`` (transformers >= 5; a
  Linear subclass with its own forward too, as PhiMoE's), called with the block's own correction
  bias when the block holds one (``e_score_correction_bias`` / ``expert_bias``: MiniMax-M2, HY-V3,
  LFM2-MoE);
- an **experts** child: fused 3-D weights ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
  with an ``act_fn`` (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, Mixtral, OLMoE), or an
  ``nn.ModuleList`` of gated MLPs (``gate_proj`` / ``up_proj`` / ``down_proj`` or ``w1`` / ``w3`` /
  ``w2`` Linears without bias, and an ``act_fn``);
- optionally a **shared expert** (``shared_experts`` or ``shared_expert``: any module on the
  hidden states, added to the routed output), itself optionally **gated** by
  ``shared_expert_gate``, a ``Linear(H, 1)`` whose sigmoid scales it (Qwen2-MoE).

:func:`block_parts` reads these by identity (no copies) and refuses, naming the part, anything
else: an unknown child, parameter or buffer, a router that is a plain Linear (routing inside the
block's own forward), expert biases, router jitter noise. :func:`behaviour_problems` then checks
that the block's own forward equals ``router -> experts -> + shared`` rebuilt from the parts
(:func:`block_forward`) on a seeded probe, so a block whose forward does something else is
refused too, never swapped into a silently different model.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.runtime.errors import ConfigError

ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert")
SHARED_GATE_NAME = "shared_expert_gate"
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")  # a correction bias the router takes from its block
MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # (gate, up, down) projections
# relative error (max |a - b| / max |b|) allowed between a block and its rebuilt forward, per dtype
PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
PROBE_TOKENS = 16


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("model: the 'transformers' package is needed (pip install 'megaloom[train]')") from e
    return transformers


def model_classes(kind: str) -> tuple[type, type]:
    """(config class, causal-LM class) of a transformers model type such as ``qwen2_moe``."""
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    if kind not in CONFIG_MAPPING or name is None:
        moe = sorted(k for k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if "moe" in k or k in ("mixtral", "deepseek_v3"))
        raise ConfigError(f"model.kind: {kind!r} is not a transformers causal-LM model type "
                          f"(MoE ones include {', '.join(moe)}), nor 'path'")
    return CONFIG_MAPPING[kind], getattr(tf, name)


def build_model(model_cfg: dict, seed: int) -> nn.Module:
    """A transformers causal LM from a validated ``model`` section, on CPU, in train mode.

    ``kind`` is a transformers model type (``qwen3_moe``, ``qwen2_moe``, ``deepseek_v3``,
    ``mixtral``, ``olmoe``, ...): its config class gets ``model.config`` as keyword arguments
    (unknown names are a ConfigError listing the allowed ones) and weights are drawn with
    ``seed``. ``kind: path``: ``from_pretrained`` on a local directory only.
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
        config_cls, model_cls = model_classes(model_cfg["kind"])
        allowed = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
        allowed |= set(config_cls.attribute_map) | set(config_cls().to_dict())
        unknown = sorted(set(model_cfg["config"]) - allowed)
        if unknown:
            raise ConfigError(f"model.config: unknown key(s) {', '.join(unknown)} for {config_cls.__name__}; "
                              f"allowed: {', '.join(sorted(allowed))}")
        try:
            config = config_cls(**model_cfg["config"])
        except Exception as e:  # transformers validates fields with its own exception types
            raise ConfigError(f"model.config: {config_cls.__name__} rejected the values: {e}") from None
        model = model_cls._from_config(config, dtype=dtype)
    return model.train()


@dataclass(slots=True)
class MoEBlockParts:
    """The pieces of one MoE block, by identity, and the child names they sit under."""

    router: nn.Module              # called on [T, H]; returns (logits, weights [T, k], indices [T, k])
    experts: nn.Module             # fused 3-D weights or a ModuleList of gated MLPs
    act: Callable[[torch.Tensor], torch.Tensor]
    top_k: int
    num_experts: int
    hidden: int
    inter: int
    router_name: str = "gate"
    shared: nn.Module | None = None
    shared_gate: nn.Module | None = None
    bias_name: str | None = None   # the block's own correction bias, passed to the router

    @property
    def fused(self) -> bool:
        return not isinstance(self.experts, nn.ModuleList)


def expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [E, H, 2I], down [E, I, H])`` in MegaMoE's layout of a fused or ModuleList experts module:
    transposed views of fused weights (no copy), or the ModuleList's Linear weights stacked (a copy each call;
    gradients flow back to the Linears)."""
    if not isinstance(experts, nn.ModuleList):
        return experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    names = _mlp_names(experts[0])
    g, u, d = ([getattr(m, n).weight for m in experts] for n in names)
    return torch.cat([torch.stack(g), torch.stack(u)], 1).transpose(1, 2), torch.stack(d).transpose(1, 2)


def is_moe_block(module: nn.Module) -> bool:
    """True for a candidate MoE block: it has an ``experts`` child and a router child."""
    children = dict(module.named_children())
    return "experts" in children and any(n in children for n in ROUTER_NAMES)


def is_router(module: nn.Module) -> bool:
    """True for a candidate router: a 2-D ``weight`` Parameter and an integer ``top_k`` (not a plain Linear)."""
    w = getattr(module, "weight", None)
    return (type(module).forward is not nn.Linear.forward and isinstance(w, nn.Parameter) and w.dim() == 2
            and isinstance(getattr(module, "top_k", None), int))


def _mlp_names(mlp: nn.Module) -> tuple[str, str, str]:
    for names in MLP_NAMES:
        if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in names):
            return names
    raise ConfigError(f"{type(mlp).__name__} has no gate/up/down Linears")


def _own_tensors(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]


def _unknown_parts(module: nn.Module, where: str, known: tuple[str, ...]) -> list[str]:
    """Problems of an expert module: a child holding parameters or a tensor of its own that is not ``known``
    (nor ``act_fn``), no ``act_fn``."""
    parts = [f"{where}: part {n!r} ({type(c).__name__}) is not one megaloom understands"
             for n, c in module.named_children() if n not in (*known, "act_fn") and any(True for _ in c.parameters())]
    tensors = [f"{where}: parameter or buffer {n!r} is not one megaloom understands (expected {', '.join(known)})"
               for n in _own_tensors(module) if n not in known]
    return parts + tensors + ([] if callable(getattr(module, "act_fn", None)) else [f"{where}: no act_fn"])


def _fused_problems(experts: nn.Module) -> list[str]:
    problems = _unknown_parts(experts, "experts", ("gate_up_proj", "down_proj"))
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return problems + [f"experts ({type(experts).__name__}): expected 3-D gate_up_proj and down_proj "
                           "Parameters (transformers >= 5) or a ModuleList of MLPs"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 \
            or tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        problems.append(f"experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                        "[E, 2I, H] and [E, H, I]")
    return problems


def _list_problems(experts: nn.ModuleList) -> list[str]:
    if not len(experts):
        return ["experts: an empty ModuleList"]
    problems, shapes = [], set()
    for i, mlp in enumerate(experts):
        try:
            names = _mlp_names(mlp)
        except ConfigError:
            problems.append(f"experts.{i} ({type(mlp).__name__}): expected gate_proj/up_proj/down_proj "
                            "(or w1/w3/w2) Linears")
            continue
        linears = [getattr(mlp, n) for n in names]
        problems += [f"experts.{i}.{n}: has a bias, which MegaMoE's experts do not take"
                     for n, lin in zip(names, linears) if lin.bias is not None]
        problems += _unknown_parts(mlp, f"experts.{i}", names)
        shapes.add(tuple(tuple(lin.weight.shape) for lin in linears))
    if len(shapes) > 1:
        problems.append(f"experts: the MLPs differ in shape ({sorted(shapes)})")
    elif shapes:
        (gi, h), (ui, uh), (dh, di) = next(iter(shapes))
        if not gi == ui == di or not h == uh == dh:
            problems.append(f"experts: gate/up/down shapes {next(iter(shapes))} do not pair up")
    return problems


def read_block(block: nn.Module) -> tuple[MoEBlockParts | None, list[str]]:
    """The parts of an MoE block and the problems found (parts None when there are any)."""
    name = type(block).__name__
    if not is_moe_block(block):
        return None, [f"{name} is not an MoE block (no 'experts' child next to a 'gate' or 'router')"]
    children = dict(block.named_children())
    router_name = next(n for n in ROUTER_NAMES if n in children)
    shared_name = next((n for n in SHARED_NAMES if n in children), None)
    known = {router_name, "experts", shared_name, SHARED_GATE_NAME}
    problems = [f"part {n!r} ({type(c).__name__}) is not one megaloom understands; an MoE block holds a router "
                f"({'/'.join(ROUTER_NAMES)}), experts, and optionally {'/'.join(SHARED_NAMES)} and "
                f"{SHARED_GATE_NAME}" for n, c in children.items() if n not in known]
    own = _own_tensors(block)
    bias_name = own[0] if len(own) == 1 and own[0] in BIAS_NAMES and own[0] in dict(block.named_buffers()) else None
    problems += [f"parameter or buffer {n!r} of the block itself is not one megaloom understands"
                 for n in own if n != bias_name]
    jitter = getattr(block, "jitter_noise", 0) or 0
    if jitter:
        problems.append(f"router jitter noise (jitter_noise={jitter}) is not supported: it scales the hidden "
                        "states randomly in training")
    router, experts = children[router_name], children["experts"]
    if type(router).forward is nn.Linear.forward:
        problems.append(f"router {router_name!r} is a plain Linear: the routing happens in the block's own forward, "
                        "which megaloom cannot read (routers must return (logits, weights, indices))")
    elif not is_router(router):
        problems.append(f"router {router_name!r} ({type(router).__name__}) has no 2-D weight Parameter and "
                        "integer top_k")
    problems += _list_problems(experts) if isinstance(experts, nn.ModuleList) else _fused_problems(experts)
    gate = children.get(SHARED_GATE_NAME)
    if gate is not None and shared_name is None:
        problems.append(f"{SHARED_GATE_NAME} without a shared expert")
    if gate is not None and not (isinstance(gate, nn.Linear) and gate.out_features == 1):
        problems.append(f"{SHARED_GATE_NAME} ({type(gate).__name__}) is not a Linear(H, 1)")
    if problems:
        return None, problems
    gate_up, down = expert_weights(experts)  # [E, H, 2I], [E, I, H]
    e, h, i = gate_up.shape[0], gate_up.shape[1], down.shape[1]
    if tuple(router.weight.shape) != (e, h):
        return None, [f"router weight {tuple(router.weight.shape)} does not fit {e} experts of hidden size {h}"]
    act = experts.act_fn if not isinstance(experts, nn.ModuleList) else experts[0].act_fn
    return MoEBlockParts(router=router, experts=experts, act=act, top_k=int(router.top_k), num_experts=e, hidden=h,
                         inter=i, router_name=router_name, shared=children.get(shared_name),
                         shared_gate=gate, bias_name=bias_name), []


def block_parts(block: nn.Module) -> MoEBlockParts:
    """The parts of an MoE block; a ConfigError names the class and every part it does not understand."""
    parts, problems = read_block(block)
    if problems:
        raise ConfigError(f"{type(block).__name__}: {'; '.join(problems)}")
    return parts


def is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """True when ``act`` computes SiLU (checked on values, whatever its class)."""
    t = torch.linspace(-6, 6, 97)
    try:
        return bool(torch.allclose(act(t), F.silu(t), rtol=1e-6, atol=1e-7))
    except Exception:  # an activation that cannot run on a plain tensor is not SiLU
        return False


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of ``want`` (the parity metric)."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def block_forward(parts: MoEBlockParts, hidden: torch.Tensor, block: nn.Module | None = None,
                  experts: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The block's forward rebuilt from its parts: route, run the experts, add the (gated) shared expert.

    ``experts(x, indices, weights)`` defaults to the golden eager MoE
    (:func:`megaloom.graphs.moe.reference.moe_reference`) on the block's own weights.
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    bias = (getattr(block, parts.bias_name),) if parts.bias_name else ()  # ``block``: the block or its swap
    _, weights, indices = parts.router(x, *bias)
    if experts is None:
        from megaloom.graphs.moe.reference import moe_reference

        y = moe_reference(x, indices, weights, *expert_weights(parts.experts), parts.act)
    else:
        y = experts(x, indices, weights)
    y = y.reshape(hidden.shape)
    if parts.shared is not None:  # scaled by the sigmoid of its gate when it has one
        s = parts.shared(hidden)
        y = y + (s if parts.shared_gate is None else torch.sigmoid(parts.shared_gate(hidden)) * s)
    return y


def behaviour_problems(block: nn.Module, parts: MoEBlockParts) -> list[str]:
    """Why the block's own forward is not :func:`block_forward` of its parts, on a seeded probe (empty: it is).

    Runs both on ``PROBE_TOKENS`` random tokens in the block's dtype and device, without gradients,
    from the same RNG state (a router that samples, as PhiMoE's in training, draws alike) and without
    touching the global RNG; tolerance :data:`PROBE_RTOL` by dtype.
    """
    p = next(parts.experts.parameters())
    if p.device.type == "meta":
        return []
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, parts.hidden, generator=gen).to(p.device, p.dtype)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            torch.manual_seed(0)
            want = block(x.clone())
            torch.manual_seed(0)
            got = block_forward(parts, x.clone(), block)
        except Exception as e:  # a forward that does not run on [1, T, H] is not one megaloom can rebuild
            return [f"its forward could not be checked on a [1, {PROBE_TOKENS}, {parts.hidden}] probe: "
                    f"{type(e).__name__}: {e}"]
    want = want[0] if isinstance(want, tuple) else want
    err = max_rel_err(got.float(), want.float())
    tol = PROBE_RTOL.get(p.dtype, 1e-5)
    if not err <= tol:
        return [f"its forward differs from router -> experts -> shared expert rebuilt from its parts by {err:.2e} "
                f"(relative; allowed {tol:g} in {str(p.dtype).removeprefix('torch.')}): it does something "
                "megaloom does not understand"]
    return []
