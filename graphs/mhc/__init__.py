"""MegaMHC: manifold-constrained hyper-connections as task graphs over token tiles.

Modules: :mod:`.ops` (vector tile ops), :mod:`.graph` (``MHCSpec``, forward and backward
builders, the ``MEGAMHC`` graph factory, the golden reference), :mod:`.module` (``MegaMHC``
module and its custom ops).
"""
from megaloom.graphs.mhc.graph import (
    GRAD_INPUTS, GRAD_OUTPUTS, MEGAMHC, MHCSpec, build_megamhc, build_megamhc_backward, build_megamhc_forward,
    megamhc_reference,
)
from megaloom.graphs.mhc.module import MegaMHC, MHCOutput, run_megamhc

__all__ = [
    "GRAD_INPUTS", "GRAD_OUTPUTS", "MEGAMHC", "MHCOutput", "MHCSpec", "MegaMHC", "build_megamhc",
    "build_megamhc_backward", "build_megamhc_forward", "megamhc_reference", "run_megamhc",
]
