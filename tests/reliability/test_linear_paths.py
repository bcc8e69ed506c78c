"""Crafted inputs stay on linear paths: work grows with the input's size, never with its square.

Each test builds the same crafted input at two sizes, eight times apart, and holds the work
(process CPU time, the better of two runs) of the larger within 20x of the smaller: linear
work gives about 8x, quadratic 64x.
"""
import importlib.util
import time
from pathlib import Path

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import TaskGraph, Trace, TraceEvent
from megaloom.scheduler.replay import replay

SMALL, LARGE = 1000, 8000


def _cpu(fn) -> float:
    best = float("inf")
    for _ in range(2):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _linear(make, check) -> None:
    small, large = make(SMALL), make(LARGE)
    t_small, t_large = _cpu(lambda: check(small)), _cpu(lambda: check(large))
    assert t_large < 20 * max(t_small, 1e-3), f"{LARGE} items took {t_large:.3f} s, {SMALL} took {t_small:.3f} s"


def indirect_reads(n: int) -> dict:
    """A graph file whose stored edges order every read only through a chain of other tasks:
    task 0 writes ``h``; task i reads it, ordered after task i - 1 alone (``benchmarks/loading.py``)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "loading.py"
    spec = importlib.util.spec_from_file_location("bench_loading", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.indirect(n).to_dict()


def test_reads_ordered_through_a_chain_validate_in_linear_time():
    def check(d: dict) -> None:
        TaskGraph.from_dict(d).validate()

    _linear(indirect_reads, check)


def test_an_unordered_read_of_a_crafted_file_is_still_found():
    d = indirect_reads(50)
    d["pred"][30] = []  # task 30 no longer follows the writer
    g = TaskGraph.from_dict(d)
    try:
        g.validate()
    except Exception as e:  # noqa: BLE001  (the message is what is checked)
        assert "copy#30" in str(e) and "no task ordered before it writes" in str(e)
    else:
        raise AssertionError("a read with no order after its writer passed validation")


def fan_in(n: int) -> Trace:
    """A trace whose last event depends on every other."""
    events = [TraceEvent(i, f"t{i}", "noop", "vector", 0, 0, i * 1e-6, (i + 1) * 1e-6) for i in range(n - 1)]
    events.append(TraceEvent(n - 1, "sink", "noop", "vector", 0, 0, n * 1e-6, (n + 1) * 1e-6, deps=list(range(n - 1))))
    return Trace(events, {"graph": "fan-in", "units": {"vector": 1}})


def test_an_event_depending_on_all_others_replays_in_linear_time():
    _linear(fan_in, replay)
    out = replay(fan_in(100)).trace.events
    assert out[-1].task == "sink" and out[-1].start >= max(e.end for e in out[:-1])
