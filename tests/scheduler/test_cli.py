import json
import types

import pytest

from megaloom.cli import main
from megaloom.graphs.common import builder as graph_builders
from megaloom.runtime import Trace
from megaloom.runtime.plugins import Registry
from megaloom.scheduler import load_profile
from .graphs import random_dag


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "g.mlg"
    random_dag(5, 30).save(str(path))
    return str(path)


def test_simulate_writes_trace_and_perfetto(tmp_path, graph_file, capsys):
    out, pf = tmp_path / "s.mlt", tmp_path / "s.json"
    rc = main(["simulate", graph_file, "--profile", "h100", "--policy", "expert_interleave:group_size=2",
               "--units", "cube=2,vector=1", "--trace", str(out), "--perfetto", str(pf), "--progress"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "profile h100" in captured.out and "makespan" in captured.out
    assert "100.0% 30/30 tasks" in captured.err
    trace = Trace.load(out)
    assert len(trace.events) == 30 and trace.meta["units"]["cube"] == 2 and trace.meta["policy"] == "expert_interleave"
    assert any(e["ph"] == "X" for e in json.loads(pf.read_text())["traceEvents"])
    assert main(["simulate", "--graph", graph_file, "--no-progress"]) == 0


def test_simulate_named_graph_builder(capsys, monkeypatch):
    monkeypatch.setattr(graph_builders, "GRAPH_BUILDERS", Registry("graph builder"))
    graph_builders.register_graph_builder("rand", lambda seed=0, n=5: random_dag(seed, n))
    assert main(["simulate", "--graph", "rand:seed=3,n=12"]) == 0
    assert "tasks               12" in capsys.readouterr().out
    assert main(["simulate", "--graph", "rand:size=3"]) == 2
    assert "graph builder 'rand': bad options" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    ([], "give exactly one graph"),
    (["{g}", "--graph", "{g}"], "give exactly one graph"),
    (["--graph", "nosuch"], "neither a file nor a known graph builder"),
    (["{g}", "--profile", "tpu9"], "unknown hardware profile 'tpu9'"),
    (["{g}", "--units", "cube"], "bad unit count 'cube'"),
    (["{g}", "--policy", "lifo"], "unknown policy 'lifo'"),
    (["{g}", "--policy", "expert_interleave:group_size"], "expected key=value"),
    (["{bad}"], "not a valid msgpack file"),
])
def test_simulate_errors(tmp_path, graph_file, capsys, args, message):
    bad = tmp_path / "bad.mlg"
    bad.write_bytes(b"\xc1garbage")
    rc = main(["simulate", *(a.format(g=graph_file, bad=bad) for a in args)])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_replay_command(tmp_path, graph_file, capsys):
    run = tmp_path / "run.mlt"
    assert main(["simulate", graph_file, "--units", "cube=4,vector=4,comm=2", "--trace", str(run)]) == 0
    capsys.readouterr()
    again = tmp_path / "again.mlt"
    assert main(["replay", str(run), "--units", "cube=1,vector=1,comm=1", "--policy", "critical_path",
                 "--trace", str(again)]) == 0
    out = capsys.readouterr().out
    assert "recorded" in out and "identity replay" in out and "busy cube" in out
    assert Trace.load(again).makespan >= Trace.load(run).makespan
    assert main(["replay", graph_file]) == 2
    assert "not a megaloom-trace file" in capsys.readouterr().err


def test_profiles_command(capsys):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("ascend-910b", "atlas-a3", "ascend-950", "h100", "h200", "cpu"):
        assert name in out
    assert main(["profiles", "ascend-950"]) == 0
    out = capsys.readouterr().out
    assert "mxfp8 1000 TFLOP/s" in out and "sources:" in out and "Huawei Connect 2025" in out
    assert main(["profiles", "tpu9"]) == 2


def test_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    small = ["--matmul-size", "32", "--copy-mib", "1", "--seconds", "0"]
    out = tmp_path / "mine.yaml"
    assert main(["calibrate", "--out", str(out), *small]) == 0
    p = load_profile(str(out))
    assert p.name == "cpu" and p.peak("cube", "fp32") > 0 and p.mem_bw > 0
    assert "measured by `megaloom calibrate`" in p.sources["peak.cube"]
    assert main(["calibrate", *small]) == 0  # default: the user profile directory, which wins over the packaged cpu
    assert "calibrated" in load_profile("cpu").description
    assert main(["calibrate", "--matmul-size", "0"]) == 2


def test_calibrate_times_one_thread_per_unit_and_keeps_the_best(monkeypatch):
    """Rates are one unit's (one torch thread), the best of repeated runs; chip-wide figures are
    that times the units; the cores the units share are measured with all of them at once."""
    import os
    import time

    import torch

    from megaloom.scheduler import calibrate as cal

    threads, seen = torch.get_num_threads(), []

    def best(fn, seconds):
        seen.append(torch.get_num_threads())
        return 1e-3

    monkeypatch.setattr(cal, "_best", best)
    monkeypatch.setattr(cal, "dispatch_overhead", lambda tasks: 2e-5)
    monkeypatch.setattr(cal, "shared_cores", lambda units, n, seconds: 1.5)
    p = cal.calibrate(matmul_size=10, copy_bytes=1 << 20, seconds=0)
    assert seen and set(seen) == {1} and torch.get_num_threads() == threads
    cores = len(os.sched_getaffinity(0))
    assert p.units == {"cube": cores, "vector": cores, "comm": 1}
    assert p.unit_peak("cube", "fp32") == pytest.approx(2 * 10 ** 3 / 1e-3)
    assert p.contention.cores == 1.5 and p.contention.engines == ("cube", "vector", "comm")
    calls = iter([0.001, 0.05] + [0.001] * 10)  # warm-up, a run slowed by other jobs, then quiet runs
    monkeypatch.undo()
    assert cal._best(lambda: time.sleep(next(calls)), 0.0) < 0.01  # a slow run (other jobs) does not count
    assert 1.0 <= cal.shared_cores(2, 16, 0.0, tasks=4) <= 2.0


def test_shared_cores_is_the_speedup_of_more_cube_workers(monkeypatch):
    """On a machine that gives the workers 1.5 cores, the same matmul tasks on 2 cube workers
    finish 1.5x sooner than on one: shared_cores reads 1.5 (not 2 x 1.5 clipped to 2)."""
    from megaloom.scheduler import calibrate as cal

    class SharedCores:
        def __init__(self, units, intra_op_threads):
            self.cube = units["cube"]

        def run(self, graph, inputs):
            matmuls = sum(t.op == "matmul" for t in graph.tasks)
            return types.SimpleNamespace(trace=types.SimpleNamespace(makespan=matmuls / min(self.cube, 1.5)))

    monkeypatch.setattr(cal, "ThreadExecutor", SharedCores)
    assert cal.shared_cores(2, 16, 0.0, tasks=4) == pytest.approx(1.5)
    assert cal.shared_cores(4, 16, 0.0, tasks=4) == pytest.approx(1.5)
