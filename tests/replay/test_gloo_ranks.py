"""Two gloo ranks recorded with torch.profiler by the test: their collectives (which run on
gloo's own threads, seen only as ``gloo:*`` annotations) import as comm tasks with bytes,
matched across ranks; send/recv pairs match by peer; the host's wait for an async collective
is derived; a comm what-if moves the replay."""
import time

import pytest

from megaloom.comm.spawn import run_world
from megaloom.runtime.metrics import metrics
from megaloom.scheduler.fidelity import fidelity
from megaloom.scheduler.importers import import_ranks
from megaloom.scheduler.replay import WhatIf, replay

N = 1 << 16


def _record(comm, out: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    rank, x = dist.get_rank(), torch.ones(N)
    dist.all_reduce(x)  # gloo connects on first use: outside the recording
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
        with record_function("experts.grad_sync"):
            dist.all_reduce(x)
        if rank == 1:
            time.sleep(0.05)  # rank 0's work.wait() below surely waits (for rank 1 to join)
        work = dist.all_reduce(x[: N // 4], async_op=True)
        torch.randn(32, 32).relu()
        work.wait()
        (dist.send if rank == 0 else dist.recv)(x[:100], 1 - rank)
    prof.export_chrome_trace(f"{out}/r{rank}.json")
    return rank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    assert run_world(_record, 2, str(out), timeout=180, comm_timeout=60) == [0, 1]
    return import_ranks([out / "r0.json", out / "r1.json"])


@pytest.mark.dist
def test_gloo_collectives_are_comm_tasks_with_bytes_matched_across_ranks(ranks):
    trace, reports = ranks
    for r in (0, 1):
        comm = [e for e in trace.events if e.rank == r and e.engine == "comm"]
        assert [e.comm_bytes for e in comm if e.op == "all_reduce"] == [4 * N, N]  # 2 (n-1)/n of each message
        assert [(e.op, e.tags["peer"], e.comm_bytes) for e in comm if e.op in ("send", "recv")] == \
            [("send" if r == 0 else "recv", 1 - r, 400)]
        assert reports[r].deps["collective handed over"] == 2  # each all-reduce after the c10d op issuing it
        # gloo's thread runs it, under the annotations of the call that issued it (a scope what-if finds it)
        assert [e.tags.get("annotations") for e in comm if e.op == "all_reduce"] == [["experts.grad_sync"], None]
    assert any("host waits for collective" in k for rep in reports for k in rep.inferred)
    assert abs(fidelity(trace, replay(trace).trace).error("span")) < 0.05  # ranks joined at every collective


@pytest.mark.dist
def test_comm_what_ifs_move_the_gloo_ranks(ranks):
    trace, _ = ranks
    base = metrics(replay(trace).trace)
    faster = metrics(replay(trace, whatif=WhatIf(comm_speedup=4)).trace)
    smaller = metrics(replay(trace, whatif=WhatIf(comm_bytes=0.25)).trace)
    assert faster.busy["comm"] < base.busy["comm"] and smaller.busy["comm"] < base.busy["comm"]
    assert faster.makespan < base.makespan
