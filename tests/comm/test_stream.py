"""Trace streaming (ZeroMQ PUSH -> PULL collector) and the launch / collect commands, in-process."""
from __future__ import annotations

import json
import threading
import time

import msgpack
import torch
import zmq

from megaloom.cli import main
from megaloom.comm.stream import Collector, TraceStreamer
from megaloom.runtime import TaskGraph, ThreadExecutor, Trace
from megaloom.runtime.trace import TraceEvent


def _graph() -> TaskGraph:
    g = TaskGraph("stream")
    x, w = g.input("x", (8, 4)), g.input("w", (4, 4))
    h, y = g.buffer("h", (8, 4)), g.output("y", (8, 4))
    g.task("matmul", [x, w], [h])
    g.task("silu", [h], [y])
    return g


def _collect(col: Collector, ranks: int, idle: float) -> tuple[threading.Thread, dict]:
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("trace", col.run(ranks, idle=idle)), daemon=True)
    th.start()
    return th, box


def _push(endpoint: str, *frames: bytes) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(endpoint)
    for f in frames:
        s.send(f)
    s.close()
    ctx.term()


def test_collector_merges_ranks_drops_garbage_and_survives_a_vanished_rank():
    col = Collector(max_message=4096)
    assert col.endpoint.startswith("tcp://127.0.0.1:")
    th, box = _collect(col, 3, idle=1.0)  # rank 2 never finishes: idle ends the run
    g, inputs = _graph(), {"x": torch.randn(8, 4), "w": torch.randn(4, 4)}
    for rank in (0, 1):
        s = TraceStreamer(col.endpoint, rank, batch=1)
        ThreadExecutor({"cube": 1, "vector": 1}, observers=[s]).run(g, inputs)
        s.close()
    good = {"v": 1, "kind": "events", "rank": 2, "sent": time.perf_counter(),
            "rows": [[0, "lost", "matmul", "cube", 0, 2, time.perf_counter(), time.perf_counter() + 1e-3, 0, 0, 0, [], {}]]}
    bad_row = dict(good, rows=[[0, "x", "matmul", "cube", "unit?", 2, 0.0, 1.0, 0, 0, 0, [], {}]])
    _push(col.endpoint, msgpack.packb(dict(good, rows=good["rows"] * 100)))  # over 4096 bytes: ZeroMQ cuts it off
    _push(col.endpoint,
          b"\xc1 not msgpack",                                          # malformed bytes
          msgpack.packb({"hello": "world"}),                            # not our schema
          msgpack.packb(bad_row),                                       # a field of the wrong type
          msgpack.packb({"v": 1, "kind": "hello", "rank": 2, "sent": time.perf_counter()}),
          msgpack.packb(good))                                          # then vanishes, no bye
    th.join(20)
    col.close()
    trace: Trace = box["trace"]
    assert col.stats.malformed == 2 and col.stats.bad_rows == 1
    assert col.stats.finished == {0, 1} and col.stats.ranks == {0, 1, 2}
    assert trace.ranks == [0, 1, 2] and len(trace.events) == 2 + 2 + 1
    assert min(e.start for e in trace.events) == 0.0
    by_rank = {r: [e for e in trace.events if e.rank == r] for r in (0, 1)}
    for evs in by_rank.values():  # per-rank order and dependencies survive the trip
        mm, si = sorted(evs, key=lambda e: e.task_id)
        assert (mm.op, si.op) == ("matmul", "silu") and si.deps == [mm.task_id] and si.start >= mm.end
    # rank 1 ran after rank 0 in this process: aligned clocks keep that order
    assert min(e.start for e in by_rank[1]) >= max(e.end for e in by_rank[0]) - 1e-3


def test_streamer_without_collector_never_blocks():
    s = TraceStreamer("tcp://127.0.0.1:1", 0, hwm=2, linger=0.1)
    t0 = time.monotonic()
    for i in range(50):
        s.on_task(TraceEvent(i, f"t{i}", "noop", "vector", 0, 0, 0.0, 1.0))
    s.close()
    assert time.monotonic() - t0 < 5.0


def test_collect_command_writes_trace_and_perfetto(tmp_path, capsys):
    from megaloom.comm.spawn import free_port

    ep = f"tcp://127.0.0.1:{free_port()}"
    out, pf = tmp_path / "t.mlt", tmp_path / "t.json"
    code: list[int] = []
    th = threading.Thread(target=lambda: code.append(main(
        ["collect", "--bind", ep, "--ranks", "1", "--idle", "20", "--out", str(out), "--perfetto", str(pf)])))
    th.start()
    time.sleep(0.3)
    s = TraceStreamer(ep, 0)
    ThreadExecutor({"cube": 1, "vector": 1}, observers=[s]).run(_graph(), {"x": torch.randn(8, 4), "w": torch.randn(4, 4)})
    s.close()
    th.join(30)
    assert code == [0]
    assert len(Trace.load(out).events) == 2
    names = {e["name"] for e in json.loads(pf.read_text())["traceEvents"] if e["ph"] == "X"}
    assert names == {"matmul#0", "silu#1"}
    assert "2 events from ranks [0]" in capsys.readouterr().out


def test_launch_sets_rank_env_and_propagates_failure(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_PORT'])\n"
        "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    assert main(["launch", "-n", "3", "--grace", "5", str(script), str(tmp_path)]) == 3
    seen = {p.name: p.read_text().split() for p in tmp_path.iterdir() if p.name.isdigit()}
    assert sorted(seen) == ["0", "1", "2"] and {v[0] for v in seen.values()} == {"3"}
    assert len({v[1] for v in seen.values()}) == 1


def test_launch_reports_a_rank_killed_by_a_signal_as_the_shell_does(tmp_path, capsys):
    script = tmp_path / "abort.py"
    script.write_text("import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGABRT)\n")
    assert main(["launch", "-n", "2", str(script)]) == 128 + 6
    assert "rank 1 was killed by SIGABRT (exit code 134)" in capsys.readouterr().err


def test_launch_rejects_missing_script(capsys):
    assert main(["launch", "-n", "2", "/nonexistent/script.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_streamer_from_env(monkeypatch):
    from megaloom.comm.stream import streamer_from_env

    monkeypatch.delenv("MEGALOOM_TRACE", raising=False)
    assert streamer_from_env(0) is None
    col = Collector()
    monkeypatch.setenv("MEGALOOM_TRACE", col.endpoint)
    s = streamer_from_env(3)
    s.on_run_end(Trace([], {"graph": "g", "units": {"cube": 1}}))
    s.close()
    col.run(1, idle=5)
    col.close()
    assert col.stats.finished == {3} and col.trace().meta["units"] == {"cube": 1}
