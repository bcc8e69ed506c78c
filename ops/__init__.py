"""Op library: registry entries for the built-in ops (more sub-packages add their own)."""
from megaloom.ops import basic  # noqa: F401  (registers the built-in ops)
from megaloom.ops import dvm  # noqa: F401  (registers the DVM primitives and dvm.fused)
from megaloom.ops import mxfp8  # noqa: F401  (registers the MXFP8 ops)
from megaloom.ops.basic import broadcast_shape, elementwise_cost, precision, same_shape

__all__ = ["broadcast_shape", "elementwise_cost", "precision", "same_shape"]
