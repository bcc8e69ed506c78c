"""MegaGate: the MoE router as task graphs over token shards.

Modules: :mod:`.ops` (vector tile ops), :mod:`.graph` (``GateSpec``, forward and backward
builders, the ``MEGAGATE`` graph factory, the golden router), :mod:`.module` (``MegaGate``
module and the custom ops its autograd runs on).
"""
from megaloom.graphs.gate.graph import (
    MEGAGATE, GateSpec, build_megagate, build_megagate_backward, build_megagate_forward, megagate_reference,
)
from megaloom.graphs.gate.module import GateOutput, MegaGate, run_megagate

__all__ = [
    "GateOutput", "GateSpec", "MEGAGATE", "MegaGate", "build_megagate", "build_megagate_backward",
    "build_megagate_forward", "megagate_reference", "run_megagate",
]
