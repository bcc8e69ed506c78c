"""Read a PyTorch profiler (Kineto) Chrome trace: plain or gzipped JSON, validated events.

Every event is checked as it is read; a malformed one raises :class:`TraceFormatError`
naming its position: times must be finite and within 1e18 us, a grid must hold fewer than
2**63 blocks (a sync naming its stream by a list is only counted). Gzip data may expand to
at most :data:`MAX_JSON_BYTES` (``megaloom replay --max-json-mib`` raises it), never more.
What is not a timed slice is sorted out here: flow events (``s``/``t``/``f``), the CUDA sync
records (``cuda_sync``), and what the import does not use (metadata, counters, instants, the
profiler's own span), which is only counted.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from megaloom.runtime.errors import TraceFormatError

_MAGIC = ((b"\x1f\x8b", "gzip data"), (b"PK\x03\x04", "a zip archive"), (b"\x89PNG", "a PNG image"),
          (b"%PDF", "a PDF document"), (b"\x7fELF", "an executable"), (b"SQLite format 3", "an SQLite database"))
_UNUSED_PHASES = {"M": "metadata", "C": "counter", "i": "instant", "I": "instant", "R": "mark", "n": "instant",
                  "O": "object snapshot", "N": "object", "D": "object", "P": "sample"}
_TRACK = (int, str, type(None))
MAX_JSON_BYTES = 512 << 20
_MAX_US = 1e18  # 1e12 s, the bound of every trace clock


@dataclass(slots=True)
class Slice:
    """A timed event (``X``, or a ``B``/``E`` pair) on track ``(pid, tid)``; times in microseconds."""

    name: str
    cat: str
    pid: Any
    tid: Any
    start: float
    end: float
    args: dict
    seq: int
    truncated: bool = False


@dataclass(slots=True)
class RawTrace:
    """The validated content of one file."""

    path: str
    slices: list[Slice]
    flows: list[dict]
    syncs: list[dict]
    header: dict[str, Any]
    skipped: Counter[str] = field(default_factory=Counter)


def describe(raw: bytes) -> str:
    """What a file that is not a trace looks like, in a few words."""
    if not raw:
        return "an empty file"
    if what := next((what for magic, what in _MAGIC if raw.startswith(magic)), None):
        return what
    if 0x80 <= raw[0] <= 0x8F or raw[0] == 0xDE:
        return "msgpack data (a map) that is not a megaloom trace"
    try:
        return f"text starting with {raw[:48].decode('utf-8').strip()[:40]!r}"
    except UnicodeDecodeError:
        return f"binary data starting with bytes {raw[:8].hex(' ')}"


def read_bytes(path: str | os.PathLike) -> bytes:
    """The file's bytes, gunzipped when it is gzip data."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
                raw = f.read(MAX_JSON_BYTES + 1)  # no more, whatever the file claims
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"{path}: gzip data is corrupt or truncated: {e}") from None
        if len(raw) > MAX_JSON_BYTES:
            raise TraceFormatError(f"{path}: gzip data expands past {MAX_JSON_BYTES >> 20} MiB (a gzip bomb? "
                                   "megaloom replay --max-json-mib raises the limit)")
    return raw


def load_json(path: str | os.PathLike, raw: bytes) -> tuple[list[Any], dict[str, Any]]:
    """``traceEvents`` and the other top-level keys of a Chrome trace's JSON text."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path}: not a profiler trace: {describe(raw)}") from None
    except json.JSONDecodeError as e:
        if e.pos == 0:
            raise TraceFormatError(f"{path}: not a profiler trace (JSON): {describe(raw)}") from None
        raise TraceFormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise TraceFormatError(f"{path}: JSON nested too deeply") from None
    if isinstance(data, list):
        return data, {}
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        keys = sorted(map(str, data))[:8] if isinstance(data, dict) else type(data).__name__
        raise TraceFormatError(f"{path}: no 'traceEvents' list (a JSON {'object with keys ' if isinstance(data, dict) else ''}"
                               f"{keys}); expected a torch.profiler / Chrome trace")
    return events, {k: v for k, v in data.items() if k != "traceEvents"}


def _bad(i: int, what: str) -> TraceFormatError:
    return TraceFormatError(f"event {i}: {what}")


def _time(e: dict, key: str, i: int) -> float:
    v = e.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and -_MAX_US < v < _MAX_US:
        return float(v)
    raise _bad(i, f"field {key!r} must be a finite number within 1e18 us, got {v!r:.40}")


def _slice(i: int, e: dict, cat: str, start: float, end: float, seq: int) -> Slice:
    name, args = e.get("name", ""), e.get("args")
    if type(name) is not str:
        raise _bad(i, "'name' must be a string")
    if type(args) is not dict:
        args = {}
    elif type(args.get("grid")) is list and math.prod(g for g in args["grid"] if type(g) is int and g > 0) >= 1 << 63:
        raise _bad(i, f"grid {args['grid']!r:.60} holds 2**63 blocks or more")  # the blocks tag is an int64
    return Slice(name, cat, e.get("pid"), e.get("tid"), start, end, args, seq)


def read(path: str | os.PathLike) -> RawTrace:
    """Read and validate ``path``; every malformed event raises TraceFormatError naming its position."""
    events, header = load_json(path, read_bytes(path))
    try:
        return _sort(os.fspath(path), events, header)
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}") from None


def _sort(path: str, events: list[Any], header: dict[str, Any]) -> RawTrace:
    slices, flows, syncs = [], [], []  # Slice, flow event, sync record
    skipped: Counter[str] = Counter()
    open_b: dict[tuple, list[tuple[int, Slice]]] = {}  # begun slices by track, ended by their ``E``
    for i, e in enumerate(events):
        if type(e) is not dict:
            raise _bad(i, f"expected an object, got {type(e).__name__}")
        ph, cat, pid, tid = e.get("ph"), str(e.get("cat", "")), e.get("pid"), e.get("tid")
        if ph != "X":
            if type(ph) is not str:
                raise _bad(i, "missing phase 'ph'")
            if ph in _UNUSED_PHASES:
                skipped[_UNUSED_PHASES[ph]] += 1
                continue
        if type(pid) not in _TRACK or type(tid) not in _TRACK:
            raise _bad(i, "pid/tid must be numbers or strings")
        if ph == "X":
            ts, dur = e.get("ts"), e.get("dur")  # the common case inline: this runs for every event
            tt, td = type(ts), type(dur)
            if not ((tt is int or tt is float) and (td is int or td is float) and -_MAX_US < ts < _MAX_US
                    and -_MAX_US < dur < _MAX_US):
                ts, dur = _time(e, "ts", i), _time(e, "dur", i)
            if dur < 0:
                raise _bad(i, f"({e.get('name')!r:.60}): negative duration {dur} (clock wrap or broken clock)")
            if cat == "cuda_sync":
                args = e.get("args")
                if type(args) is dict and any(type(args.get(k)) in (list, dict) for k in ("stream", "wait_on_stream")):
                    skipped["sync on a stream that is a list"] += 1
                else:
                    syncs.append(e)
            elif cat == "Trace":  # the profiler's own span
                skipped["profiler span"] += 1
            else:
                slices.append(_slice(i, e, cat, float(ts), float(ts + dur), len(slices)))
        elif ph in ("s", "t", "f"):
            _time(e, "ts", i)
            if cat == "ac2g":  # launch flows: the correlation ids say the same
                skipped["launch flow (by correlation id)"] += 1
            else:
                flows.append(e)
        elif ph == "B":
            end = _time(e, "ts", i)
            open_b.setdefault((pid, tid), []).append((i, _slice(i, e, cat, end, end, -1)))
        elif ph == "E":
            if not open_b.get((pid, tid)):
                raise _bad(i, f"end event with no open begin on track {(pid, tid)}")
            j, b = open_b[pid, tid].pop()
            if (end := _time(e, "ts", i)) < b.start:
                raise _bad(i, f"ends at {end} before its begin (event {j}) at {b.start} (clock wrap?)")
            b.cat, b.end, b.seq = b.cat or cat, end, len(slices)
            slices.append(b)
        else:
            skipped[f"phase {ph!r:.12}"] += 1
    for track, begun in open_b.items():
        for _, b in begun:  # a begin without its end: kept up to the track's last timestamp
            last = max([s.end for s in slices if (s.pid, s.tid) == track] + [o.start for _, o in begun])
            b.end, b.seq, b.truncated = last, len(slices), True
            slices.append(b)
    return RawTrace(path, slices, flows, syncs, header, skipped)
