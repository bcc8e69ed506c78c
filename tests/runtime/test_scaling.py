"""Loading and validating stays linear: in-place chains and tiles along dim 1 (both used to be
quadratic), races in loaded files found by the replayed derivation, unit counts bounded."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

import megaloom.ops  # noqa: F401
from megaloom.runtime import Core, GraphError, ScheduleError, TaskGraph
from megaloom.runtime import region
from megaloom.runtime.errors import ConfigError


def _benchmark_graphs():
    """``benchmarks/loading.py``, whose graphs these tests share."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "loading.py"
    spec = importlib.util.spec_from_file_location("bench_loading", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_chain = _benchmark_graphs().chain


def test_loaded_in_place_chain_validates_fast(tmp_path):
    _chain(10_000).save(tmp_path / "c.mlg")
    t0 = time.perf_counter()
    TaskGraph.load(tmp_path / "c.mlg").validate()
    assert time.perf_counter() - t0 < 20.0  # was 187 s (ancestor sets of every task)


@pytest.mark.parametrize("dim", [0, 1])
def test_tiles_along_any_dim_are_indexed_in_linear_work(monkeypatch, dim):
    calls = [0]
    real = region.overlaps

    def counted(a, b):
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(region, "overlaps", counted)
    n = 3000
    g = TaskGraph("tiles")
    shape = (n, 8) if dim == 0 else (8, n)
    x, y = g.input("x", shape), g.output("y", shape)
    for tx, ty in zip(x.split(dim, 1), y.split(dim, 1)):
        g.task("copy", [tx], [ty])
    h = TaskGraph.from_dict(g.to_dict())
    h.validate()
    assert calls[0] < 20 * n  # quadratic would be ~n * n / 2 = 4.5M


def test_loaded_file_with_a_read_write_race_is_refused():
    g = TaskGraph("race")
    x, h, y = g.input("x", (2,)), g.buffer("h", (2,)), g.output("y", (2,))
    g.task("copy", [x], [h], name="first")
    g.task("copy", [h], [y], name="reader")
    g.task("copy", [x], [h], name="overwrite")  # derived: after the reader (WAR)
    d = g.to_dict()
    TaskGraph.from_dict(d).validate()
    d["pred"][2] = [0]  # the WAR edge dropped: the overwrite may run before the read
    with pytest.raises(GraphError, match="'overwrite' writes h while task 'reader' reads it, with no order"):
        TaskGraph.from_dict(d).validate()
    d["pred"] = [[], [0], [1]]  # a transitive path orders the writers: fine
    TaskGraph.from_dict(d).validate()


def test_loaded_edges_are_installed_without_duplicates():
    d = _chain(3).to_dict()
    d["pred"][2] = [1, 1, 1]
    h = TaskGraph.from_dict(d)
    assert h.pred[2] == [1] and h.succ[1] == [2]


def test_unit_counts_are_bounded():
    from megaloom.scheduler import Simulator
    from megaloom.scheduler.simulator import parse_units

    g = _chain(2)
    with pytest.raises(ScheduleError, match="more than 65536 units"):
        Core(g, {"vector": 10**9})
    with pytest.raises(ConfigError, match="at most 65536"):
        Simulator("ascend-910b", units={"cube": 10**9})
    with pytest.raises(ConfigError, match="at most 65536"):
        parse_units("cube=1000000000")
