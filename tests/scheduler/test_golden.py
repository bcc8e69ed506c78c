"""Golden simulated traces: a fixed set of graphs under two policies (``fifo``, which takes
the compiled loop, and ``expert_interleave``, which takes the Python loop over the Core),
saved under ``tests/golden/``. A refactor leaves every event identical (every field, floats
exactly) and the metadata too. The files are of trace schema version 3 (rows), written before
traces were stored by column (version 4), so they also check that older files still load.

A change meant to move a schedule (a cost-model fix, a profile figure, a builder's tiling)
rewrites them: ``python -m pytest tests/scheduler/test_golden.py --update-golden``, then
commit the new files with the change that explains them.
"""
from pathlib import Path

import pytest

from megaloom.commands.simulate import resolve_graph
from megaloom.runtime import Trace
from megaloom.scheduler import Simulator
from .graphs import random_dag

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
UNITS = {"cube": 2, "vector": 2, "comm": 1}  # few units, so the policies order contended work
GRAPHS = {
    "random_dag": lambda: random_dag(11, 80),
    "megamoe_fwd": lambda: resolve_graph("megamoe:tokens=64,hidden=32,intermediate=16,experts=4,top_k=2,tile_m=16,ep=2"),
    "megagate_bwd": lambda: resolve_graph("megagate:tokens=64,hidden=32,experts=8,top_k=2,tile_tokens=16,direction=bwd"),
    "megamhc_fwd": lambda: resolve_graph("megamhc:tokens=64,hidden=32,tile_tokens=16"),
}
POLICIES = ("fifo", "expert_interleave")
CASES = [(g, p) for g in GRAPHS for p in POLICIES]


def _first_difference(got: Trace, want: Trace) -> str:
    if got.meta != want.meta:
        return f"meta differs: {got.meta} != {want.meta}"
    for i, (a, b) in enumerate(zip(got.events, want.events)):
        if a != b:
            field = next(f for f in a.__slots__ if getattr(a, f) != getattr(b, f))
            return f"event {i} ({a.task!r}) differs in {field}: {getattr(a, field)!r} != {getattr(b, field)!r}"
    return f"{len(got.events)} events != {len(want.events)}" if len(got.events) != len(want.events) \
        else "the trace read back from its file differs"


@pytest.mark.parametrize("graph, policy", CASES)
def test_simulated_trace_is_byte_identical(tmp_path, update_golden, graph, policy):
    trace = Simulator("ascend-910b", UNITS, policy).run(GRAPHS[graph]()).trace
    fresh = tmp_path / "trace.mlt"
    trace.save(fresh)
    golden = GOLDEN / f"{graph}.{policy}.mlt"
    if update_golden:
        golden.write_bytes(fresh.read_bytes())
        return
    assert golden.exists(), f"{golden} is missing: run with --update-golden and commit it"
    want = Trace.load(golden)
    if trace != want or Trace.load(fresh) != want:
        pytest.fail(f"{golden.name}: {_first_difference(trace, want)} (a schedule change? "
                    "see this module's docstring)")


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN.glob("*.mlt")) == sorted(f"{g}.{p}.mlt" for g, p in CASES)
