"""MegaMoE: the fused MoE expert block as cube / vector / comm task graphs.

Pieces (one module each): :mod:`megamoe_spec` (spec, host routing metadata),
:mod:`ops_moe` (tile ops), :mod:`megamoe_graph` (forward and backward builders),
:mod:`megamoe_reference` (golden eager block), :mod:`megamoe_memory` (workspace
estimate), :mod:`megamoe_module` (``MegaMoE`` module and autograd function). This module
re-exports them and builds graphs from plain options (CLI / YAML), with synthetic routing.
"""
from __future__ import annotations

from typing import Any

import torch

from megaloom.graphs.megamoe_graph import BWD_STAGES, FWD_STAGES, build_backward, build_forward
from megaloom.graphs.megamoe_memory import MemoryEstimate, estimate_memory, measured_bytes
from megaloom.graphs.megamoe_module import MegaMoE, MegaMoEFunction, MegaMoERunner
from megaloom.graphs.megamoe_reference import moe_reference
from megaloom.graphs.megamoe_spec import Counts, MegaMoESpec, Routing, local_counts, make_routing
from megaloom.graphs.options import load_options
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import TaskGraph

ROUTINGS = ("balanced", "random", "skewed")

__all__ = [
    "BWD_STAGES", "Counts", "build_graph", "FWD_STAGES", "MegaMoE", "MegaMoEFunction", "MegaMoERunner", "MegaMoESpec",
    "MemoryEstimate", "ROUTINGS", "Routing", "build_backward", "build_forward", "build_from_options", "build_world",
    "estimate_memory", "local_counts", "make_routing", "measured_bytes", "moe_reference", "synthetic_counts",
]


def synthetic_counts(spec: MegaMoESpec, routing: str = "balanced", *, rank: int = 0, seed: int = 0,
                     skew: float = 1.2) -> Counts:
    """Per-expert counts of every rank for simulation.

    ``balanced``: each rank spreads its ``T * k`` rows evenly (remainders rotated by rank);
    ``random``: uniform random choices; ``skewed``: Zipf(``skew``) expert popularity over a
    seeded random expert order (hot experts get many rows, cold ones may get none).
    """
    if routing not in ROUTINGS:
        raise ConfigError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not 0 <= rank < spec.ep:
        raise ConfigError(f"rank {rank} is outside ep={spec.ep}")
    E, S = spec.experts, spec.rows
    gen = torch.Generator().manual_seed(seed)
    if routing == "skewed":
        probs = torch.arange(1, E + 1, dtype=torch.float64).pow(-skew)[torch.randperm(E, generator=gen)]
    else:
        probs = torch.ones(E, dtype=torch.float64)
    rows = []
    for s in range(spec.ep):
        if routing == "balanced":
            rows.append(tuple(S // E + (1 if (g - s) % E < S % E else 0) for g in range(E)))
        else:
            pick = torch.multinomial(probs, S, replacement=True, generator=gen)
            rows.append(tuple(torch.bincount(pick, minlength=E).tolist()))
    return Counts(rank, spec.ep, spec.experts_local, tuple(rows))


def build_from_options(options: dict[str, Any]) -> TaskGraph:
    """A MegaMoE graph from plain options: :class:`MegaMoESpec` fields plus ``direction``
    (``fwd`` / ``bwd``), ``routing`` (see :func:`synthetic_counts`), ``seed`` and ``rank``."""
    opts = dict(options)
    extra = {"direction", "routing", "seed", "rank"}
    unknown = sorted(set(opts) - extra - set(MegaMoESpec.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown MegaMoE option(s) {unknown}; known: "
                          f"{sorted(extra | set(MegaMoESpec.__dataclass_fields__))}")
    direction = opts.pop("direction", "fwd")
    routing, seed, rank = opts.pop("routing", "balanced"), int(opts.pop("seed", 0)), int(opts.pop("rank", 0))
    if direction not in ("fwd", "bwd"):
        raise ConfigError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    spec = MegaMoESpec.from_dict(opts)
    counts = synthetic_counts(spec, routing, rank=rank, seed=seed)
    return build_forward(spec, counts) if direction == "fwd" else build_backward(spec, counts)


def build_graph(spec: str | None = None, **options: Any) -> TaskGraph:
    """``megaloom simulate --graph megamoe:k=v,...`` entry point. ``spec``: a YAML file of
    options (at top level or under a ``megamoe:`` key); ``options`` override it."""
    return build_from_options(load_options(spec, "megamoe", options))


def build_world(spec: str | None = None, **options: Any) -> list[TaskGraph]:
    """``megaloom simulate --graph megamoe:... --world`` entry point: every EP rank's graph
    (``rank = 0 .. ep - 1``, same options and routing), for
    :func:`megaloom.scheduler.world.simulate_world`."""
    opts = load_options(spec, "megamoe", options)
    if "rank" in opts:
        raise ConfigError(f"option rank={opts['rank']!r} conflicts with a world simulation, which builds every rank")
    ep = MegaMoESpec.from_dict({k: v for k, v in opts.items() if k in MegaMoESpec.__dataclass_fields__}).ep
    return [build_from_options({**opts, "rank": r}) for r in range(ep)]
