"""megaloom.graphs: the MegaKernel graph families, one package each (:mod:`.moe`, :mod:`.gate`,
:mod:`.mhc`, :mod:`.fsdp`), on what they share (:mod:`.common`)."""
from megaloom.graphs.common import GraphBuilder, GraphRunner
from megaloom.graphs.gate import (
    MEGAGATE, GateOutput, GateSpec, MegaGate, build_megagate, build_megagate_backward,
    build_megagate_forward, megagate_reference, run_megagate,
)
from megaloom.graphs.mhc import (
    MEGAMHC, MegaMHC, MHCOutput, MHCSpec, build_megamhc, build_megamhc_backward,
    build_megamhc_forward, megamhc_reference, run_megamhc,
)
from megaloom.graphs.moe import MEGAMOE, MegaMoE, MegaMoESpec, moe_reference

__all__ = [
    "GateOutput", "GateSpec", "GraphBuilder", "GraphRunner", "MEGAGATE", "MEGAMHC", "MEGAMOE", "MHCOutput", "MHCSpec",
    "MegaGate", "MegaMHC", "MegaMoE", "MegaMoESpec", "build_megagate",
    "build_megagate_backward", "build_megagate_forward", "build_megamhc", "build_megamhc_backward",
    "build_megamhc_forward", "megagate_reference", "megamhc_reference", "moe_reference", "run_megagate", "run_megamhc",
]
