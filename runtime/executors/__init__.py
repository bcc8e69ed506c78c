"""Executors: the reference oracle and the thread-pool executor (the simulator is in scheduler).

:data:`EXECUTORS` names them for configurations and command lines: ``reference``,
``threaded`` (also ``thread``); plug-ins add theirs through the ``megaloom.executors``
entry-point group (each entry point loads an Executor class).
"""
from megaloom.runtime.executors.base import ExecContext, Executor, Observer, RunResult, drop_plans
from megaloom.runtime.executors.reference import ReferenceExecutor
from megaloom.runtime.executors.threaded import ThreadExecutor
from megaloom.runtime.plugins import Registry

EXECUTORS: Registry[type[Executor]] = Registry("executor", "megaloom.executors")
EXECUTORS.register(ReferenceExecutor.name, ReferenceExecutor)
EXECUTORS.register(ThreadExecutor.name, ThreadExecutor)
EXECUTORS.register("thread", ThreadExecutor)  # the name configurations use

__all__ = ["EXECUTORS", "ExecContext", "Executor", "Observer", "ReferenceExecutor", "RunResult", "ThreadExecutor",
           "drop_plans"]
