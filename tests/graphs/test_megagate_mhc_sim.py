"""MegaGate and MegaMHC graphs on the simulator: complete, ordered, deterministic, interleaved."""
import pytest

from megaloom.graphs import GateSpec, MHCSpec, build_megagate, build_megamhc
from megaloom.runtime import metrics
from megaloom.scheduler import Simulator

GRAPHS = {
    "gate": lambda d: build_megagate(GateSpec(512, 256, 16, 4, "sigmoid", 2.5, True, "bfloat16", 64, 128), d),
    "mhc": lambda d: build_megamhc(MHCSpec(512, 256, 4, "bfloat16", 64), d),
}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("which", sorted(GRAPHS))
@pytest.mark.parametrize("policy", [None, "critical_path"])
def test_simulated_schedule(which, direction, policy):
    graph = GRAPHS[which](direction)
    sim = Simulator("atlas-a3", units={"cube": 2, "vector": 2}, policy=policy)
    run = sim.run(graph)
    assert run.outputs == {}
    events = {e.task_id: e for e in run.trace.events}
    assert sorted(events) == list(range(len(graph)))
    for t in graph:  # every task starts after all its predecessors end
        assert all(events[p].end <= events[t.id].start + 1e-15 for p in graph.pred[t.id]), t.name
    m = metrics(run.trace)
    assert m.cube_vector_overlap > 0  # vector stages run under the projections
    assert m.makespan < sum(m.busy.values())  # so the run is shorter than the stages back to back
    again = Simulator("atlas-a3", units={"cube": 2, "vector": 2}, policy=policy).run(graph)
    def key(trace):
        return [(e.task_id, e.start, e.unit) for e in trace.events]

    assert key(again.trace) == key(run.trace)


def test_simulate_command_builds_both_graphs(tmp_path, capsys):
    from megaloom.cli import main

    assert main(["simulate", "--graph", "megagate:tokens=256,hidden=64,experts=8,top_k=2,score=sigmoid,direction=bwd",
                 "--profile", "atlas-a3"]) == 0
    assert "megagate_bwd" in capsys.readouterr().out
    spec = tmp_path / "mhc.yaml"
    spec.write_text("megamhc:\n  tokens: 128\n  hidden: 64\n  dtype: bfloat16\n  direction: bwd\n")
    trace = tmp_path / "mhc.mlt"
    assert main(["simulate", "--graph", f"megamhc:spec={spec},tile_tokens=32", "--trace", str(trace)]) == 0
    assert "megamhc_bwd" in capsys.readouterr().out and trace.exists()
    assert main(["simulate", "--graph", f"megamhc:spec={spec},direction=fwd"]) == 0
    assert "megamhc_fwd" in capsys.readouterr().out
    assert main(["simulate", "--graph", "megamhc:tokens=8,hiden=4"]) == 2
    assert "unknown option(s) hiden" in capsys.readouterr().err


def test_saved_graph_finds_its_ops_through_the_plugin_entry(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "gate.mlg"
    GRAPHS["gate"]("bwd").save(str(path))
    # a fresh process imports no graphs module: validate() finds the ops through the entry points
    code = ("from megaloom.runtime import TaskGraph; from megaloom.scheduler import Simulator; "
            f"Simulator('h200').run(TaskGraph.load({str(path)!r}).validate())")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("which", ["gate", "mhc"])
def test_thread_executor_matches_reference_under_a_scheduler_policy(which):
    import torch

    from megaloom.runtime.testing import rel_l2
    from megaloom.runtime import ReferenceExecutor, ThreadExecutor
    from megaloom.scheduler import make_policy

    small = {"gate": lambda d: build_megagate(GateSpec(40, 24, 8, 3, "softmax", 1.5, True, "float32", 8, 10, 16), d),
             "mhc": lambda d: build_megamhc(MHCSpec(20, 6, tile_tokens=4, weight_cols=4, weight_rows=8), d)}[which]
    values = {}  # forward inputs, then the forward outputs the backward graph reads as saved tensors
    for direction in ("fwd", "bwd"):
        graph = small(direction)
        inputs = {b.name: values[b.name] if b.name in values else torch.rand(b.shape) + 0.1 for b in graph.inputs}
        ref = ReferenceExecutor().run(graph, inputs)
        got = ThreadExecutor({"cube": 2, "vector": 3}, policy=make_policy("critical_path")).run(graph, inputs)
        assert ref.outputs.keys() == got.outputs.keys()
        for name, want in ref.outputs.items():
            if want.dtype.is_floating_point:
                assert rel_l2(got[name], want) <= 1e-5, f"{graph.name}: {name}"
            else:
                assert torch.equal(got[name], want), f"{graph.name}: {name}"
        values = {**inputs, **ref.outputs}
