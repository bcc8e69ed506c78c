"""MegaGate: the MoE router as forward and backward task graphs over token shards.

Forward, per shard ``i`` of ``tile_tokens`` rows::

    x[i], W --proj (cube)--> logits[i] --gate_topk (vector)--> weights[i], indices[i]
                                          bias --^

The cube projects shard i+1 while the vector units select shard i. With ``fuse_vector`` and sigmoid
scores, the scoring is a ``dvm.fused`` task (``sigmoid(logits[i])`` into ``scores[i]``) ahead of the
selection (``gate_topk`` on the given scores). Backward, per shard::

    logits[i], indices[i], dweights[i], dlogits_in[i] --gate_topk_bwd (vector)--> dlogits[i]
    dlogits[i], W --proj_grad_input (cube)--> dx[i]
    dlogits[rows], x[rows, cols], dW_acc[cols] --proj_grad_weight (cube)--> dW_acc[cols]

The weight gradient is one chain per block of ``weight_cols`` hidden columns (the chains
run on different cube units); each link covers ``weight_rows`` tokens and waits only for
the vector work of its shards; the last link casts to W's dtype.

Logits, weights and every gradient in between are float32 (float64 for float64 inputs);
the correction bias moves the selection only and gets no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloom.graphs.common.builder import GraphBuilder
from megaloom.graphs.common.ops import up
from megaloom.graphs.common.spec import GraphSpec, bools, dtype_problems, positive, report
from megaloom.graphs.common.tags import tags
from megaloom.graphs.common.tiles import tile_ranges, weight_grad_chains
from megaloom.graphs.gate.ops import GIVEN, SCORES, combine, scores, select  # (registers the gate ops)
from megaloom.ops import dvm
from megaloom.runtime.graph import TaskGraph


@dataclass(frozen=True, slots=True)
class GateSpec(GraphSpec):
    """Router shape and options. ``scale``: routed scaling factor; ``renorm``: renormalise
    the k weights (only when ``top_k > 1``); ``tile_tokens``: rows per token shard;
    ``weight_cols``: hidden columns per weight-gradient chain (chains run in parallel);
    ``weight_rows``: tokens per link of a chain; ``n_group`` / ``topk_group``: pick experts only
    from the ``topk_group`` best of ``n_group`` equal expert groups (DeepSeek-V3: 8 / 4; 1 / 1: no limit);
    ``fuse_vector``: sigmoid scoring as a ``dvm.fused`` task of its own (off by default: it writes the
    scores to memory for the selection, which ``gate_topk`` alone keeps on chip)."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    score: str = "softmax"
    scale: float = 1.0
    renorm: bool = True
    dtype: str = "float32"
    tile_tokens: int = 128
    weight_cols: int = 256
    weight_rows: int = 1024
    n_group: int = 1
    topk_group: int = 1
    fuse_vector: bool = False

    def __post_init__(self) -> None:
        problems = positive(self, "tokens", "hidden", "experts", "top_k", "tile_tokens", "weight_cols", "weight_rows",
                            "n_group", "topk_group")
        if not problems and self.top_k > self.experts:
            problems.append(f"top_k={self.top_k} exceeds experts={self.experts}")
        if not problems and self.n_group > 1 and (
                self.experts % self.n_group or self.topk_group > self.n_group
                or self.top_k > self.topk_group * (self.experts // self.n_group)):
            problems.append(f"top_k={self.top_k} from topk_group={self.topk_group} of n_group={self.n_group} groups "
                            f"does not fit experts={self.experts}")
        if self.score not in SCORES:
            problems.append(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        report("GateSpec", problems + bools(self, "fuse_vector") + dtype_problems(self))

    @property
    def attrs(self) -> dict:
        return {"top_k": self.top_k, "score": self.score, "scale": float(self.scale), "renorm": self.renorm,
                "n_group": self.n_group, "topk_group": self.topk_group}


def build_megagate_forward(spec: GateSpec) -> TaskGraph:
    """Inputs ``x`` [T, H], ``weight`` [E, H], ``bias`` [E]; outputs ``logits``, ``weights``, ``indices``."""
    T, H, E, k = spec.tokens, spec.hidden, spec.experts, spec.top_k
    g = TaskGraph("megagate_fwd")
    x, w = g.input("x", (T, H), spec.dtype), g.input("weight", (E, H), spec.dtype)
    bias = g.input("bias", (E,), spec.acc)
    logits = g.output("logits", (T, E), spec.acc)
    weights, indices = g.output("weights", (T, k), spec.acc), g.output("indices", (T, k), "int64")
    fused = spec.fuse_vector and spec.score == "sigmoid"
    scored = g.buffer("scores", (T, E), spec.acc) if fused else logits
    attrs, made = {**spec.attrs, "score": GIVEN} if fused else spec.attrs, {}
    for i, (a, b) in enumerate(tile_ranges(T, spec.tile_tokens)):
        g.task("proj", [x[a:b], w], [logits[a:b]], name=f"proj.{i}", tags=tags(stage="proj", direction="fwd", tile=i))
        if fused:
            if b - a not in made:  # one attrs dict per shard size: the program is decoded once
                made[b - a] = {"program": dvm.library.sigmoid((b - a, E), spec.acc).to_attrs()}
            g.task("dvm.fused", [logits[a:b]], [scored[a:b]], name=f"score.{i}", attrs=made[b - a],
                   tags=tags(stage="score", direction="fwd", tile=i))
        g.task("gate_topk", [scored[a:b], bias], [weights[a:b], indices[a:b]], name=f"topk.{i}",
               attrs=attrs, tags=tags(stage="topk", direction="fwd", tile=i))
    return g


def build_megagate_backward(spec: GateSpec) -> TaskGraph:
    """Inputs ``x``, ``weight``, the saved ``logits`` and ``indices``, and the gradients
    ``grad_weights`` [T, k] and ``grad_logits`` [T, E]; outputs ``grad_x``, ``grad_weight``."""
    T, H, E, k = spec.tokens, spec.hidden, spec.experts, spec.top_k
    g = TaskGraph("megagate_bwd")
    x, w = g.input("x", (T, H), spec.dtype), g.input("weight", (E, H), spec.dtype)
    logits, indices = g.input("logits", (T, E), spec.acc), g.input("indices", (T, k), "int64")
    g_weights, g_logits = g.input("grad_weights", (T, k), spec.acc), g.input("grad_logits", (T, E), spec.acc)
    g_x, g_w = g.output("grad_x", (T, H), spec.dtype), g.output("grad_weight", (E, H), spec.dtype)
    d_logits = g.buffer("dlogits", (T, E), spec.acc)
    tiles = tile_ranges(T, spec.tile_tokens)
    for i, (a, b) in enumerate(tiles):
        g.task("gate_topk_bwd", [logits[a:b], indices[a:b], g_weights[a:b], g_logits[a:b]], [d_logits[a:b]],
               name=f"topk_bwd.{i}", attrs=spec.attrs, tags=tags(stage="topk", direction="bwd", tile=i))
        g.task("proj_grad_input", [d_logits[a:b], w], [g_x[a:b]], name=f"dx.{i}",
               attrs={"out_dtype": spec.dtype}, tags=tags(stage="proj_dx", direction="bwd", tile=i))
    weight_grad_chains(g, d_logits, x, g_w, tiles, spec.weight_cols, spec.weight_rows, spec.acc, "dw")
    return g


MEGAGATE = GraphBuilder("megagate", "MegaGate", GateSpec, build_megagate_forward, build_megagate_backward)
build_megagate = MEGAGATE.build  # build_megagate(spec, "fwd" | "bwd")


def megagate_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, top_k: int,
                       score: str = "softmax", scale: float = 1.0, renorm: bool = True, n_group: int = 1,
                       topk_group: int = 1):
    """Golden router in plain torch with autograd: (logits [T, E], weights [T, k], indices [T, k])."""
    logits = torch.nn.functional.linear(up(x), up(weight))
    s = scores(logits, score)
    indices = select(s.detach(), bias, top_k, n_group, topk_group)
    return logits, combine(s, indices, top_k, scale, renorm), indices
