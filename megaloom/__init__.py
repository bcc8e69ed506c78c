"""megaloom: a dataflow runtime for fine-grained accelerator task graphs.

The public API, re-exported lazily from the layers (``megaloom.runtime``,
``megaloom.scheduler``, ``megaloom.comm``, ``megaloom.graphs``, ...), so that
``import megaloom`` stays cheap and each layer loads when first used.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "megaloom.runtime": [
        "Buffer", "Region", "Task", "TaskGraph", "Composed", "Core", "Policy", "FIFO", "Cost", "OpDef", "TensorSpec",
        "register", "get_op", "all_ops", "ReferenceExecutor", "ThreadExecutor", "ExecContext", "Observer",
        "RunResult", "Trace", "TraceEvent", "merge", "metrics", "summary", "to_chrome", "write_chrome",
        "MegaloomError", "GraphError", "ScheduleError", "ExecutionError", "DeadlockError", "CommError",
        "TraceFormatError", "ConfigError", "CheckpointError",
    ],
    "megaloom.scheduler": ["Simulator", "CostModel", "HardwareProfile", "load_profile", "list_profiles", "make_policy"],
    "megaloom.graphs": ["MegaMoE", "MegaGate", "MegaMHC"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'megaloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
