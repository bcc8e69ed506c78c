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
    events = {e.tid: e for e in run.trace.events}
    assert sorted(events) == list(range(len(graph)))
    for t in graph:  # every task starts after all its predecessors end
        assert all(events[p].end <= events[t.id].start + 1e-15 for p in graph.pred[t.id]), t.name
    m = metrics(run.trace)
    assert m.cube_vector_overlap > 0  # vector stages run under the projections
    assert m.makespan < sum(m.busy.values())  # so the run is shorter than the stages back to back
    again = Simulator("atlas-a3", units={"cube": 2, "vector": 2}, policy=policy).run(graph)
    assert [(e.tid, e.start, e.unit) for e in again.trace.events] == [(e.tid, e.start, e.unit) for e in run.trace.events]
