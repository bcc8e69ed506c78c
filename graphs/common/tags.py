"""The one table of task tags the graph builders set, and who reads them.

Tags ride on every task into traces (Perfetto shows them as args, in the order set) and
feed the policies and the cost model; :func:`tags` builds a task's tags from this table. The
table is open: a graph family of one's own adds its tags with :func:`register_tag`.
"""
from __future__ import annotations

from typing import Any

from megaloom.runtime.errors import GraphError

TAGS = {
    "stage": "the builder's stage of the task (proj, topk, dispatch, gmm1, gather, ...); trace summaries",
    "direction": "fwd or bwd",
    "rank": "the rank whose graph holds the task (MegaMoE, FSDP); the rotated policy",
    "layer": "layer index (FSDP)",
    "tile": "token tile (MegaGate, MegaMHC)",
    "expert": "local expert (MegaMoE); the expert_interleave policy",
    "group": "expert group, in priority order (MegaMoE); the expert_interleave policy",
    "peer": "the other rank of a transfer or of its rows (MegaMoE); the rotated policy",
    "round": "all-to-all round: rank r sends to rank r + round (MegaMoE)",
    "link": "link of a transfer, intra or inter (MegaMoE); the cost model's comm rates",
    "kernel": "the op a dynamic MegaMoE task (moe_dyn) runs on the live rows of its tile; trace summaries",
}


def register_tag(name: str, doc: str) -> None:
    """Add the task tag ``name``; ``doc`` says what it holds and who reads it (a name taken with
    another meaning is a GraphError)."""
    if TAGS.setdefault(name, doc) != doc:
        raise GraphError(f"task tag {name!r} is already registered: {TAGS[name]}")


def tags(**values: Any) -> dict[str, Any]:
    """A task's tags in the order given, ``None`` values left out; a name not in :data:`TAGS` is a GraphError."""
    unknown = [k for k in values if k not in TAGS]
    if unknown:
        raise GraphError(f"unknown task tag(s) {', '.join(unknown)}; known: {', '.join(TAGS)}")
    return {k: v for k, v in values.items() if v is not None}
