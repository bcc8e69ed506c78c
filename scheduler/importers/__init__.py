"""Importers: traces recorded by other tools, turned into replayable megaloom traces."""
from megaloom.scheduler.importers.torch_profiler import ImportReport, import_torch_profiler, op_class

__all__ = ["ImportReport", "import_torch_profiler", "op_class"]
