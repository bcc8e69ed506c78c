"""MegaMoE: the fused MoE expert block as cube / vector / comm task graphs.

Modules: :mod:`.spec` (spec, host routing metadata, synthetic counts), :mod:`.ops` (tile
ops), :mod:`.graph` (forward and backward builders, the ``MEGAMOE`` graph factory) on :mod:`.tasks` (the
stages), :mod:`.counts` (counts-built graphs) and :mod:`.dynamic` (graphs of every routing, on
:mod:`.layout`),
:mod:`.reference` (the golden eager block), :mod:`.memory` (workspace estimate),
:mod:`.module` (``MegaMoE`` module, the ``megamoe`` function on custom ops, and the runner), :mod:`.ep` (expert
parallel check on real ranks).
"""
from megaloom.graphs.moe.graph import BWD_STAGES, FWD_STAGES, MEGAMOE, build_backward, build_forward
from megaloom.graphs.moe.memory import MemoryEstimate, estimate_memory, measured_bytes
from megaloom.graphs.moe.module import MegaMoE, MegaMoERunner, megamoe
from megaloom.graphs.moe.reference import moe_reference
from megaloom.graphs.moe.spec import (
    ROUTINGS, Counts, MegaMoESpec, Routing, local_counts, make_routing, synthetic_counts,
)

__all__ = [
    "BWD_STAGES", "Counts", "FWD_STAGES", "MEGAMOE", "MegaMoE", "MegaMoERunner", "MegaMoESpec",
    "MemoryEstimate", "ROUTINGS", "Routing", "build_backward", "build_forward", "estimate_memory", "local_counts",
    "make_routing", "measured_bytes", "megamoe", "moe_reference", "synthetic_counts",
]
