"""``megaloom collect`` saves what is good and drops what is not, counted: an impossible clock
costs its own events only, senders without their rank's token (given by ``megaloom launch``)
or outside ``--ranks`` cannot finish the collection, and memory is capped in bytes."""
from __future__ import annotations

import os
import stat
import threading
import time

import msgpack
import pytest
import zmq

from megaloom.cli import main
from megaloom.comm.spawn import free_port
from megaloom.comm.stream import PROTOCOL, Collector, TraceStreamer
from megaloom.runtime.trace import Trace, TraceEvent


def _row(tid: int, start: float, rank: int = 0, task: str | None = None) -> list:
    return [tid, task or f"t{tid}", "noop", "vector", 0, rank, start, start + 1e-3, 0.0, 0.0, 0.0, [], {}, "fp32"]


def _msg(kind: str, rank: int, sent: float | None = None, **kw) -> bytes:
    sent = time.perf_counter() if sent is None else sent
    return msgpack.packb({"v": PROTOCOL, "kind": kind, "rank": rank, "sid": 7 + rank, "sent": sent, **kw})


@pytest.mark.parametrize("sent, start", [(None, -1e12), (1e12, -1e12), (-1e11, 1e11)],
                         ids=["event far in the past", "clock far ahead", "clock far behind"])
def test_an_impossible_clock_costs_only_its_own_events(tmp_path, sent, start):
    col = Collector()
    now = time.perf_counter()
    col.feed(_msg("events", 0, rows=[_row(i, now + i * 1e-3) for i in range(200)]), time.time())
    col.feed(_msg("events", 1, sent=sent, rows=[_row(0, start, rank=1)]), time.time())
    col.close()
    trace = col.trace()
    trace.save(tmp_path / "t.mlt")  # never fails: the bad event is out, counted
    assert len(Trace.load(tmp_path / "t.mlt").events) == 200
    assert col.stats.bad_clock == 1 and trace.meta["dropped_bad_clock"] == 1


def test_without_its_token_no_sender_can_finish_or_fill_a_rank(tmp_path):
    from megaloom.comm.stream import rank_token, read_key

    key = read_key(str(tmp_path / "key"), create=True)
    assert stat.S_IMODE(os.stat(tmp_path / "key").st_mode) == 0o600
    col = Collector(key=key)
    now = time.perf_counter()
    col.feed(_msg("bye", 0), time.time())  # no token
    col.feed(_msg("bye", 1, tok="0" * 64), time.time())  # a made-up token
    col.feed(_msg("bye", 1, tok=rank_token(key, 0)), time.time())  # rank 0's token for rank 1
    col.feed(_msg("events", 1, rows=[_row(0, now, rank=1)]), time.time())
    assert col.stats.finished == set() and col.stats.spoofed == 4 and col.stats.events == 0
    for r in (0, 1):
        col.feed(_msg("events", r, tok=rank_token(key, r), rows=[_row(0, now, rank=r)]), time.time())
        col.feed(_msg("bye", r, tok=rank_token(key, r)), time.time())
    col.close()
    assert col.stats.finished == {0, 1} and len(col.trace().events) == 2


def test_fake_byes_for_unused_ranks_do_not_end_the_collection(tmp_path):
    ep, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "t.mlt"
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("rc", main(
        ["collect", "--bind", ep, "--ranks", "2", "--idle", "60", "--duration", "120", "--out", str(out)])))
    th.start()
    ctx = zmq.Context()
    fake = ctx.socket(zmq.PUSH)
    fake.setsockopt(zmq.LINGER, 0)
    try:
        fake.connect(ep)
        for r in (2, 3, 4, 5):
            fake.send(_msg("bye", r))
        time.sleep(1.0)
        assert th.is_alive()
        for r in (0, 1):
            s = TraceStreamer(ep, r, batch=10)
            for i in range(50):
                t = time.perf_counter()
                s.on_task(TraceEvent(i, f"t{i}", "noop", "vector", 0, r, t, t + 1e-6))
            s.on_run_end(Trace([], {}))
            s.close()
        th.join(150)
    finally:
        fake.close()
        ctx.term()
    assert not th.is_alive() and box["rc"] == 0
    assert len(Trace.load(out).events) == 100


def test_the_memory_cap_counts_bytes_not_events():
    col = Collector(max_bytes=1 << 20)
    now = time.perf_counter()
    for m in range(6):  # six messages of about 400 kB, one event each
        col.feed(_msg("events", 0, rows=[_row(m, now, task="x" * 400_000)]), time.time())
    col.close()
    assert col.stats.events == 2 and col.stats.over_cap == 4 and col.stats.bytes <= 1 << 20
    assert len(col.trace().events) == 2


def test_launch_gives_each_rank_its_own_token(tmp_path):
    from megaloom.comm.stream import rank_token, read_key

    keyfile = tmp_path / "key"
    key = read_key(str(keyfile), create=True)
    script = tmp_path / "rank.py"
    script.write_text("import os\nopen(os.environ['RANK'] + '.tok', 'w').write(os.environ['MEGALOOM_TRACE_TOKEN'])\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["launch", "-n", "2", "--trace", "tcp://127.0.0.1:1", "--trace-key", str(keyfile),
                     str(script)]) == 0
    finally:
        os.chdir(cwd)
    tokens = [(tmp_path / f"{r}.tok").read_text() for r in (0, 1)]
    assert tokens == [rank_token(key, 0), rank_token(key, 1)] and tokens[0] != tokens[1]
