"""Importers: traces recorded by other tools, turned into replayable megaloom traces."""
from __future__ import annotations

import os
from pathlib import Path

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.trace import Trace
from megaloom.scheduler.importers.kineto import ImportReport, import_ranks, import_torch_profiler, op_class
from megaloom.scheduler.importers.kineto.read import describe

__all__ = ["ImportReport", "import_ranks", "import_torch_profiler", "load_trace", "load_traces", "op_class"]


def _kind(path: str | os.PathLike) -> str:
    """``"json"`` for a Chrome / profiler trace (gzipped or not), ``"mlt"`` for a megaloom trace."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e.strerror}") from None
    if head[:2] == b"\x1f\x8b" or head.lstrip()[:1] in (b"{", b"["):
        return "json"
    if head[:1] and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return "mlt"
    raise TraceFormatError(f"{path}: not a trace megaloom reads (a megaloom .mlt file, or a torch.profiler "
                           f"JSON / JSON.gz file): it looks like {describe(head)}")


def load_trace(path: str | os.PathLike) -> Trace:
    """A megaloom trace or a profiler trace (JSON, or gzipped JSON), by content."""
    return load_traces([path])[0]


def load_traces(paths: list[str | os.PathLike]) -> tuple[Trace, list[ImportReport]]:
    """One trace of one file, of several ranks' profiler files, or of every ``*.json[.gz]`` in a
    directory (sorted by name); and the import reports (none for a megaloom trace)."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        found = sorted(p for p in Path(paths[0]).iterdir() if p.name.endswith((".json", ".json.gz")))
        if not found:
            raise TraceFormatError(f"{paths[0]}: no .json or .json.gz trace files in this directory")
        paths = list(found)
    if len(paths) == 1:
        if _kind(paths[0]) == "mlt":
            return Trace.load(paths[0]), []
        trace, report = import_torch_profiler(paths[0])
        return trace, [report]
    for p in paths:
        if _kind(p) != "json":
            raise TraceFormatError(f"{p}: several files replay together only as profiler traces (one per rank)")
    return import_ranks(paths)
