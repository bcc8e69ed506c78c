"""Cut an oversize cluster into contiguous segments of a topological order, by DP.

Objective, lexicographic: fewer segments, then a lower worst-segment cost, then fewer
values crossing segment boundaries. Segment count and crossings add up over segments
but the worst cost does not, so the DP runs once per candidate cost bound ``T`` (each
distinct segment cost) minimising (segments, crossings) among segments costing at most
``T``; the answer is the smallest ``T`` reaching the least segment count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True, slots=True)
class Limits:
    """Per fused node: most ops, distinct external inputs + outputs, estimated instruction cost."""

    max_ops: int = 12
    max_io: int = 16
    max_cost: float = 16.0


@dataclass(frozen=True, slots=True)
class SegNode:
    """One op of a cluster: its cost, the values it reads, the value it writes, and whether
    that value is needed after the cluster."""

    cost: float
    reads: tuple[Hashable, ...]
    writes: Hashable
    external: bool


@dataclass(frozen=True, slots=True)
class SegStats:
    ops: int
    io: int
    cost: float
    crossings: int


def last_reads(nodes: Sequence[SegNode]) -> dict[Hashable, int]:
    """Index of the last node reading each value."""
    return {r: k for k, n in enumerate(nodes) for r in n.reads}


def segment_stats(nodes: Sequence[SegNode], i: int, j: int, last: dict[Hashable, int] | None = None) -> SegStats:
    """Stats of segment ``nodes[i:j]``: its inputs and outputs counted once each.

    ``last``: :func:`last_reads` of ``nodes`` (computed when not given)."""
    last = last_reads(nodes) if last is None else last
    made = {n.writes for n in nodes[i:j]}
    reads = {r for n in nodes[i:j] for r in n.reads if r not in made}
    crossing = {w for w in made if last.get(w, -1) >= j}
    outs = {n.writes for n in nodes[i:j] if n.external} | crossing
    return SegStats(j - i, len(reads) + len(outs), sum(n.cost for n in nodes[i:j]), len(crossing))


def fits(s: SegStats, limits: Limits) -> bool:
    """A segment of one op always fits (it just stays unfused)."""
    return s.ops == 1 or (s.ops <= limits.max_ops and s.io <= limits.max_io and s.cost <= limits.max_cost)


def score(nodes: Sequence[SegNode], bounds: Sequence[int]) -> tuple[int, float, int]:
    """(segments, worst cost, crossings) of cutting at ``bounds`` (segment starts after 0)."""
    edges = [0, *bounds, len(nodes)]
    stats = [segment_stats(nodes, a, b) for a, b in zip(edges, edges[1:])]
    return len(stats), max(s.cost for s in stats), sum(s.crossings for s in stats)


def split(nodes: Sequence[SegNode], limits: Limits = Limits()) -> list[tuple[int, int]]:
    """Optimal contiguous segments ``[(start, stop), ...]`` covering ``nodes``."""
    n = len(nodes)
    if n == 0:
        return []
    seg: dict[tuple[int, int], SegStats] = {}
    last = last_reads(nodes)
    for i in range(n):
        for j in range(i + 1, n + 1):
            s = segment_stats(nodes, i, j, last)
            if not fits(s, limits):
                if s.ops > limits.max_ops:
                    break
                continue
            seg[(i, j)] = s
    best: tuple[int, float, int, list[tuple[int, int]]] | None = None
    for bound in sorted({s.cost for s in seg.values()}):
        inf = (n + 1, 0)
        dp: list[tuple[int, int]] = [(0, 0)] + [inf] * n
        back = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):
                s = seg.get((i, j))
                if s is None or s.cost > bound or dp[i] == inf:
                    continue
                cand = (dp[i][0] + 1, dp[i][1] + s.crossings)
                if cand < dp[j]:
                    dp[j], back[j] = cand, i
        if dp[n] == inf:
            continue
        if best is None or dp[n][0] < best[0]:
            cuts, j = [], n
            while j > 0:
                cuts.append((back[j], j))
                j = back[j]
            worst = max(seg[c].cost for c in cuts)
            best = (dp[n][0], worst, dp[n][1], cuts[::-1])
    assert best is not None  # single-op segments always fit
    return best[3]
