"""MXFP8 (OCP Microscaling, E4M3 data, E8M0 scales): format, ops, autograd functions, modules.

Importing this package registers the ``mx_*`` ops (see :mod:`megaloom.ops.mxfp8.ops`).
"""
from megaloom.ops.mxfp8 import ops  # noqa: F401  (registers the mx_* ops)
from megaloom.ops.mxfp8.autograd import mx_grouped_linear, mx_linear
from megaloom.ops.mxfp8.format import (
    BLOCK, E4M3_MAX, SCALE_MODES, MXTensor, dequantize, quantize, quantize_dual, scale_codes,
)
from megaloom.ops.mxfp8.grouped import pad_groups, padded_offsets, quantize_grouped
from megaloom.ops.mxfp8.matmul import LAYOUTS, mx_grouped_matmul, mx_matmul, native_available
from megaloom.ops.mxfp8.modules import GroupedExperts, MXFP8GroupedExperts, MXFP8Linear, dim_problems

__all__ = [
    "BLOCK", "E4M3_MAX", "GroupedExperts", "LAYOUTS", "MXFP8GroupedExperts", "MXFP8Linear", "MXTensor",
    "SCALE_MODES", "dequantize", "dim_problems", "mx_grouped_linear", "mx_grouped_matmul", "mx_linear",
    "mx_matmul", "native_available", "pad_groups", "padded_offsets", "quantize", "quantize_dual",
    "quantize_grouped", "scale_codes",
]
