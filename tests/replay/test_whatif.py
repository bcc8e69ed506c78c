"""What-if replay across devices, calibrated profiles, and the CLI for both."""
import json

import pytest
import torch

from megaloom.cli import main
from megaloom.graphs.mlp import build_mlp, mlp_inputs
from megaloom.runtime import ConfigError, ThreadExecutor, Trace
from megaloom.scheduler import CostModel, Simulator, load_profile
from megaloom.scheduler.fit import calibrated_profile, fit_traces
from megaloom.scheduler.profile import read_profile
from megaloom.scheduler.replay import device_ratio, replay


@pytest.fixture(scope="module")
def executed():
    g = build_mlp(tokens=256, hidden=64, inter=128, tile=32)
    return g, ThreadExecutor({"cube": 1, "vector": 1}).run(g, mlp_inputs(g)).trace


def test_replay_on_the_recorded_device_reproduces_the_run(executed):
    _, trace = executed
    out = replay(trace).trace
    assert out.makespan <= trace.makespan * 1.0001  # the simulator starts tasks with no dispatch gaps
    assert len(out.events) == len(trace.events)


def test_replay_on_another_device_scales_each_task_by_the_cost_model_ratio(executed):
    g, trace = executed
    cpu, h100 = load_profile("cpu"), load_profile("h100")
    ratio = device_ratio(cpu, h100)
    out = {e.task_id: e for e in replay(trace, "h100", recorded_profile="cpu").trace.events}
    for e in trace.events:
        c = g.costs()[e.task_id]
        want = CostModel(h100).duration(c, e.engine, op=e.op) / CostModel(cpu).duration(c, e.engine, op=e.op)
        assert ratio(e) == pytest.approx(want)
        assert out[e.task_id].duration == pytest.approx(e.duration * want)


def test_host_engine_keeps_its_duration():
    from megaloom.runtime import TraceEvent

    e = TraceEvent(0, "launch", "cudaLaunchKernel", "host", 0, 0, 0.0, 1e-5)
    assert device_ratio(load_profile("h100"), load_profile("h200"))(e) == 1.0


def test_calibrated_profile_round_trips_and_drives_the_cost_model(tmp_path, executed):
    _, trace = executed
    fits = fit_traces([trace])
    prof = calibrated_profile(load_profile("cpu"), fits, "cpu-fit", source="test")
    from megaloom.scheduler.calibrate import write_profile

    back = read_profile(write_profile(prof, tmp_path / "fit.yaml"))
    assert back.name == "cpu-fit" and set(back.ops) == set(fits)
    assert back.ops["matmul"]["median_rel_error"] == pytest.approx(fits["matmul"].median_rel_error)
    model = CostModel(back)
    assert model.overrides["matmul"].throughput == pytest.approx(fits["matmul"].coeffs.throughput)


def test_bad_ops_section_is_a_config_error_naming_the_key(tmp_path):
    data = load_profile("cpu").to_dict()
    data["ops"] = {"matmul": {"throughput": -1}}
    import yaml

    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="ops.matmul.throughput"):
        read_profile(p)
    data["ops"] = {"matmul": {"speed": 1}}
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="unknown fields"):
        read_profile(p)


def test_cli_calibrate_from_traces_and_replay_imported_profile(tmp_path, executed, capsys):
    _, trace = executed
    saved = tmp_path / "run.mlt"
    trace.save(saved)
    out = tmp_path / "fit.yaml"
    assert main(["calibrate", "--from", str(saved), "--out", str(out), "--name", "cpu-fit"]) == 0
    assert "matmul" in capsys.readouterr().out and read_profile(out).ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.Linear(32, 32)(torch.randn(8, 32)).relu().sum().backward()
    tp = tmp_path / "torch.json"
    prof.export_chrome_trace(str(tp))
    perfetto = tmp_path / "pred.json"
    assert main(["replay", str(tp), "--profile", "h100", "--perfetto", str(perfetto)]) == 0
    text = capsys.readouterr().out
    assert "recorded" in text and "identity replay" in text and "h100" in text and "import of" in text
    assert json.loads(perfetto.read_text())["traceEvents"]
    assert main(["replay", str(tmp_path / "missing.json")]) == 2


def test_events_carry_precision_and_version_1_traces_still_load(tmp_path):
    import msgpack

    from megaloom.runtime import TaskGraph
    from megaloom.runtime.trace import FIELD_TYPES

    g = TaskGraph("bf16")
    a, b, y = g.input("a", (64, 64), "bfloat16"), g.input("b", (64, 64), "bfloat16"), g.output("y", (64, 64), "bfloat16")
    g.task("matmul", [a, b], [y])
    trace = Simulator("h100").run(g).trace
    assert trace.events[0].precision == "bf16"
    h100, cpu = load_profile("h100"), load_profile("cpu")
    cost = g.costs()[0]
    want = CostModel(cpu).duration(cost, "cube", op="matmul") / CostModel(h100).duration(cost, "cube", op="matmul")
    assert device_ratio(h100, cpu)(trace.events[0]) == pytest.approx(want)
    old_cols = [c for c in FIELD_TYPES if c != "precision"]
    e = trace.events[0]
    old = {"format": "megaloom-trace", "version": 1, "meta": {}, "columns": old_cols,
           "events": [[getattr(e, c) for c in old_cols]]}
    p = tmp_path / "v1.mlt"
    p.write_bytes(msgpack.packb(old))
    assert Trace.load(p).events[0].precision == "fp32"
