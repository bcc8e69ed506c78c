"""Importers: traces recorded by other tools, turned into replayable megaloom traces."""
from __future__ import annotations

import os

from megaloom.runtime.trace import Trace
from megaloom.scheduler.importers.torch_profiler import ImportReport, import_torch_profiler, op_class

__all__ = ["ImportReport", "import_torch_profiler", "load_trace", "op_class"]


def load_trace(path: str | os.PathLike) -> Trace:
    """A megaloom trace (msgpack) or a torch.profiler Chrome JSON file (``.json``), by extension."""
    if os.fspath(path).endswith(".json"):
        return import_torch_profiler(path)[0]
    return Trace.load(path)
