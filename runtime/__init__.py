"""Graph IR, microkernel core, executors and traces."""
from megaloom.runtime.compose import Composed
from megaloom.runtime.core import FIFO, Core, Policy
from megaloom.runtime.errors import (
    CheckpointError, CommError, ConfigError, DeadlockError, ExecutionError, GraphError, MegaloomError, ScheduleError,
    TraceFormatError,
)
from megaloom.runtime.executors import ExecContext, Executor, Observer, ReferenceExecutor, RunResult, ThreadExecutor
from megaloom.runtime.graph import Buffer, Region, Task, TaskGraph
from megaloom.runtime.metrics import Metrics, metrics, summary
from megaloom.runtime.perfetto import PerfettoObserver, to_chrome, write_chrome
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, all_ops, get_op, register
from megaloom.runtime.trace import Trace, TraceEvent, merge

__all__ = [
    "Buffer", "CheckpointError", "CommError", "Composed", "ConfigError", "Core", "Cost", "DeadlockError", "ExecContext", "ExecutionError",
    "Executor", "FIFO", "GraphError", "MegaloomError", "Metrics", "Observer", "OpDef", "PerfettoObserver", "Policy",
    "ReferenceExecutor", "Region", "RunResult", "ScheduleError", "Task", "TaskGraph", "TensorSpec",
    "ThreadExecutor", "Trace", "TraceEvent", "TraceFormatError", "all_ops", "get_op", "merge", "metrics",
    "register", "summary", "to_chrome", "write_chrome",
]
