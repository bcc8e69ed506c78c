"""msgpack files of graphs and traces: lossless round-trips, and clear errors for bad files."""
import msgpack
import pytest

from megaloom.runtime import Cost, GraphError, TaskGraph, Trace, TraceEvent, TraceFormatError
from megaloom.runtime.serialize import GRAPH_VERSION, graph_to_dict
from megaloom.runtime.trace import TRACE_VERSION


def small_graph() -> TaskGraph:
    g = TaskGraph("small")
    x = g.input("x", (8, 4))
    g.input("w", (4, 4), "bfloat16")  # an input no task reads still round-trips
    h = g.buffer("h", (8, 4))
    y = g.inout("y", (8, 4))
    a = g.task("copy", [x[0:4]], [h[0:4]], name="c0", tags={"stage": "s", "expert": 1})
    g.task("copy", [x[4:8]], [h[4:8]], name="c1", engine="comm", priority=3)
    g.task("add", [h, y], [y], name="acc", attrs={"alpha": [1, 2], "k": {"n": 1.5}}, cost=Cost(1.0, 2, 3, "bf16"))
    g.task("noop", name="late").precede(a)  # a control edge against insertion order
    return g


def test_graph_round_trip_is_lossless(tmp_path):
    g = small_graph()
    p = tmp_path / "g.mlg"
    g.save(p)
    h = TaskGraph.load(p)
    assert graph_to_dict(h) == graph_to_dict(g)
    assert h.succ == g.succ and h.pred == g.pred
    assert h["acc"].cost == Cost(1.0, 2, 3, "bf16") and h["c0"].tags == {"stage": "s", "expert": 1}


def test_loaded_graph_runs_like_the_original(tmp_path):
    import torch

    from megaloom.runtime import ReferenceExecutor, ThreadExecutor

    g = TaskGraph("run")
    x = g.input("x", (4, 4))
    h1, h2, y = g.buffer("h1", (4, 4)), g.buffer("h2", (4, 4)), g.output("y", (4, 4))
    g.task("silu", [x], [h1])
    g.task("mul", [x, x], [h2])
    g.task("add", [h1, h2], [y])   # a join: the loaded graph must wait for both
    g.save(tmp_path / "g.mlg")
    h = TaskGraph.load(tmp_path / "g.mlg")
    inp = {"x": torch.randn(4, 4)}
    want = ReferenceExecutor().run(g, inp)["y"]
    for _ in range(5):
        assert torch.equal(ThreadExecutor({"vector": 2}).run(h, inp)["y"], want)


def _write(path, obj) -> None:
    path.write_bytes(msgpack.packb(obj, use_bin_type=True))


def _graph_dict() -> dict:
    return graph_to_dict(small_graph())


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(version=GRAPH_VERSION + 1), "newer"),
    (lambda d: d.update(version="1"), "schema version"),
    (lambda d: d.update(format="megaloom-trace"), "not a megaloom-graph file"),
    (lambda d: d.pop("tasks"), "missing buffers/tasks/pred"),
    (lambda d: d.update(name=3), "missing graph name"),
    (lambda d: d["buffers"][0].__setitem__(1, ["8", 4]), "buffer 0 is malformed"),
    (lambda d: d["buffers"][0].pop(), "buffer 0 is malformed"),
    (lambda d: d["tasks"][0].pop("op"), "task 0 is malformed"),
    (lambda d: d["tasks"][0]["in"][0].__setitem__(0, "nope"), "'c0' has a malformed region"),
    (lambda d: d["tasks"][0]["in"][0].__setitem__(0, [1]), "'c0' has a malformed region"),
    (lambda d: d["tasks"][0]["in"][0].__setitem__(1, [[0, 4]]), "outside buffer"),
    (lambda d: d["tasks"][2].__setitem__("cost", [1, "x", 3, "bf16"]), "'acc' has a malformed cost"),
    (lambda d: d["pred"][1].append(99), "edge names a task that does not exist"),
    (lambda d: d["pred"].pop(), "edge names a task that does not exist"),
    (lambda d: d["buffers"].append(["x", [1], "float32", False, False]), "buffer 'x' already exists"),
    (lambda d: d["buffers"].append(["z", [1], "float33", False, False]), "unknown dtype"),
])
def test_bad_graph_files_raise_megaloom_errors(tmp_path, mutate, needle):
    d = _graph_dict()
    mutate(d)
    p = tmp_path / "bad.mlg"
    _write(p, d)
    with pytest.raises((TraceFormatError, GraphError), match=needle) as info:
        TaskGraph.load(p)
    assert str(p) in str(info.value) or isinstance(info.value, GraphError)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage that is not msgpack", msgpack.packb([1, 2])])
def test_corrupt_files(tmp_path, data):
    p = tmp_path / "x.mlg"
    p.write_bytes(data)
    with pytest.raises(TraceFormatError, match=str(p.name)):
        TaskGraph.load(p)
    with pytest.raises(TraceFormatError, match=str(p.name)):
        Trace.load(p)


def test_truncated_files_at_every_length(tmp_path):
    g = small_graph()
    full = tmp_path / "g.mlg"
    g.save(full)
    data = full.read_bytes()
    cut = tmp_path / "cut.mlg"
    for n in range(0, len(data), max(1, len(data) // 40)):
        cut.write_bytes(data[:n])
        with pytest.raises((TraceFormatError, GraphError)):
            TaskGraph.load(cut)


def test_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        TaskGraph.load(tmp_path / "absent.mlg")


def test_unencodable_attrs_raise_graph_error(tmp_path):
    g = TaskGraph("bad")
    g.task("noop", name="t", attrs={"f": object()})
    with pytest.raises(GraphError, match="not msgpack-encodable"):
        g.save(tmp_path / "g.mlg")


def _trace() -> Trace:
    return Trace([
        TraceEvent(0, "a", "matmul", "cube", 0, 0, 0.0, 1.5, 10.0, 20.0, 0.0, [], {"expert": 1}),
        TraceEvent(1, "b", "copy", "comm", 1, 0, 0.25, 2.0, 0.0, 0.0, 64.0, [0], {}),
    ], {"graph": "t", "mode": "simulate", "clock": "virtual", "units": {"cube": 1, "comm": 2}})


def test_trace_round_trip(tmp_path):
    t = _trace()
    t.save(tmp_path / "t.mlt")
    u = Trace.load(tmp_path / "t.mlt")
    assert u.events == t.events and u.meta == t.meta


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(version=TRACE_VERSION + 1), "newer"),
    (lambda d: d.update(columns=7), "bad trace layout"),
    (lambda d: d.update(columns=["tid", "task"]), "bad trace layout"),
    (lambda d: d.update(columns=["tid", "op"] + d["columns"][2:]), "bad trace layout"),
    (lambda d: d["events"][0].pop(), "event 0 has 13 fields, expected 14"),
    (lambda d: d["events"][1].__setitem__(6, "x"), "event 1 field 'start' has type str"),
    (lambda d: d["events"][1].__setitem__(0, True), "event 1 field 'task_id' has type bool"),
    (lambda d: d.update(events={}), "bad trace layout"),
])
def test_bad_trace_files(tmp_path, mutate, needle):
    p = tmp_path / "t.mlt"
    _trace().save(p)
    d = _as_rows(msgpack.unpackb(p.read_bytes()))
    mutate(d)
    _write(p, d)
    with pytest.raises(TraceFormatError, match=needle):
        Trace.load(p)


def _as_rows(d: dict) -> dict:
    """A saved trace (stored by column) rewritten as a row file, which every version reads."""
    d["events"] = [list(row) for row in zip(*d.pop("data"))]
    return d


def test_older_trace_without_optional_columns_loads(tmp_path):
    p = tmp_path / "t.mlt"
    _trace().save(p)
    d = _as_rows(msgpack.unpackb(p.read_bytes()))
    d["columns"] = d["columns"][:8]
    d["events"] = [row[:8] for row in d["events"]]
    _write(p, d)
    t = Trace.load(p)
    assert t.events[1].deps == [] and t.events[1].end == 2.0


@pytest.mark.parametrize("version", [1, 2])
def test_trace_of_an_older_schema_loads_under_the_new_names(tmp_path, version):
    p = tmp_path / "t.mlt"
    _trace().save(p)
    d = _as_rows(msgpack.unpackb(p.read_bytes()))
    assert d["version"] == TRACE_VERSION == 4 and d["columns"][0] == "task_id"
    d["version"], d["columns"][0] = version, "tid"  # the task id column's name before version 3
    if version == 1:  # version 1 had no precision column
        d["columns"] = d["columns"][:-1]
        d["events"] = [row[:-1] for row in d["events"]]
    _write(p, d)
    t = Trace.load(p)
    assert [e.task_id for e in t.events] == [0, 1] and t.events[1].deps == [0]
    d["version"] = 3  # a current file must use the current names
    _write(p, d)
    with pytest.raises(TraceFormatError, match="bad trace layout"):
        Trace.load(p)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["data"][6].__setitem__(1, "x"), "event 1 field 'start' has type str"),
    (lambda d: d["data"][7].__setitem__(0, -1.0), "event 0 ends"),
    (lambda d: d["data"][4].__setitem__(1, -2), "event 1 field 'unit'"),
    (lambda d: d["data"][11].__setitem__(1, [True]), "event 1 field 'deps'"),
    (lambda d: d["data"][3].pop(), "columns of different lengths"),
    (lambda d: d["data"].pop(), "bad trace layout"),
    (lambda d: d.update(version=3), "bad trace layout"),  # before version 4 a file held rows
])
def test_bad_columns_name_the_event_and_field(tmp_path, mutate, needle):
    p = tmp_path / "t.mlt"
    _trace().save(p)
    d = msgpack.unpackb(p.read_bytes())
    assert d["version"] == 4 and len(d["data"]) == len(d["columns"]) and "events" not in d
    mutate(d)
    _write(p, d)
    with pytest.raises(TraceFormatError, match=needle):
        Trace.load(p)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    import os

    p = tmp_path / "t.mlt"
    _trace().save(p)
    before = p.read_bytes()

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        Trace([], {}).save(p)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["t.mlt"]


def test_unencodable_trace_raises_and_keeps_old_file(tmp_path):
    p = tmp_path / "t.mlt"
    _trace().save(p)
    bad = _trace()
    bad.events[0].tags["obj"] = object()
    with pytest.raises(TraceFormatError, match="not msgpack-encodable"):
        bad.save(p)
    assert Trace.load(p).events == _trace().events


def test_written_files_honour_the_umask_and_keep_an_overwritten_mode(tmp_path):
    import os

    from megaloom.runtime.files import atomic_write

    old = os.umask(0o022)
    try:
        p = tmp_path / "a.bin"
        atomic_write(p, b"1")
        assert p.stat().st_mode & 0o777 == 0o644
        os.chmod(p, 0o664)
        atomic_write(p, b"2")
        assert p.stat().st_mode & 0o777 == 0o664 and p.read_bytes() == b"2"
        os.umask(0o077)
        _trace().save(tmp_path / "t.mlt")
        assert (tmp_path / "t.mlt").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_yaml_reads_1_2_floats_and_names_bad_files(tmp_path):
    from megaloom.runtime.errors import ConfigError, FileFormatError
    from megaloom.runtime.files import load_yaml

    p = tmp_path / "o.yaml"
    p.write_text("rms_eps: 1e-6\nlr: 3.0E+2\nname: x\n")
    assert load_yaml(p) == {"rms_eps": 1e-6, "lr": 300.0, "name": "x"}
    p.write_bytes(b"a: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_yaml(p, "options")
    p.write_text("a: [1\n")
    with pytest.raises(ConfigError, match="o.yaml: options is not valid YAML"):
        load_yaml(p, "options")
    assert issubclass(TraceFormatError, FileFormatError)
