"""``megaloom trace summary|convert|plot``."""
import json
import sys

import pytest

from megaloom.cli import main
from megaloom.runtime import Trace, TraceEvent


@pytest.fixture
def trace_file(tmp_path):
    events = [TraceEvent(0, "mm", "matmul", "cube", 0, 0, 0.0, 2e-3, 1e6),
              TraceEvent(1, "act", "silu", "vector", 1, 0, 1e-3, 3e-3, deps=[0]),
              TraceEvent(2, "a2a", "copy", "comm", 0, 0, 0.5e-3, 1.5e-3, comm_bytes=64.0)]
    p = tmp_path / "run.mlt"
    meta = {"graph": "g", "mode": "simulate", "clock": "virtual", "units": {"cube": 1, "vector": 2, "comm": 1}}
    Trace(events, meta).save(p)
    return p


def test_summary_prints_metrics(trace_file, capsys):
    assert main(["trace", "summary", str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "trace of 'g' (simulate, virtual clock)" in out and "makespan            3.000 ms" in out
    assert "100.0% hidden under compute" in out


def test_convert_writes_perfetto_json(trace_file, capsys):
    assert main(["trace", "convert", str(trace_file)]) == 0
    doc = json.loads(trace_file.with_suffix(".json").read_text())
    assert sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X") == ["a2a", "act", "mm"]
    out = trace_file.parent / "other.json"
    assert main(["trace", "convert", str(trace_file), "-o", str(out)]) == 0 and out.exists()


def test_plot_writes_png_or_says_how_to_install(trace_file, capsys):
    out = trace_file.parent / "g.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["trace", "plot", str(trace_file), "-o", str(out)]) == 2
        assert "pip install megaloom[plot]" in capsys.readouterr().err
        return
    assert main(["trace", "plot", str(trace_file), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(trace_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib now raises ImportError
    assert main(["trace", "plot", str(trace_file)]) == 2
    assert "pip install megaloom[plot]" in capsys.readouterr().err
    assert not trace_file.with_suffix(".png").exists()


def test_plot_panels_of_several_traces(trace_file, tmp_path):
    """A mapping of traces draws one panel each on one time axis (the demo's chart of two schedules)."""
    pytest.importorskip("matplotlib")
    from megaloom.runtime.errors import ConfigError
    from megaloom.runtime.plot import plot_gantt

    t = Trace.load(trace_file)
    longer = Trace([TraceEvent(0, "mm", "matmul", "cube", 0, 1, 0.0, 6e-3)], t.meta)
    plot_gantt({"short": t, "long, rank 1 only": longer}, tmp_path / "two.png", title="two runs")
    one = tmp_path / "one.png"
    plot_gantt(t, one)
    assert (tmp_path / "two.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "two.png").stat().st_size > one.stat().st_size
    with pytest.raises(ConfigError, match="at least one trace"):
        plot_gantt({}, tmp_path / "none.png")


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    (b"\x93\x01", "not a valid msgpack file"),
    (b'{"traceEvents": []}', "megaloom replay"),
    (b"\x92\x01\x02", "not a megaloom-trace file"),
    (b"\x80", "not a megaloom-trace file"),
])
def test_bad_files_exit_2_with_a_message(tmp_path, capsys, content, needle):
    p = tmp_path / "bad.mlt"
    if content is not None:
        p.write_bytes(content)
    for action in ("summary", "convert", "plot"):
        assert main(["trace", action, str(p)]) == 2
        err = capsys.readouterr().err
        assert f"megaloom trace: error: {p}" in err and needle in err


def test_unwritable_output(trace_file, capsys):
    assert main(["trace", "convert", str(trace_file), "-o", str(trace_file.parent / "no" / "x.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    for argv in (["trace"], ["trace", "nonsense", "x"], ["trace", "summary"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
