"""Graph IR, microkernel core, executors and traces.

Names are loaded from their modules on first use, so importing one light module (say
``megaloom.runtime.errors``) does not import torch with the executors.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compose": ["Composed"], "core": ["FIFO", "Core", "Policy"], "graph": ["Buffer", "Region", "Task", "TaskGraph"],
    "errors": ["CheckpointError", "CommError", "ConfigError", "DeadlockError", "ExecutionError", "GraphError",
               "MegaloomError", "ScheduleError", "TraceFormatError"],
    "executors": ["ExecContext", "Executor", "Observer", "ReferenceExecutor", "RunResult", "ThreadExecutor"],
    "perfetto": ["PerfettoObserver", "to_chrome", "write_chrome"], "trace": ["Trace", "TraceEvent", "merge"],
    "registry": ["Cost", "OpDef", "TensorSpec", "all_ops", "get_op", "register"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted([*_WHERE, "Metrics", "metrics", "summary"])

# loaded now: the function ``metrics`` has its module's name, which importing the module would bind here
from megaloom.runtime.metrics import Metrics, metrics, summary  # noqa: E402


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'megaloom.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megaloom.runtime.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
