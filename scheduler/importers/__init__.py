"""Importers: traces recorded by other tools, turned into replayable megaloom traces.

Every format megaloom reads is one :class:`Format` in :data:`FORMATS`, found by content (the
file's first bytes), never by name. A format brings its loader (one file, or one file per
rank replayed together), the class labels its tasks carry (what ``--speedup LABEL=F``
accepts) and, optionally, how to recompute a task's work figures for other shapes. A second
profiler format (an Nsight Systems JSON export, Ascend msprof, ...) plugs in with
:func:`register` from its own module, without touching replay or the other importers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.trace import Trace

__all__ = ["FORMATS", "Format", "ImportReport", "import_ranks", "import_torch_profiler", "labels", "load_trace",
           "load_traces", "register", "reshaped"]

@dataclass(frozen=True, slots=True)
class Format:
    """One trace format: ``sniff(head)`` on the file's first 64 bytes; ``load(paths)`` gives one
    trace of those files (several: one per rank) and their import reports; ``labels``: its
    tasks' class labels; ``reshape(sources, dims)``: the flops and bytes factors of a task
    whose recorded ``sources`` tag names its ops and shapes, with dimensions renamed by ``dims``."""

    name: str
    sniff: Callable[[bytes], bool]
    load: Callable[[list[Path]], tuple[Trace, list]]
    labels: tuple[str, ...] = ()
    reshape: Callable[[list, Mapping[int, int]], tuple[float, float] | None] | None = None
    several: bool = True
    """whether several files replay together (one per rank)"""


FORMATS: list[Format] = []


def register(fmt: Format) -> None:
    """Add (or replace, by name) a format; later ones are tried first."""
    FORMATS[:] = [f for f in FORMATS if f.name != fmt.name]
    FORMATS.insert(0, fmt)


def labels() -> list[str]:
    """Every class label of every format."""
    return list(dict.fromkeys(x for f in FORMATS for x in f.labels))


def reshaped(source: str | None, sources: list, dims: Mapping[int, int]) -> tuple[float, float] | None:
    """Flops and bytes factors of a task of a trace from ``source`` (its format's name) under ``dims``."""
    fmt = next((f for f in FORMATS if f.name == source and f.reshape is not None), None)
    return fmt.reshape(sources, dims) if fmt else None


def _format(path: Path) -> Format:
    from megaloom.scheduler.importers.kineto.read import describe

    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e.strerror}") from None
    if (fmt := next((f for f in FORMATS if f.sniff(head)), None)) is None:
        raise TraceFormatError(f"{path}: not a trace megaloom reads ({', '.join(f.name for f in reversed(FORMATS))}): "
                               f"it looks like {describe(head)}")
    return fmt


def load_trace(path: str | os.PathLike) -> Trace:
    """One trace file of any registered format, by content."""
    return load_traces([path])[0]


def load_traces(paths: list[str | os.PathLike]) -> tuple[Trace, list]:
    """One trace of one file, of several ranks' files, or of every ``*.json[.gz]`` in a
    directory (sorted by name); and the import reports (none for a megaloom trace)."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        if not (found := sorted(p for p in Path(paths[0]).iterdir() if p.name.endswith((".json", ".json.gz")))):
            raise TraceFormatError(f"{paths[0]}: no .json or .json.gz trace files in this directory")
        paths = found
    fmts = [_format(Path(p)) for p in paths]
    if len(paths) > 1 and (len(set(fmts)) > 1 or not fmts[0].several):
        raise TraceFormatError(f"{paths[0]}: several files replay together only as profiler traces of one format "
                               "(one per rank)")
    return fmts[0].load([Path(p) for p in paths])


def _mlt(head: bytes) -> bool:
    return bool(head[:1]) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def _load_mlt(paths: list[Path]) -> tuple[Trace, list]:
    trace = Trace.load(paths[0])
    if trace.meta.get("mode") == "execute" and str(trace.meta.get("graph", "")).startswith("train-step-"):
        raise TraceFormatError(f"{paths[0]}: a megaloom trainer step trace (spans of phases and modules, without "
                               "the dependencies between them) cannot be replayed: record the step with torch.profiler "
                               "(prof.export_chrome_trace) and replay that file")
    return trace, []


register(Format("megaloom trace (.mlt)", _mlt, _load_mlt, several=False))

from megaloom.scheduler.importers.kineto import ImportReport, import_ranks, import_torch_profiler  # noqa: E402
