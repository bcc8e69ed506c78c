"""DVM fusion: cluster and split chains of vector ops into fused nodes compiled in microseconds.

    from megaloom.ops import dvm
    fused = dvm.fuse(graph)                 # TaskGraph -> TaskGraph with dvm.fused tasks
    y = dvm.jit(fn)(x)                      # torch.fx front end: trace, fuse, compile, run
    kernel = dvm.compile_program(program)   # cached by structural signature
    prog = dvm.library.swiglu(shape, dtype) # ready-made programs (SwiGLU and its backward, ...)

See ``docs/dvm.md``.
"""
from megaloom.ops.dvm import library
from megaloom.ops.dvm.backend import Options, cache_size, clear_cache, compile_program, configure, l2_cache_bytes, options
from megaloom.ops.dvm.cluster import find_clusters, fuse, primitive_of
from megaloom.ops.dvm.fused import program_of
from megaloom.ops.dvm.fx import Jit, jit, trace
from megaloom.ops.dvm.primitives import PRIMITIVES, primitive
from megaloom.ops.dvm.program import Instr, Program, instr, pattern
from megaloom.ops.dvm.split import Limits, SegNode, split

__all__ = [
    "cache_size", "clear_cache", "library", "compile_program", "configure", "find_clusters", "fuse", "Instr",
    "instr", "Jit", "jit", "l2_cache_bytes", "Limits", "Options", "options", "pattern", "primitive", "primitive_of",
    "PRIMITIVES", "Program", "program_of", "SegNode", "split", "trace",
]
