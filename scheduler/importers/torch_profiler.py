"""Import PyTorch profiler traces (``export_chrome_trace`` JSON) as megaloom traces.

What becomes what:

* Timed events (``X``, and ``B``/``E`` pairs) become tasks. On CPU threads only the
  outermost op of each nest is a task (its children are inside it); the nest decides its
  op class and shapes. GPU kernels, memcpy and memset are tasks on their stream.
* Engine kinds by op class: GEMM/conv -> ``cube``; element-wise and reductions ->
  ``vector``; collectives and memcpy/memset -> ``comm``; CUDA runtime/driver calls ->
  ``host``. Events of unknown categories are kept as ``opaque`` tasks on ``vector``,
  tagged with their category: never dropped silently (the report counts them).
* One unit per track (thread or stream) within an engine kind.
* Dependencies: program order on each track; flow events (``s``/``t``/``f``, e.g.
  forward->backward); launch correlations (runtime call -> kernel); stream waits
  (``cuda_sync`` events naming ``wait_on_stream``).
* The graph is acyclic by construction: tasks are ordered by start time, and a
  dependency that points backwards in time (the trace contradicts itself) is dropped at
  that point and counted in the report.
* A ``B`` with no ``E`` ends at its track's last timestamp and is tagged ``truncated``;
  an end before its start (a wrapped or broken clock) is refused with the event's
  position, as is any malformed event: :class:`TraceFormatError`, never anything else.
"""
from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from megaloom.ops.basic import precision
from megaloom.runtime.dtypes import itemsize
from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.trace import Trace, TraceEvent

_COMM = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|c10d::|gloo|memcpy|memset|"
                   r"\bsend\b|\brecv\b", re.I)
_CUBE = re.compile(r"\b(aten::)?(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|einsum|_scaled_mm|conv\w*|"
                   r"convolution\w*)\b|gemm|cutlass|xmma|cublas|wgmma|flash", re.I)
_HOST_CATS = {"cuda_runtime", "cuda_driver", "python_function", "user_annotation", "gpu_user_annotation"}
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_KNOWN_CATS = {"cpu_op", "cpu_instant_event", "ac2g", "fwdbwd", "cuda_sync"} | _HOST_CATS | _DEVICE_CATS
_META_CATS = {"Trace"}  # the profiler's own span
_DTYPE = {"float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
          "long int": "int64", "int": "int32", "bool": "bool", "signed char": "int8", "unsigned char": "uint8"}


def op_class(name: str, category: str = "cpu_op") -> str:
    """Engine kind of an op or kernel name: cube, vector, comm or host."""
    if category in ("gpu_memcpy", "gpu_memset") or _COMM.search(name):
        return "comm"
    if category in _HOST_CATS:
        return "host"
    if _CUBE.search(name):
        return "cube"
    return "vector"


@dataclass(slots=True)
class ImportReport:
    """What the import did with every event, so nothing goes unaccounted."""

    tasks: int = 0
    nested: int = 0
    opaque: int = 0
    truncated: int = 0
    flows: int = 0
    correlations: int = 0
    stream_waits: int = 0
    contradictions: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, what: str) -> None:
        self.skipped[what] = self.skipped.get(what, 0) + 1


@dataclass(slots=True)
class _Slice:
    name: str
    cat: str
    track: tuple[Any, Any]
    start: float
    end: float
    args: dict[str, Any]
    seq: int
    truncated: bool = False
    children: list[_Slice] = field(default_factory=list)


def _num(e: dict, key: str, i: int) -> float:
    v = e.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise TraceFormatError(f"event {i}: field {key!r} must be a number, got {v!r:.40}")
    return float(v)


def _read(path: str | os.PathLike) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceFormatError(f"{path}: no 'traceEvents' list")
    return events


def _slices(events: list[Any], report: ImportReport) -> tuple[list[_Slice], list[tuple[int, dict]]]:
    """Timed slices (X and matched B/E) and the flow/sync events, validated."""
    out: list[_Slice] = []
    marks: list[tuple[int, dict]] = []
    open_b: dict[tuple[Any, Any], list[tuple[int, dict]]] = {}
    last_ts: dict[tuple[Any, Any], float] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceFormatError(f"event {i}: expected an object, got {type(e).__name__}")
        ph = e.get("ph")
        if not isinstance(ph, str):
            raise TraceFormatError(f"event {i}: missing phase 'ph'")
        cat = e.get("cat", "")
        cat = cat if isinstance(cat, str) else str(cat)
        track = (e.get("pid"), e.get("tid"))
        if not isinstance(track[0], (int, str, type(None))) or not isinstance(track[1], (int, str, type(None))):
            raise TraceFormatError(f"event {i}: pid/tid must be numbers or strings")
        if ph in ("M", "i", "I", "C", "R", "n"):
            report.skip({"M": "metadata", "C": "counter"}.get(ph, "instant"))
            continue
        if ph in ("s", "t", "f") or (ph == "X" and cat == "cuda_sync"):
            _num(e, "ts", i)
            marks.append((i, e))
            continue
        if cat in _META_CATS:
            report.skip(f"category {cat}")
            continue
        name = e.get("name", "")
        if not isinstance(name, str):
            raise TraceFormatError(f"event {i}: 'name' must be a string")
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if ph == "X":
            ts, dur = _num(e, "ts", i), _num(e, "dur", i)
            if dur < 0:
                raise TraceFormatError(f"event {i} ({name!r}): negative duration {dur} (clock wrap or broken clock)")
            out.append(_Slice(name, cat, track, ts, ts + dur, args, len(out)))
        elif ph == "B":
            open_b.setdefault(track, []).append((i, e))
            _num(e, "ts", i)
        elif ph == "E":
            stack = open_b.get(track)
            if not stack:
                raise TraceFormatError(f"event {i}: end event with no open begin on track {track}")
            j, b = stack.pop()
            ts, te = float(b["ts"]), _num(e, "ts", i)
            if te < ts:
                raise TraceFormatError(f"event {i}: ends at {te} before its begin (event {j}) at {ts} (clock wrap?)")
            out.append(_Slice(b.get("name", ""), b.get("cat", "") or cat, track, ts, te,
                              b.get("args") if isinstance(b.get("args"), dict) else {}, len(out)))
        else:
            report.skip(f"phase {ph}")
            continue
        last_ts[track] = max(last_ts.get(track, float("-inf")), out[-1].end if ph != "B" else float(e["ts"]))
    for track, stack in open_b.items():
        for j, b in stack:
            ts = float(b["ts"])
            out.append(_Slice(b.get("name", ""), b.get("cat", ""), track, ts, max(ts, last_ts.get(track, ts)),
                              b.get("args") if isinstance(b.get("args"), dict) else {}, len(out), truncated=True))
            report.truncated += 1
    return out, marks


def _outermost(slices: list[_Slice], report: ImportReport) -> list[_Slice]:
    """Per track, the slices not inside another one; nested ones become children."""
    by_track: dict[Any, list[_Slice]] = {}
    for s in slices:
        by_track.setdefault(s.track, []).append(s)
    top: list[_Slice] = []
    for items in by_track.values():
        items.sort(key=lambda s: (s.start, -(s.end - s.start), s.seq))
        stack: list[_Slice] = []
        for s in items:
            while stack and s.start >= stack[-1].end:
                stack.pop()
            if stack and s.end <= stack[-1].end:
                stack[-1].children.append(s)
                report.nested += 1
            else:
                top.append(s)  # overlapping but not nested: a sibling on the same track
            stack.append(s)
    top.sort(key=lambda s: (s.start, s.seq))
    return top


def _walk(s: _Slice):
    yield s
    for c in s.children:
        yield from _walk(c)


_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|linear)$")


def _work(s: _Slice) -> tuple[float, float, list[list[int]], str]:
    """Flops, bytes, dims and precision of the innermost GEMM in the nest (from recorded shapes)."""
    for n in reversed(list(_walk(s))):
        dims, types = n.args.get("Input Dims"), n.args.get("Input type")
        if not isinstance(dims, list) or not _GEMM.match(n.name):
            continue
        mats = [d for d in dims if isinstance(d, list) and len(d) in (2, 3) and all(isinstance(v, int) for v in d)]
        if len(mats) < 2:
            continue
        a, b = mats[0], mats[1]
        batch = a[0] if len(a) == 3 else 1
        m, k = a[-2], a[-1]
        nn = b[-2] if n.name == "aten::linear" else b[-1]  # linear's weight is [out, in]
        dtype = _DTYPE.get(types[0], "float32") if isinstance(types, list) and types and isinstance(types[0], str) else "float32"
        flops = 2.0 * batch * m * k * nn
        nbytes = itemsize(dtype) * batch * (m * k + k * nn + m * nn)
        return flops, float(nbytes), mats, precision(dtype)
    return 0.0, 0.0, [], "fp32"


def _enclosing(starts: dict[Any, list[float]], tasks_on: dict[Any, list[int]], top: list[_Slice],
               track: Any, ts: float) -> int:
    """Index of the task on ``track`` whose span contains ``ts`` (else the next one), or -1."""
    st = starts.get(track)
    if not st:
        return -1
    k = bisect.bisect_right(st, ts) - 1
    if k >= 0 and top[tasks_on[track][k]].end >= ts:
        return tasks_on[track][k]
    return tasks_on[track][k + 1] if k + 1 < len(st) else -1


def import_torch_profiler(path: str | os.PathLike, rank: int = 0) -> tuple[Trace, ImportReport]:
    """A replayable megaloom trace of a ``torch.profiler`` Chrome JSON file, and a report."""
    report = ImportReport()
    try:
        slices, marks = _slices(_read(path), report)
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}") if not str(e).startswith(str(path)) else e from None
    top = _outermost(slices, report)
    has_device = any(s.cat in _DEVICE_CATS for s in top)
    engine_of, units = [], {}
    unit_of_track: dict[tuple[str, Any], int] = {}
    for s in top:
        if s.cat in _KNOWN_CATS or not s.cat:
            kinds = {op_class(n.name, n.cat) for n in _walk(s)}
            eng = op_class(s.name, s.cat)
            eng = "cube" if "cube" in kinds and eng == "vector" else eng
            if eng == "host" and not has_device:
                eng = "vector"
        else:
            eng = "vector"
            report.opaque += 1
        key = (eng, s.track)
        if key not in unit_of_track:
            unit_of_track[key] = units.get(eng, 0)
            units[eng] = units.get(eng, 0) + 1
        engine_of.append((eng, unit_of_track[key]))

    deps: list[set[int]] = [set() for _ in top]
    tasks_on: dict[Any, list[int]] = {}
    for idx, s in enumerate(top):
        on = tasks_on.setdefault(s.track, [])
        if on:
            deps[idx].add(on[-1])  # program order on the thread or stream
        on.append(idx)
    starts = {t: [top[i].start for i in ids] for t, ids in tasks_on.items()}

    def link(a: int, b: int, counter: str) -> None:
        if a < 0 or b < 0 or a == b:
            return
        if a > b:  # the trace orders b before a: keep time order, drop the contradicting edge
            report.contradictions += 1
            return
        deps[b].add(a)
        setattr(report, counter, getattr(report, counter) + 1)

    flows: dict[tuple[Any, Any], list[dict]] = {}
    for i, e in marks:
        if e.get("ph") in ("s", "t", "f"):
            flows.setdefault((e.get("cat"), e.get("id")), []).append(e)
    for chain in flows.values():
        chain.sort(key=lambda e: ("stf".index(e["ph"]), float(e["ts"])))  # a flow runs s -> t... -> f
        for a, b in zip(chain, chain[1:]):
            link(_enclosing(starts, tasks_on, top, (a.get("pid"), a.get("tid")), float(a["ts"])),
                 _enclosing(starts, tasks_on, top, (b.get("pid"), b.get("tid")), float(b["ts"])), "flows")
    launches = {}
    for idx, s in enumerate(top):
        for n in _walk(s):
            c = n.args.get("correlation")
            if isinstance(c, int) and n.cat in _HOST_CATS:
                launches[c] = idx
    for idx, s in enumerate(top):
        c = s.args.get("correlation")
        if s.cat in _DEVICE_CATS and isinstance(c, int) and c in launches:
            link(launches[c], idx, "correlations")
    for i, e in marks:
        if e.get("ph") == "X":
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            waited = args.get("wait_on_stream")
            if waited is None:
                continue
            ts = float(e["ts"])
            src_track, dst_track = (e.get("pid"), waited), (e.get("pid"), e.get("tid"))
            before = [j for j in tasks_on.get(src_track, []) if top[j].end <= ts]
            after = _enclosing(starts, tasks_on, top, dst_track, ts)
            if before and after >= 0:
                link(before[-1], after, "stream_waits")

    t0 = min((s.start for s in top), default=0.0)
    names: dict[str, int] = {}
    events = []
    for idx, s in enumerate(top):
        flops, nbytes, dims, prec = _work(s)
        eng, unit = engine_of[idx]
        n = names.get(s.name, 0)
        names[s.name] = n + 1
        tags: dict[str, Any] = {"category": s.cat}
        if dims:
            tags["dims"] = dims
        if s.truncated:
            tags["truncated"] = True
        if eng == "vector" and s.cat not in _KNOWN_CATS and s.cat:
            tags["opaque"] = True
        events.append(TraceEvent(idx, s.name if n == 0 else f"{s.name}#{n}", "opaque" if tags.get("opaque") else s.name,
                                 eng, unit, rank, (s.start - t0) * 1e-6, (s.end - t0) * 1e-6, flops, nbytes, 0.0,
                                 sorted(deps[idx]), tags, prec))
    report.tasks = len(events)
    meta = {"graph": os.path.basename(os.fspath(path)), "mode": "import", "source": "torch.profiler",
            "clock": "wall", "units": units, "world_size": 1, "rank": rank}
    return Trace(events, meta), report
