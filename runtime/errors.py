"""One error hierarchy for the whole project, rooted at :class:`MegaloomError`."""
from __future__ import annotations


class MegaloomError(Exception):
    """Base class of every error megaloom raises on purpose."""


class GraphError(MegaloomError):
    """A task graph is malformed. ``tasks`` names the offending tasks, ``cycle`` the cycle path."""

    def __init__(self, message: str, tasks: tuple[str, ...] = (), cycle: tuple[str, ...] = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)
        self.cycle = tuple(cycle)


class ScheduleError(MegaloomError):
    """A policy, profile or engine configuration cannot schedule the graph."""


class ExecutionError(MegaloomError):
    """A task failed while running; ``task`` names it and ``__cause__`` is the original error."""

    def __init__(self, message: str, task: str | None = None):
        super().__init__(message)
        self.task = task


class DeadlockError(ExecutionError, ScheduleError):
    """A run stalled: no task can make progress (a cycle, a policy that never hands tasks
    out, a task that never ends). ``blocked`` maps each task not done to what it waits for.
    Raised by every executor and the simulator, so it is both an execution and a schedule error."""

    def __init__(self, message: str, blocked: dict[str, list[str]]):
        super().__init__(message)
        self.blocked = blocked


class CommError(MegaloomError):
    """A collective failed, timed out, or its ranks disagreed on sizes or dtypes."""


class FileFormatError(MegaloomError):
    """A file megaloom reads is corrupt, truncated, or of an unsupported schema version."""


class TraceFormatError(FileFormatError):
    """A trace or graph file is corrupt, truncated, or of an unsupported schema version."""


class ConfigError(MegaloomError):
    """A configuration file, YAML section or command-line option is invalid."""


class CheckpointError(FileFormatError):
    """A checkpoint is missing, truncated, tampered with, does not fit the model, or could not be written."""
