"""Executors: the reference oracle and the thread-pool executor (the simulator is in scheduler)."""
from megaloom.runtime.executors.base import ExecContext, Executor, Observer, RunResult
from megaloom.runtime.executors.reference import ReferenceExecutor
from megaloom.runtime.executors.threaded import ThreadExecutor

__all__ = ["ExecContext", "Executor", "Observer", "ReferenceExecutor", "RunResult", "ThreadExecutor"]
