"""Stream trace events from ranks to one collector over ZeroMQ (PUSH -> PULL), msgpack-encoded.

Messages are msgpack maps ``{"v": 1, "kind": "hello" | "events" | "bye", "rank": int,
"sid": int, "sent": float, "tok": str, ...}``; ``events`` carries ``rows`` (one list per event,
in :class:`TraceEvent` field order) and ``bye`` the run's ``meta``. ``sid`` is a random
number each streamer picks: the first session heard for a rank owns it, and messages for
that rank from any other session are dropped and counted (``spoofed``), so a rank's bye
counts once and a stray sender cannot finish or skew another rank. With a key (a secret
file shared by ``megaloom collect --key`` and ``megaloom launch --trace-key``), ``tok`` must
be the rank's token, :func:`rank_token` (an HMAC of the rank, given to each rank by the
launcher), so a sender without it, or a rank speaking for another, is dropped and counted
too; without a key the stream is not authenticated. Ranks at or beyond the expected
number of ranks are dropped and counted alike.
``sent`` is the rank's ``time.perf_counter()`` at sending, the clock its events use. The
collector aligns each rank to its own wall clock with ``offset = min(received_at - sent)``
over that rank's messages (skew plus the smallest one-way delay, microseconds on one host).
An event can only have ended before the message carrying it was sent, so aligned events
after the last message received, or more than ``MAX_TIME`` (1e12 s) before it, carry a bad
clock: they are left out of the trace and counted (``bad_clock``), never failing its save.

Nothing a sender does makes the collector hang, crash or grow without bound: ZeroMQ
refuses messages over ``max_message`` bytes before buffering them (``MAXMSGSIZE``: it drops
that sender's connection, which reconnects); malformed messages are dropped and counted;
event rows are checked field by field like trace files (finite times, bounded ids and
amounts) and bad ones dropped and counted; events beyond ``max_events``, or beyond
``max_bytes`` of accepted messages, are dropped and counted. A rank that vanishes only
loses its unsent events.
"""
from __future__ import annotations

import hmac
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import msgpack
import zmq

from megaloom.runtime.errors import CommError, ConfigError
from megaloom.runtime.record import Observer
from megaloom.runtime.trace import MAX_TIME, REQUIRED_COLUMNS, Trace, TraceEvent, meta_problem, row_problem

PROTOCOL = 1
MAX_MESSAGE = 8 << 20
MAX_EVENTS = 5_000_000  # about 2 GB of events in memory
MAX_BYTES = 512 << 20  # of accepted event messages
_FIELDS = [f.name for f in fields(TraceEvent)]


class TraceStreamer(Observer):
    """An executor observer that PUSHes this rank's events to ``endpoint`` in batches.

    Sends never block: when the collector is absent and the queue is full, or a message
    would exceed :data:`MAX_MESSAGE`, events are dropped and counted in ``dropped``.
    ``close`` waits at most ``linger`` seconds.
    """

    def __init__(self, endpoint: str, rank: int, *, batch: int = 256, linger: float = 1.0, hwm: int = 1000,
                 token: str | None = None):
        self.rank, self.batch, self.dropped, self.token = rank, batch, 0, token
        self._ctx = zmq.Context()  # its own, so close() can flush it before the process exits
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, int(linger * 1000))
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._rows: list[list[Any]] = []
        self._sid = secrets.randbits(62)
        self._send({"kind": "hello"})

    def _send(self, msg: dict[str, Any]) -> None:
        msg.update(v=PROTOCOL, rank=self.rank, sid=self._sid, tok=self.token, sent=time.perf_counter())
        data = msgpack.packb(msg, use_bin_type=True)
        try:
            if len(data) > MAX_MESSAGE:  # the collector would drop the connection
                raise zmq.Again
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += len(msg.get("rows", ())) or 1

    def on_task(self, event: TraceEvent) -> None:
        with self._lock:
            self._rows.append([getattr(event, f) for f in _FIELDS])
            if len(self._rows) >= self.batch:
                self._flush()

    def _flush(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            self._send({"kind": "events", "rows": rows})

    def on_run_end(self, trace: Trace) -> None:
        with self._lock:
            self._flush()
            self._send({"kind": "bye", "meta": {k: v for k, v in trace.meta.items() if _plain(v)}})

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._sock.close()
            self._ctx.term()  # waits at most ``linger`` for queued messages


def streamer_from_env(rank: int, **kw: Any) -> TraceStreamer | None:
    """A streamer to ``$MEGALOOM_TRACE`` with token ``$MEGALOOM_TRACE_TOKEN`` (both set by
    ``megaloom launch --trace [--trace-key]``), or None when unset."""
    endpoint = os.environ.get("MEGALOOM_TRACE")
    return TraceStreamer(endpoint, rank, token=os.environ.get("MEGALOOM_TRACE_TOKEN"), **kw) if endpoint else None


def rank_env(rank: int, endpoint: str | None, key: bytes | None) -> dict[str, str]:
    """What ``megaloom launch`` adds to a rank's environment for :func:`streamer_from_env`."""
    env = {"MEGALOOM_TRACE": endpoint} if endpoint else {}
    if key is not None:
        env["MEGALOOM_TRACE_TOKEN"] = rank_token(key, rank)
    return env


def rank_token(key: bytes, rank: int) -> str:
    """The token rank ``rank`` sends with a stream ``key``: a rank cannot derive another's."""
    return hmac.new(key, b"megaloom trace rank %d" % rank, "sha256").hexdigest()


def read_key(path: str, create: bool = False) -> bytes:
    """The stream key in file ``path``; with ``create``, a new random key is written there
    first (mode 0600) when there is none. ConfigError if it cannot be read or is too short."""
    try:
        if create and not os.path.exists(path):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(secrets.token_hex(32))
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"trace key {path}: {e.strerror or e}") from None
    if len(key) < 16:
        raise ConfigError(f"trace key {path}: shorter than 16 bytes")
    return key


def _plain(v: Any) -> bool:
    try:
        msgpack.packb(v)
        return True
    except (TypeError, ValueError):
        return False


@dataclass(slots=True)
class CollectStats:
    """What a collector saw: messages accepted and dropped (malformed; for a rank another session
    owns, without its token or out of range), bytes of events accepted, event rows dropped (bad
    values, over a cap, bad clock), ranks seen and finished."""

    received: int = 0
    malformed: int = 0
    spoofed: int = 0
    events: int = 0
    bytes: int = 0
    bad_rows: int = 0
    over_cap: int = 0
    bad_clock: int = 0
    ranks: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)

    def __str__(self) -> str:
        return (f"{self.events} events from ranks {sorted(self.ranks)} (finished {sorted(self.finished)}); dropped "
                f"{self.malformed} malformed messages, {self.spoofed} for ranks another sender owns (or unknown, or "
                f"without their token), {self.bad_rows} events with bad values, {self.bad_clock} with a bad clock, "
                f"{self.over_cap} events over --max-events or --max-bytes")


class Collector:
    """PULL socket bound to ``endpoint`` (loopback by default) that merges ranks' events.

    ``run`` returns when ``ranks`` ranks have said bye, after ``idle`` seconds without a
    message, after ``duration`` seconds in all, or once :meth:`stop` is called (from a
    signal handler, say), whichever comes first. Events beyond ``max_events`` or ``max_bytes``
    are dropped. With ``key``, only messages carrying their rank's token count; with ``ranks``,
    only ranks 0 to ``ranks - 1``.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", *, max_message: int = MAX_MESSAGE,
                 max_events: int = MAX_EVENTS, max_bytes: int = MAX_BYTES, key: bytes | None = None,
                 ranks: int | None = None):
        self.max_events, self.max_bytes, self.key, self.ranks = max_events, max_bytes, key, ranks
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message)  # refused before it is buffered
        try:
            self._sock.bind(endpoint if not endpoint.endswith(":0") else endpoint[:-2] + ":*")
        except zmq.ZMQError as e:
            self._sock.close()
            raise CommError(f"collector cannot bind {endpoint}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats = CollectStats()
        self._events: dict[int, list[TraceEvent]] = {}
        self._offset: dict[int, float] = {}
        self._meta: dict[int, dict[str, Any]] = {}
        self._owner: dict[int, Any] = {}  # rank -> the session that first spoke for it
        self._last = -math.inf  # wall time of the last message accepted
        self._stop = threading.Event()

    def stop(self) -> None:
        """Make :meth:`run` return at its next poll (within 50 ms); safe from a signal handler."""
        self._stop.set()

    def run(self, ranks: int | None = None, *, idle: float = 10.0, duration: float | None = None,
            every: float | None = None, save: Callable[[Trace], None] | None = None) -> Trace:
        """Receive until done (see class docstring); the merged, clock-aligned trace.
        With ``every`` and ``save``, ``save(trace so far)`` is called every ``every`` seconds."""
        start = time.monotonic()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last = saved = time.monotonic()
        while (ranks is None or len(self.stats.finished) < ranks) and not self._stop.is_set():
            now = time.monotonic()
            if now - last > idle or (duration is not None and now - start > duration):
                break
            if every is not None and save is not None and now - saved >= every:
                save(self.trace())
                saved = now
            if not poller.poll(50):
                continue
            while True:
                try:
                    raw = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                last = time.monotonic()
                self.feed(raw, time.time())
        return self.trace()

    def feed(self, raw: bytes, received_at: float) -> None:
        """Account one message received at wall time ``received_at``; never raises on bad input."""
        try:
            msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            rank, kind, sent, rows = _check(msg)
        except Exception:  # msgpack and our checks raise many unrelated types on bad input
            self.stats.malformed += 1
            return
        sid = msg.get("sid")
        if (self.ranks is not None and rank >= self.ranks) or (self.key is not None and not hmac.compare_digest(
                str(msg.get("tok")), rank_token(self.key, rank))) or self._owner.setdefault(rank, sid) != sid:
            self.stats.spoofed += 1
            return
        self.stats.received += 1
        self._last = max(self._last, received_at)
        self.stats.ranks.add(rank)
        off = received_at - sent
        self._offset[rank] = min(self._offset.get(rank, off), off)
        if kind == "events":
            good = [r for r in rows if row_problem(_FIELDS[: len(r)], r) is None]
            self.stats.bad_rows += len(rows) - len(good)
            room = max(0, self.max_events - self.stats.events) if self.stats.bytes + len(raw) <= self.max_bytes else 0
            self.stats.bytes += len(raw) if room else 0
            self.stats.over_cap += max(0, len(good) - room)
            self._events.setdefault(rank, []).extend(TraceEvent(*r) for r in good[:room])
            self.stats.events += min(room, len(good))
        elif kind == "bye":
            self.stats.finished.add(rank)
            meta = msg.get("meta")
            self._meta[rank] = meta if meta_problem(meta) is None else {}

    def trace(self) -> Trace:
        """The events so far, one clock (seconds since the earliest event), sorted by start;
        events whose clock is impossible (see the module docstring) left out and counted."""
        hi = self._last + 1.0
        kept = [(r, e, self._offset[r]) for r, evs in self._events.items() for e in evs
                if hi - MAX_TIME <= e.start + self._offset[r] and e.end + self._offset[r] <= hi]
        self.stats.bad_clock = sum(map(len, self._events.values())) - len(kept)
        t0 = min((e.start + off for _, e, off in kept), default=0.0)
        events = [replace(e, rank=r, start=e.start + off - t0, end=e.end + off - t0) for r, e, off in kept]
        events.sort(key=lambda e: (e.start, e.rank, e.task_id))
        meta = dict(next(iter(self._meta.values()), {}))
        s = self.stats
        meta.update(mode="execute", clock="wall", world_size=len(s.ranks), ranks=sorted(s.ranks),
                    finished=sorted(s.finished), dropped_malformed=s.malformed, dropped_spoofed=s.spoofed,
                    dropped_bad_rows=s.bad_rows, dropped_over_cap=s.over_cap, dropped_bad_clock=s.bad_clock)
        return Trace(events, meta)

    def close(self) -> None:
        self._sock.close()


def _check(msg: Any) -> tuple[int, str, float, list]:
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL:
        raise ValueError("not a megaloom trace message")
    rank, kind, sent, rows = msg.get("rank"), msg.get("kind"), msg.get("sent"), msg.get("rows", [])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 31 \
            or kind not in ("hello", "events", "bye"):
        raise ValueError("bad rank or kind")
    if isinstance(sent, bool) or not isinstance(sent, (int, float)) or not math.isfinite(sent) \
            or abs(sent) > MAX_TIME or not isinstance(rows, list):
        raise ValueError("bad header")
    if not isinstance(msg.get("sid"), (int, type(None))) or not isinstance(msg.get("tok"), (str, type(None))):
        raise ValueError("bad session id or token")
    for row in rows:
        if not isinstance(row, list) or not REQUIRED_COLUMNS <= len(row) <= len(_FIELDS):  # older ranks send fewer
            raise ValueError("bad event row")
    return rank, kind, float(sent), rows
