"""Single-process A/B pairs on plain torch (one thread): a transformer encoder step and a tiny
MoE step, changed in one thing each; B is predicted from A's profiler trace."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.profiler import record_function

from benchmarks.whatif.pair import Pair
from benchmarks.whatif.record import predicted_ratio, profile_steps, timed
from megaloom.scheduler.replay import WhatIf

D, HEADS, FFN, BATCH, SEQ, LAYERS = 128, 4, 768, 6, 80, 2
"""Encoder sizes, all distinct so a dimension what-if names one thing (6 x 80 = 480 tokens)."""
EXPERTS, EXPERT_FFN, TOKENS = 4, 384, 480


class Encoder(nn.Module):
    """Post-norm encoder layers, each under a ``layer.i`` annotation."""

    def __init__(self, ffn: int = FFN, layers: int = LAYERS, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        act = (lambda x: x) if activation == "none" else activation
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D, HEADS, ffn, dropout, activation=act, batch_first=True)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with record_function(f"layer.{i}"):
                x = layer(x)
        return x


class MoE(nn.Module):
    """A router-free MoE block: tokens routed by a fixed assignment, experts looped, each under
    an ``expert.i`` annotation."""

    def __init__(self, ffn: int = EXPERT_FFN):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, D, ffn) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, ffn, D) * ffn ** -0.5)

    def forward(self, x: torch.Tensor, assign: list[torch.Tensor]) -> torch.Tensor:
        x = self.proj(x)
        out = torch.zeros_like(x)
        for e, idx in enumerate(assign):
            with record_function(f"expert.{e}"):
                out = out.index_add(0, idx, torch.relu(x[idx] @ self.w1[e]) @ self.w2[e])
        return out


def routing(hot: float, top: int = 2) -> list[torch.Tensor]:
    """Token indices per expert: expert 0 gets ``hot`` times the mean, the others the rest alike."""
    mean = TOKENS * top / EXPERTS
    counts = [round(mean * hot)] + [round(mean * (EXPERTS - hot) / (EXPERTS - 1))] * (EXPERTS - 1)
    return [(torch.arange(n) + 97 * e) % TOKENS for e, n in enumerate(counts)]


def _step(model: nn.Module, inputs: tuple) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(*inputs).square().mean().backward()
        opt.step()
    return step


def encoder(batch: int = BATCH, seq: int = SEQ, **kw) -> Callable[[], None]:
    torch.manual_seed(0)
    return _step(Encoder(**kw), (torch.randn(batch, seq, D),))


def moe(ffn: int = EXPERT_FFN, hot: float = 1.0) -> Callable[[], None]:
    torch.manual_seed(0)
    return _step(MoE(ffn), (torch.randn(TOKENS, D), routing(hot)))


def _pair(kind: str, name: str, make_a: Callable, make_b: Callable, whatif: WhatIf) -> Pair:
    sides: dict = {}

    def setup() -> None:
        torch.set_num_threads(1)
        sides["a"], sides["b"] = make_a(), make_b()
        sides["b"]()
        sides["trace"] = profile_steps(sides["a"], name.replace(" ", "_").replace(">", ""))

    return Pair(kind, name, lambda: timed(sides["a"]), lambda: timed(sides["b"]),
                lambda: predicted_ratio([sides["trace"]], whatif), setup)


def pairs() -> list[Pair]:
    return [
        _pair("op_speed", "encoder dropout 0.1 -> removed (attention's math path -> fused kernel)",
              lambda: encoder(dropout=0.1), lambda: encoder(dropout=0.0),
              WhatIf(remove=("*dropout*",), fuse=("*attention_math*",))),
        _pair("op_speed", "encoder ReLU -> removed", lambda: encoder(), lambda: encoder(activation="none"),
              WhatIf(remove=("aten::relu*", "*ReluBackward*"))),
        _pair("shape", f"encoder FFN width {FFN} -> {FFN // 2}", lambda: encoder(), lambda: encoder(ffn=FFN // 2),
              WhatIf(dims={FFN: FFN // 2})),
        _pair("shape", f"encoder batch {BATCH} -> {2 * BATCH}", lambda: encoder(), lambda: encoder(batch=2 * BATCH),
              WhatIf(dims={BATCH: 2 * BATCH})),
        _pair("shape", f"encoder sequence {SEQ} -> {2 * SEQ}", lambda: encoder(), lambda: encoder(seq=2 * SEQ),
              WhatIf(dims={SEQ: 2 * SEQ})),
        _pair("shape", f"encoder layers {LAYERS} -> {2 * LAYERS}", lambda: encoder(), lambda: encoder(layers=2 * LAYERS),
              WhatIf(layers=("layer.*", 2 * LAYERS))),
        _pair("moe", f"MoE expert width {EXPERT_FFN} -> {EXPERT_FFN // 2}", lambda: moe(),
              lambda: moe(ffn=EXPERT_FFN // 2), WhatIf(dims={EXPERT_FFN: EXPERT_FFN // 2})),
        _pair("moe", "MoE routing uniform -> hot expert (2x mean tokens)", lambda: moe(), lambda: moe(hot=2.0),
              WhatIf(hot_experts=("expert.*", 2.0))),
    ]
