"""What each imported event is: one data table of classes, first match wins.

A device op (kernel, memcpy, memset) gets a class from :data:`DEVICE_CLASSES` by its name;
the class names the engine it runs on (``comm``, ``cube``, ``vector``, ``copy``) and the
library it comes from, which what-ifs use (``--speedup nccl=2``). Host-side events are
``host`` work, never compute, except in a trace with no device activity at all, where the
CPU was the device: there the top-level CPU ops get a class from :data:`CPU_CLASSES`.
Host runtime calls that wait for the device get a sync kind from :data:`SYNC_CALLS`.
Lookups are cached by name: a trace repeats a few hundred names many times.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable

from megaloom.runtime.registry import COMM, COPY, CUBE, HOST, VECTOR


@dataclass(frozen=True, slots=True)
class EventClass:
    """One row of a class table: events whose name matches ``pattern`` (case-insensitive)."""

    label: str
    engine: str
    pattern: str


DEVICE_CLASSES: tuple[EventClass, ...] = (
    EventClass("memcpy", COPY, r"^memcpy|^dma"),  # host <-> device and device copies (own copy engines)
    EventClass("memset", COPY, r"^memset"),  # device memory fills
    EventClass("rccl", COMM, r"rccl"),  # AMD RCCL collectives
    EventClass("nccl", COMM, r"nccl"),  # NVIDIA NCCL collectives and send/recv (ncclKernel_*, ncclDevKernel_*)
    EventClass("gloo", COMM, r"gloo"),  # gloo collectives
    # DeepEP expert-parallel dispatch / combine / notify kernels
    EventClass("deepep", COMM, r"deep_?ep\b|deep_?ep::|(?:^|[\s:<(])ep::(?:\w+::)*\w*(?:dispatch|combine|notify)"),
    EventClass("nvshmem", COMM, r"nvshmem"),  # NVSHMEM one-sided communication
    EventClass("hccl", COMM, r"hccl"),  # Huawei HCCL collectives
    EventClass("flash", CUBE, r"flash|fmha"),  # FlashAttention and fused multi-head attention
    EventClass("cutlass", CUBE, r"cutlass"),  # CUTLASS GEMMs and convolutions
    EventClass("rocblas", CUBE, r"^cijk_|rocblas|hipblaslt|tensile"),  # rocBLAS / hipBLASLt (Tensile Cijk_) GEMMs
    # cuBLAS GEMMs and GEMVs on the SIMT lanes (sgemm, dgemm, gemv: no tensor cores)
    EventClass("simt_gemm", VECTOR, r"(?:^|[_\s:])[sdcz]gemm(?:_|\b)|gemv|gemmk1|gemmSN"),
    EventClass("wgmma", CUBE, r"wgmma|\bsm9\d_xmma|\bsm90_"),  # Hopper warpgroup tensor-core kernels
    EventClass("xmma", CUBE, r"xmma"),  # cuBLAS / cuDNN xmma tensor-core kernels
    EventClass("cublas", CUBE, r"cublas|gemm|[hs]\d{3,5}gemm|\bhmma|\bimma"),  # cuBLAS / cuBLASLt tensor-core GEMMs
    # cuDNN convolutions (scudnn, dgrad, wgrad, winograd, implicit GEMM)
    EventClass("cudnn", CUBE, r"scudnn|dgrad|wgrad|winograd|implicit_convolve|conv\w*fprop|fprop\w*conv"),
    EventClass("kernel", VECTOR, r""),  # any other kernel: element-wise, reductions, normalisation, copies in kernels
)
"""Device ops (``kernel``, ``gpu_memcpy``, ``gpu_memset`` categories), by name."""

CPU_CLASSES: tuple[EventClass, ...] = (
    EventClass("cpu_comm", COMM, r"^c10d::|gloo|nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
               r"broadcast|\bsend\b|\brecv\b"),  # collectives run on the CPU
    # GEMMs and convolutions run on the CPU and their autograd nodes (an op whose nest holds a GEMM is classed here too)
    EventClass("cpu_gemm", CUBE, r"^(?:aten::)?(?:mm|addmm|bmm|baddbmm|addbmm|matmul|linear|einsum|_scaled_mm|"
               r"_grouped_mm|conv\w*|convolution\w*|cudnn_convolution\w*)$|"
               r"(?:Mm|Bmm|Linear|GroupedMm|Convolution)Backward\d*$"),
    EventClass("cpu_op", VECTOR, r""),  # any other CPU op
)
"""Top-level CPU ops of a trace with no device activity (the CPU was the device). A ``c10d::``
op that only hands a collective to a backend thread is host work; the collective is a task
on that thread (its ``gloo:all_reduce`` annotation)."""

RUNTIME = EventClass("runtime", HOST, r"")
"""Host work: runtime and driver calls, CPU ops launching device work."""

SYNC_CALLS: tuple[tuple[str, str], ...] = (
    ("device", r"^(?:cuda|hip)(?:Device|Ctx)Synchronize$|^cuCtxSynchronize"),
    ("stream", r"^(?:cuda|hip)StreamSynchronize$|^cuStreamSynchronize"),
    ("event", r"^(?:cuda|hip)EventSynchronize$|^cuEventSynchronize"),
    ("copy", r"^(?:cuda|hip)Memcpy(?:2D|3D|ToSymbol|FromSymbol|WithStream)?$|^(?:cuda|hip)Memset(?:2D|3D)?$|"
             r"^cuMemcpy(?:HtoD|DtoH|DtoD)?(?:_v2)?$"),
    ("wait", r"^(?:cuda|hip)StreamWaitEvent$|^cuStreamWaitEvent"),
)
"""Host runtime calls by what they wait for: ``device`` (all streams), ``stream`` or ``event``
(one stream's work), ``copy`` (its own copy; so does an async copy from device to pageable
host memory), ``wait`` (a stream waits for an event: a GPU-side wait)."""

COLLECTIVES: tuple[tuple[str, str], ...] = (
    ("all_reduce", r"all_?reduce"), ("all_gather", r"all_?gather"), ("reduce_scatter", r"reduce_?scatter"),
    ("all_to_all", r"all_?to_?all|alltoall|dispatch|combine"), ("broadcast", r"broadcast|bcast"), ("reduce", r"reduce"),
    ("send_recv", r"send|recv|sendrecv|p2p"), ("barrier", r"barrier"))
"""Collective kind of a comm kernel or of a ``Collective name`` argument, first match wins."""

IMPLICIT_SYNCS: tuple[tuple[str, str], ...] = (
    ("launch queue full", r"Launch"), ("allocator", r"Malloc|Free|HostAlloc|HostRegister|MemPool"),
    ("copy", r"Memcpy|Memset"), ("blocking call", r""))
"""Why a host call that returned only when a device op ended waited, by the call's name
(CUDA runtime API, "implicit synchronization": a full launch queue blocks the launch, freeing
memory and pageable copies synchronise)."""

_BACKEND_OP = re.compile(r"^(?:gloo|nccl|mpi|ucc|xccl):(\w+)$")
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime"})
CONTEXT_CATEGORIES = frozenset({"user_annotation", "gpu_user_annotation", "python_function"})
"""Annotations and Python frames: tags on the tasks beneath them, never tasks."""


def _lookup(rows: Iterable[tuple[Any, str]], flags: int = 0) -> Callable[[str], Any]:
    """A name's value in a table of ``(value, pattern)`` rows: the first row whose pattern it matches, or None."""
    table = [(re.compile(p, flags), v) for v, p in rows]
    return lru_cache(maxsize=None)(lambda name: next((v for rx, v in table if rx.search(name)), None))


_device_class = _lookup(((c, c.pattern) for c in DEVICE_CLASSES), re.I)
cpu_class = _lookup(((c, c.pattern) for c in CPU_CLASSES), re.I)
"""The class of a top-level CPU op in a trace with no device activity."""
sync_kind = _lookup(SYNC_CALLS)
"""What a host runtime call waits for (see :data:`SYNC_CALLS`), or None."""
collective = _lookup(COLLECTIVES, re.I)
"""The collective kind of a comm kernel name or ``Collective name`` argument, or None."""
implicit_sync = _lookup(IMPLICIT_SYNCS)
"""Why a host call blocked on the device (see :data:`IMPLICIT_SYNCS`)."""


def device_class(name: str, category: str = "kernel") -> EventClass:
    """The class of a device op; memcpy / memset categories are copies whatever their name."""
    return DEVICE_CLASSES[category == "gpu_memset"] if category in ("gpu_memcpy", "gpu_memset") else _device_class(name)


def backend_op(name: str) -> str | None:
    """The collective of a communication backend's own annotation (``gloo:all_reduce``,
    ``gloo:send``: op ``send``), or None."""
    if (m := _BACKEND_OP.match(name)) is None:
        return None
    return m[1] if m[1] in ("send", "recv") else collective(m[1]) or m[1]


def labels() -> list[str]:
    """Every class label (what ``--speedup LABEL=F`` accepts besides engine kinds)."""
    return [c.label for c in (*DEVICE_CLASSES, *CPU_CLASSES, RUNTIME)]
