"""The optional compiled vector kernels ``megaloom.ops._native`` (sources in ``ops/native/``).

They run DVM fused programs (:mod:`megaloom.ops.dvm.native`) and MXFP8 quantisation
(:mod:`megaloom.ops.mxfp8.kernels`) on CPU tensors. The extension is built at install time
when a C compiler is present; without it :data:`AVAILABLE` is False and the torch
implementations, which stay the oracle, run instead. ``MEGALOOM_NATIVE=0`` in the
environment or :func:`set_enabled` turns the kernels off in a process that has them.

The kernels take data pointers, shapes and strides, release the GIL and run on their own
worker threads; :func:`threads` is how many a call may use (torch's intra-op count unless
given). They are compiled for the baseline, AVX2 and AVX-512 instruction sets and pick the
best one the CPU has (:func:`isa`); all give the same bits.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

try:
    from megaloom.ops import _native as ext
except ImportError:  # built without a C compiler: the torch implementations run
    ext = None

AVAILABLE = ext is not None
"""True when the extension was built and imports."""

_enabled = AVAILABLE and os.environ.get("MEGALOOM_NATIVE", "1") != "0"
DTYPE_CODES: dict[torch.dtype, int] = (
    {getattr(torch, name): i for i, name in enumerate(ext.DTYPES)} if AVAILABLE else {})


def enabled() -> bool:
    """True when the compiled kernels are built and switched on."""
    return _enabled


def set_enabled(on: bool) -> bool:
    """Switch the compiled kernels on or off (on only takes effect when built); returns the old state."""
    global _enabled
    old, _enabled = _enabled, bool(on) and AVAILABLE
    return old


@contextmanager
def disabled() -> Iterator[None]:
    """Run the torch implementations inside the block."""
    old = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)


def threads(n: int | None = None) -> int:
    """Worker threads a kernel call may use: ``n``, else torch's intra-op thread count."""
    return n or torch.get_num_threads()


def isa() -> str | None:
    """The instruction set the kernels run with (``base``, ``avx2``, ``avx512``), None without them."""
    return ext.isa() if AVAILABLE else None
