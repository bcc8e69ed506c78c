"""megaloom.graphs"""
from megaloom.graphs.megamoe import MegaMoE, MegaMoESpec, moe_reference
from megaloom.graphs.megagate import (
    GateSpec, build_megagate, build_megagate_backward, build_megagate_forward, megagate_reference,
)
from megaloom.graphs.megagate_module import GateOutput, MegaGate, MegaGateFunction, run_megagate
from megaloom.graphs.megamhc import (
    MHCSpec, build_megamhc, build_megamhc_backward, build_megamhc_forward, megamhc_reference,
)
from megaloom.graphs.megamhc_module import MegaMHC, MegaMHCFunction, MHCOutput, run_megamhc

__all__ = [
    "GateOutput", "GateSpec", "MHCOutput", "MHCSpec", "MegaGate", "MegaGateFunction", "MegaMHC", "MegaMHCFunction",
    "MegaMoE", "MegaMoESpec", "build_megagate", "build_megagate_backward", "build_megagate_forward", "build_megamhc",
    "build_megamhc_backward", "build_megamhc_forward", "megagate_reference", "megamhc_reference", "moe_reference",
    "run_megagate", "run_megamhc",
]
