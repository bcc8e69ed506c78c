"""A residual MLP split into row tiles: the plain cube + vector graph (no comm) that the
fidelity benchmark and the replay tests execute and predict.

    x[tile i] --matmul(w1)--> h[i] --silu--> a[i] --matmul(w2)--> y[i] --add(x)--> out[i]
       cube                    vector          cube                  vector
"""
from __future__ import annotations

import torch

from megaloom.runtime.graph import TaskGraph


def build_mlp(tokens: int = 512, hidden: int = 256, inter: int = 512, tile: int = 64,
              dtype: str = "float32") -> TaskGraph:
    """``out = x + silu(x @ w1) @ w2`` over ``tile``-row tiles, so tiles overlap across engines."""
    g = TaskGraph("mlp")
    x = g.input("x", (tokens, hidden), dtype)
    w1 = g.input("w1", (hidden, inter), dtype)
    w2 = g.input("w2", (inter, hidden), dtype)
    h = g.buffer("h", (tokens, inter), dtype)
    a = g.buffer("a", (tokens, inter), dtype)
    y = g.buffer("y", (tokens, hidden), dtype)
    out = g.output("out", (tokens, hidden), dtype)
    for i, rows in enumerate(range(0, tokens, tile)):
        r = slice(rows, rows + tile)
        tags = {"group": i}
        g.task("matmul", [x[r], w1], [h[r]], name=f"mm1.{i}", tags={**tags, "stage": "mm1"})
        g.task("silu", [h[r]], [a[r]], name=f"silu.{i}", tags={**tags, "stage": "act"})
        g.task("matmul", [a[r], w2], [y[r]], name=f"mm2.{i}", tags={**tags, "stage": "mm2"})
        g.task("add", [y[r], x[r]], [out[r]], name=f"residual.{i}", tags={**tags, "stage": "residual"})
    return g


def mlp_inputs(graph: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random inputs for every input buffer, scaled to keep activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    return {b.name: torch.randn(b.shape, generator=gen) / max(1, b.shape[0]) ** 0.5 for b in graph.inputs}
