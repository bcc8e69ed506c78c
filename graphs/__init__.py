"""megaloom.graphs"""
from megaloom.graphs.megamoe import MegaMoE, MegaMoESpec, moe_reference  # noqa: F401
from megaloom.graphs.megagate import (  # noqa: F401
    GateSpec, build_megagate, build_megagate_backward, build_megagate_forward, megagate_reference,
)
from megaloom.graphs.megagate_module import GateOutput, MegaGate, MegaGateFunction, run_megagate  # noqa: F401
from megaloom.graphs.megamhc import (  # noqa: F401
    MHCSpec, build_megamhc, build_megamhc_backward, build_megamhc_forward, megamhc_reference,
)
from megaloom.graphs.megamhc_module import MegaMHC, MegaMHCFunction, MHCOutput, run_megamhc  # noqa: F401
