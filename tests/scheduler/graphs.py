"""Small graph builders for the scheduler tests."""
from __future__ import annotations

import random

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import Cost, TaskGraph

ENGINES = ("cube", "vector", "comm")


def timed_graph(spec: list[tuple[str, float, list[int]]], name: str = "g", tags: list[dict] | None = None,
                priorities: list[int] | None = None) -> TaskGraph:
    """Control-only graph: one no-op task per ``(engine, duration_s, preds)``."""
    g = TaskGraph(name)
    for i, (engine, d, preds) in enumerate(spec):
        g.task("noop", name=f"t{i}", engine=engine, attrs={"duration": d}, cost=Cost(),
               tags=(tags[i] if tags else {}), priority=(priorities[i] if priorities else 0),
               after=[g.tasks[p] for p in preds])
    return g


def random_dag(seed: int, n: int, durations=(0.0, 0.25, 0.5, 1.0, 1.5)) -> TaskGraph:
    """A random DAG of ``n`` no-op tasks with dyadic durations (exact in floating point)."""
    rng = random.Random(seed)
    spec = []
    for i in range(n):
        preds = sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) if i else []
        spec.append((rng.choice(ENGINES), rng.choice(durations), preds))
    tags = [{"expert": rng.randrange(6), "rank": rng.randrange(4), "peer": rng.randrange(4)} for _ in range(n)]
    return timed_graph(spec, f"rand{seed}", tags, [rng.randrange(3) for _ in range(n)])


def real_graph() -> TaskGraph:
    """Two experts' tiled MLPs feeding one sum; tags for every policy."""
    g = TaskGraph("experts")
    x = g.input("x", (32, 16))
    out = g.output("out", (32, 16))
    hs = []
    for e in range(2):
        w = g.input(f"w{e}", (16, 16))
        h = g.buffer(f"h{e}", (32, 16))
        for i, (xt, ht) in enumerate(zip(x.split(0, 8), h.split(0, 8))):
            tags = {"expert": e, "rank": 0, "peer": i % 2, "unit": i}
            g.task("matmul", [xt, w], [ht], tags=tags, priority=i)
            g.task("silu", [ht], [ht], tags=tags)
        hs.append(h)
    g.task("add", hs, [out], tags={"expert": 0})
    return g
