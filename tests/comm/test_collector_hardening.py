"""The collector keeps what it got and never crashes, hangs or grows without bound: signals,
periodic saves, poison values, spoofed byes, an event cap, ZeroMQ's message-size limit."""
from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from megaloom.cli import main
from megaloom.comm.spawn import free_port
from megaloom.comm.stream import PROTOCOL, Collector, TraceStreamer
from megaloom.runtime import Trace
from megaloom.runtime.metrics import summary
from megaloom.runtime.trace import TraceEvent


def _row(tid: int, **change) -> list:
    t = time.perf_counter()
    e = dict(task_id=tid, task=f"t{tid}", op="noop", engine="vector", unit=0, rank=0, start=t, end=t + 1e-3,
             flops=0.0, bytes=0.0, comm_bytes=0.0, deps=[], tags={}, precision="fp32")
    e.update(change)
    return list(e.values())


def _msg(kind: str, rank: int, sid=None, **kw) -> bytes:
    return msgpack.packb({"v": PROTOCOL, "kind": kind, "rank": rank, "sid": sid, "sent": time.perf_counter(), **kw})


def _stream(endpoint: str, rank: int, n: int) -> None:
    s = TraceStreamer(endpoint, rank, batch=2)
    for i in range(n):
        s.on_task(TraceEvent(i, f"t{i}", "noop", "vector", 0, rank, float(i), i + 0.5))
    s.on_run_end(Trace([], {"graph": "g", "units": {"vector": 1}}))
    s.close()


def _wait_for_save(out, n: int) -> None:
    deadline = time.monotonic() + 30
    while not (out.exists() and len(Trace.load(out).events) == n):  # the periodic save
        assert time.monotonic() < deadline, "no periodic save"
        time.sleep(0.1)


def test_collect_stopped_by_sigterm_writes_what_it_received(tmp_path):
    ep, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "t.mlt"
    proc = subprocess.Popen([sys.executable, "-m", "megaloom.cli", "collect", "--bind", ep, "--ranks", "2",
                             "--idle", "60", "--save-every", "0.2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "collecting on" in proc.stdout.readline()
        _stream(ep, 0, 5)  # rank 1 never comes: only a signal ends the collection
        _wait_for_save(out, 5)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stdout
    assert len(Trace.load(out).events) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_collect_stopped_by_ctrl_c_writes_what_it_received(tmp_path, capsys):
    import os

    ep, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "t.mlt"

    def ranks_then_ctrl_c() -> None:
        time.sleep(0.3)
        _stream(ep, 0, 3)
        _wait_for_save(out, 3)
        os.kill(os.getpid(), signal.SIGINT)

    th = threading.Thread(target=ranks_then_ctrl_c, daemon=True)
    th.start()
    code = main(["collect", "--bind", ep, "--ranks", "2", "--idle", "60", "--save-every", "0.2", "--out", str(out)])
    th.join(10)
    assert code == 128 + signal.SIGINT and "stopped by SIGINT" in capsys.readouterr().out
    assert len(Trace.load(out).events) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_poison_values_are_dropped_and_counted_and_the_summary_works(tmp_path, capsys):
    col = Collector()
    good = [_row(0), _row(1, deps=[0])]
    poison = [_row(2, start=math.nan), _row(3, end=1e300), _row(4, deps=[{}]), _row(5, flops=-1.0),
              _row(6, unit=10**12), _row(7, start=2.0, end=1.0), _row(8, tags={1: "x"})]
    col.feed(_msg("events", 0, rows=good + poison), time.time())
    col.feed(_msg("events", 1, sent=math.nan, rows=good), time.time())
    col.feed(msgpack.packb({"v": PROTOCOL, "kind": "events", "rank": 1, "sent": 1e300, "rows": good}), time.time())
    col.feed(_msg("bye", 0, meta={"units": "abc", "graph": "g"}), time.time())
    assert col.stats.bad_rows == len(poison) and col.stats.malformed == 2 and col.stats.events == 2
    trace = col.trace()
    assert "units" not in trace.meta and len(trace.events) == 2
    summary(trace)
    trace.save(tmp_path / "t.mlt")
    assert main(["trace", "summary", str(tmp_path / "t.mlt")]) == 0


def test_spoofed_byes_do_not_end_the_collection():
    col = Collector()
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("trace", col.run(2, idle=30)), daemon=True)
    th.start()
    real = [TraceStreamer(col.endpoint, r, batch=1) for r in (0, 1)]  # each says hello with its session
    time.sleep(0.5)
    ctx = zmq.Context()
    spoof = ctx.socket(zmq.PUSH)
    spoof.connect(col.endpoint)
    for _ in range(3):
        for r in (0, 1):
            spoof.send(_msg("bye", r, sid=12345))
            spoof.send(_msg("bye", r))
    time.sleep(1.0)
    assert th.is_alive() and col.stats.finished == set() and col.stats.spoofed == 12
    for s in real:
        s.on_task(TraceEvent(0, "t", "noop", "vector", 0, s.rank, 0.0, 1.0))
        s.on_run_end(Trace([], {}))
        s.on_run_end(Trace([], {}))  # a second bye of the same session counts once
        s.close()
    th.join(20)
    spoof.close(0)
    ctx.term()
    col.close()
    assert not th.is_alive() and col.stats.finished == {0, 1} and len(box["trace"].events) == 2


def test_events_over_the_cap_are_dropped_and_counted():
    col = Collector(max_events=3)
    col.feed(_msg("events", 0, rows=[_row(i) for i in range(2)]), time.time())
    col.feed(_msg("events", 1, rows=[_row(i) for i in range(4)]), time.time())
    assert col.stats.events == 3 and col.stats.over_cap == 3 and len(col.trace().events) == 3
    col.close()


def test_messages_over_the_limit_are_refused_by_zeromq():
    col = Collector(max_message=4096)
    assert col._sock.getsockopt(zmq.MAXMSGSIZE) == 4096
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(col.endpoint)
    s.send(_msg("events", 0, rows=[_row(0, task="x" * (8 << 20))]))  # 8 MB: never buffered whole
    s.close(2000)
    ctx.term()
    col.run(idle=1.0)
    assert col.stats.received == 0 and col.stats.events == 0
    col.close()
    streamer = TraceStreamer(col.endpoint, 0, linger=0.1)  # a streamer never sends what would be refused
    streamer.on_task(TraceEvent(0, "x" * (9 << 20), "noop", "vector", 0, 0, 0.0, 1.0))
    streamer.close()
    assert streamer.dropped == 1


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5) | st.integers(0, 3), inner, max_size=4),
    max_leaves=20)
_rows = st.lists(st.one_of(_values, st.builds(
    lambda i, k, v: _row(0)[:i] + [v] + _row(0)[i + 1:k], st.integers(0, 13), st.integers(8, 14), _values)), max_size=4)


@pytest.fixture(scope="module")
def fuzz_collector():
    col = Collector()
    yield col
    col.close()


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["hello", "events", "bye", "other"]) | st.text(max_size=3),
       rank=_values | st.integers(0, 3), sent=_values | st.floats(0, 1e6), sid=_values,
       rows=_rows, meta=_values, raw=st.booleans(), junk=st.binary(max_size=30))
def test_fuzzed_messages_never_break_the_collector(fuzz_collector, kind, rank, sent, sid, rows, meta, raw, junk):
    col = fuzz_collector  # one collector takes every message, as a long collection would
    msg = junk if raw else msgpack.packb({"v": PROTOCOL, "kind": kind, "rank": rank, "sid": sid, "sent": sent,
                                           "rows": rows, "meta": meta})
    col.feed(msg, time.time())
    trace = col.trace()
    summary(trace)
    for e in trace.events:
        assert math.isfinite(e.start) and math.isfinite(e.end) and e.end >= e.start
