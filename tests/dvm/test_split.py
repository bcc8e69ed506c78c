"""The DP split: limits respected and optimal against brute force on small clusters."""
from __future__ import annotations

import itertools
import random

import pytest

from megaloom.ops.dvm.split import Limits, SegNode, fits, score, segment_stats, split


def random_cluster(rng: random.Random, n: int) -> list[SegNode]:
    nodes = []
    for i in range(n):
        k = rng.randint(1, 2)
        reads = tuple({rng.choice([f"in{rng.randint(0, 4)}"] + [f"v{j}" for j in range(i)]) for _ in range(k)})
        nodes.append(SegNode(float(rng.choice([1, 1, 2, 4])), reads, f"v{i}", rng.random() < 0.25 or i == n - 1))
    return nodes


def brute_force(nodes, limits):
    n = len(nodes)
    best = None
    for r in range(n):
        for bounds in itertools.combinations(range(1, n), r):
            edges = [0, *bounds, n]
            if all(fits(segment_stats(nodes, a, b), limits) for a, b in zip(edges, edges[1:])):
                s = score(nodes, bounds)
                best = s if best is None or s < best else best
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_is_optimal_and_within_limits(seed):
    rng = random.Random(seed)
    nodes = random_cluster(rng, rng.randint(1, 9))
    limits = Limits(max_ops=rng.randint(2, 5), max_io=rng.randint(3, 6), max_cost=float(rng.randint(3, 8)))
    segs = split(nodes, limits)
    assert segs[0][0] == 0 and segs[-1][1] == len(nodes)
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    for a, b in segs:
        assert fits(segment_stats(nodes, a, b), limits)
    assert score(nodes, [a for a, _ in segs[1:]]) == brute_force(nodes, limits)


def test_small_cluster_is_not_split():
    nodes = [SegNode(1.0, ("x",) if i == 0 else (f"v{i - 1}",), f"v{i}", i == 4) for i in range(5)]
    assert split(nodes) == [(0, 5)]


def test_chain_of_thirty_ops_uses_fewest_segments():
    nodes = [SegNode(1.0, ("x",) if i == 0 else (f"v{i - 1}",), f"v{i}", i == 29) for i in range(30)]
    segs = split(nodes)  # 12 ops per node at most: 3 segments, costs 10/10/10 beat 12/12/6
    assert len(segs) == 3 and max(b - a for a, b in segs) == 10


def test_stats_count_each_value_once():
    nodes = [SegNode(1.0, ("x", "x"), "a", False), SegNode(4.0, ("a", "x"), "b", False), SegNode(1.0, ("a", "b"), "c", True)]
    s = segment_stats(nodes, 0, 2)
    assert (s.ops, s.cost, s.crossings) == (2, 5.0, 2) and s.io == 3  # in: x; out: a, b
