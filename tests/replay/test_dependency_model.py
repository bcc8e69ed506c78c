"""One hand-written trace per row of the dependency model (docs/replay.md): the import gives the
expected edges and delays, the identity replay gives the recording back exactly, and a what-if
moves exactly what the dependency says it moves."""
import pytest

from megaloom.scheduler.importers import import_ranks, import_torch_profiler
from megaloom.scheduler.replay import WhatIf, replay

from .kineto import by_name, call, cpu, identity, kernel, sync, write

K2 = WhatIf(speedup={"kernel": 2})  # every plain kernel twice as fast


def load(tmp_path, events, **kw):
    trace, report = import_torch_profiler(write(tmp_path / "t.json", events, **kw))
    identity(trace)
    return trace, report, {e.task: e for e in trace.events}


def test_launch_splits_the_call_and_a_kernel_starts_at_its_launch(tmp_path):
    trace, rep, ev = load(tmp_path, [
        call("cudaLaunchKernel", 0, 10, 1), kernel("A", 4, 20, 1),   # starts inside its launch call
        call("cudaLaunchKernel", 12, 2, 2), kernel("B", 30, 10, 2),  # queued behind A, then 6 us latency
    ])
    assert by_name(trace)["cudaLaunchKernel"] == (0, 4) and by_name(trace)["cudaLaunchKernel#1"] == (4, 10)
    assert ev["A"].deps == [ev["cudaLaunchKernel"].task_id] and rep.split_calls == 1
    assert sorted(ev["B"].deps) == sorted([ev["cudaLaunchKernel#2"].task_id, ev["A"].task_id])
    assert ev["B"].tags["delay"] == pytest.approx(6e-6) and rep.deps == {"launch": 2, "stream order": 1}
    out = by_name(replay(trace, whatif=K2).trace)
    assert out["A"] == (4, 14) and out["B"] == (20, 25)  # B: A ends at 14, then its 6 us latency


def _wait_trace(record: bool):
    events = [
        call("cudaLaunchKernel", 0, 2, 1), kernel("A", 3, 20, 1, stream=7),
        call("cudaEventRecord", 2, 1, 2), call("cudaStreamWaitEvent", 3, 1, 3),
        call("cudaLaunchKernel", 4, 2, 4), kernel("B", 24, 6, 4, stream=8),
    ]
    if record:
        events.append(sync("Stream Wait Event", 4, 0, 3, stream=8, wait_on_stream=7, wait_on_cuda_event_record_corr_id=2))
    return events


@pytest.mark.parametrize("record", [True, False], ids=["sync-record", "inferred"])
def test_stream_wait_by_event_record_or_inferred_from_timing(tmp_path, record):
    trace, rep, ev = load(tmp_path, _wait_trace(record))
    assert ev["A"].task_id in ev["B"].deps and ev["B"].tags["delay"] == pytest.approx(1e-6)
    assert (rep.deps.get("event wait"), rep.inferred.get("event wait (from timing)")) == ((1, None) if record else (None, 1))
    assert ev["B"].tags.get("inferred") == (None if record else [ev["A"].task_id])
    out = by_name(replay(trace, whatif=K2).trace)
    assert out["A"] == (3, 13) and out["B"] == (14, 17)


SYNCS = {
    "context": ("cudaDeviceSynchronize", [sync("Context Sync", 5, 51, 2)]),
    "stream": ("cudaStreamSynchronize", [sync("Stream Sync", 5, 51, 2, stream=7)]),
    "event": ("cudaEventSynchronize", [sync("Event Sync", 5, 51, 2, wait_on_stream=7, wait_on_cuda_event_record_corr_id=9)]),
    "device, no record": ("cudaDeviceSynchronize", []),
    "stream, no record": ("cudaStreamSynchronize", []),
}


@pytest.mark.parametrize("kind", SYNCS)
def test_host_sync_waits_for_the_gpu_work_it_names(tmp_path, kind):
    name, records = SYNCS[kind]
    trace, rep, ev = load(tmp_path, [
        call("cudaLaunchKernel", 0, 2, 1), kernel("K", 3, 50, 1),
        call("cudaEventRecord", 2, 1, 9),
        call(name, 5, 51, 2), *records,                       # returns 3 us after K ends
        call("cudaLaunchKernel", 60, 2, 3), kernel("K2", 63, 10, 3),
    ])
    assert by_name(trace)[name] == (5, 5) and by_name(trace)[f"{name}#1"] == (53, 56)  # host part, then its return
    assert ev["K"].task_id in ev[f"{name}#1"].deps
    out = by_name(replay(trace, whatif=K2).trace)
    assert out["K"] == (3, 28) and out[f"{name}#1"] == (28, 31)   # returns 3 us after K, now earlier
    assert out["cudaLaunchKernel#1"] == (35, 37) and out["K2"] == (38, 43)  # host gap and launch latency kept


def test_synchronous_copy_waits_for_its_copy(tmp_path):
    trace, rep, ev = load(tmp_path, [
        call("cudaMemcpy", 0, 30, 1), kernel("Memcpy DtoH (Device -> Pageable)", 2, 23, 1, cat="gpu_memcpy", bytes=4096),
        call("cudaLaunchKernel", 35, 2, 2), kernel("K", 38, 10, 2),
    ])
    copy = ev["Memcpy DtoH (Device -> Pageable)"]
    assert (copy.engine, copy.comm_bytes, copy.tags["link"]) == ("copy", 4096, "host")
    assert rep.deps["synchronous_copy"] == 1 and by_name(trace)["cudaMemcpy#2"] == (25, 30)
    out = by_name(replay(trace, whatif=WhatIf(speedup={"memcpy": 2})).trace)
    assert out["Memcpy DtoH (Device -> Pageable)"] == (2, 13.5) and out["cudaMemcpy#2"] == (13.5, 18.5)
    assert out["cudaLaunchKernel"] == (23.5, 25.5) and out["K"] == (26.5, 36.5)


def test_async_copy_to_pageable_memory_is_synchronous_other_async_copies_are_not(tmp_path):
    trace, rep, ev = load(tmp_path, [
        call("cudaMemcpyAsync", 0, 30, 1), kernel("Memcpy DtoH (Device -> Pageable)", 2, 23, 1, cat="gpu_memcpy"),
        call("cudaMemsetAsync", 31, 9, 2), kernel("Memset (Device)", 33, 2, 2, cat="gpu_memset"),  # done before it returns
        call("cudaMemcpyAsync", 41, 9, 3), kernel("Memcpy DtoD (Device -> Device)", 43, 2, 3, cat="gpu_memcpy"),
    ])
    assert rep.deps["synchronous_copy"] == 1 and ev["cudaMemcpyAsync#2"].tags["sync"] == "synchronous_copy"
    assert [e.task for e in trace.events if e.tags.get("sync")] == ["cudaMemcpyAsync#2"]


def test_item_copy_then_stream_sync_without_sync_records(tmp_path):
    trace, rep, ev = load(tmp_path, [
        cpu("aten::item", 0, 40), cpu("aten::_local_scalar_dense", 0.5, 39),
        call("cudaMemcpyAsync", 1, 4, 1), kernel("Memcpy DtoH (Device -> Pinned)", 6, 20, 1, cat="gpu_memcpy"),
        call("cudaStreamSynchronize", 5, 25, 2),
    ])
    copy = ev["Memcpy DtoH (Device -> Pinned)"].task_id
    assert rep.inferred == {"stream_sync": 1} and copy in ev["cudaStreamSynchronize#1"].deps
    assert ev["cudaStreamSynchronize#1"].tags["inferred"] == [copy]
    assert ev["cudaMemcpyAsync"].tags["op"] == "aten::_local_scalar_dense"
    out = by_name(replay(trace, whatif=WhatIf(speedup={"memcpy": 2})).trace)
    assert out["cudaStreamSynchronize#1"] == (16, 20)


def test_host_gaps_are_kept_as_delays_with_their_cpu_time(tmp_path):
    trace, rep, ev = load(tmp_path, [
        cpu("aten::mul", 0, 20), call("cudaLaunchKernel", 15, 2, 1), kernel("A", 18, 4, 1),
        cpu("aten::add", 30, 20), call("cudaLaunchKernel", 45, 2, 2), kernel("B", 48, 4, 2),
        cpu("aten::cat", 60, 10),   # CPU work after the last call: the thread ends there
    ])
    first, second = ev["cudaLaunchKernel"], ev["cudaLaunchKernel#1"]
    assert first.tags["delay"] == pytest.approx(15e-6) and first.tags["cpu"] == pytest.approx(15e-6)
    assert second.tags["delay"] == pytest.approx(28e-6) and second.tags["cpu"] == pytest.approx(18e-6)  # 20..30 idle
    assert by_name(trace)["thread end"] == (70, 70)
    out = by_name(replay(trace, whatif=WhatIf(speedup={"kernel": 4})).trace)
    assert out["cudaLaunchKernel#1"] == (45, 47) and out["B"] == (48, 49)  # host time does not move


def test_overhanging_child_is_clamped_not_dropped(tmp_path):
    trace, rep, ev = load(tmp_path, [
        cpu("aten::mm", 0, 10), call("cudaLaunchKernel", 8, 2.5, 1), kernel("sm80_xmma_gemm", 9, 20, 1),
        cpu("aten::relu", 10, 10), call("cudaLaunchKernel", 12, 2, 2), kernel("relu_kernel", 30, 5, 2),
    ])
    assert rep.overhangs == 1 and rep.max_overhang_us == pytest.approx(0.5)
    assert by_name(trace)["cudaLaunchKernel#1"] == (9, 10) and ev["sm80_xmma_gemm"].engine == "cube"
    assert ev["relu_kernel"].tags["launched_by"] == "aten::relu" and rep.dropped == {}


def test_annotations_are_tags_never_tasks(tmp_path):
    trace, rep, ev = load(tmp_path, [
        cpu("ProfilerStep#3", 0, 100, cat="user_annotation"),
        cpu("aten::mm", 1, 10), call("cudaLaunchKernel", 2, 2, 1),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "pid": 0, "tid": 7, "ts": 5, "dur": 60, "args": {}},
        kernel("ampere_sgemm_128x64_nn", 5, 30, 1), kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 36, 20, 2),
        call("cudaLaunchKernel", 20, 2, 2),
    ])
    assert not [e for e in trace.events if "ProfilerStep" in e.task]
    assert ev["cudaLaunchKernel"].tags["annotations"] == ["ProfilerStep#3"]
    assert ev["ncclKernel_AllReduce_RING_LL_Sum_float"].tags["annotations"] == ["ProfilerStep#3"]
    assert rep.context == {"cpu_op": 1, "user_annotation": 1, "gpu_user_annotation": 1} and rep.device_ops == 2


def test_comm_stream_overlap_and_message_size(tmp_path):
    trace, rep, ev = load(tmp_path, [
        call("cudaLaunchKernel", 0, 2, 1), kernel("void at::native::vectorized_elementwise_kernel", 10, 50, 1),
        cpu("record_param_comms", 3, 6, **{"Collective name": "allreduce", "In msg nelems": 1 << 20,
                                           "Out msg nelems": 1 << 20, "dtype": "Float", "Group size": 4,
                                           "Process Group Name": "0", "Seq": 7}),
        call("cudaLaunchKernel", 4, 2, 2), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 40, 2, stream=14),
    ])
    nccl = ev["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    assert (nccl.engine, nccl.op, nccl.tags["pg"], nccl.tags["seq"]) == ("comm", "all_reduce", "0", 7)
    assert nccl.comm_bytes == pytest.approx(2 * 3 / 4 * 4 * (1 << 20)) and nccl.bytes == 8 * (1 << 20)
    from megaloom.runtime.metrics import metrics

    m = metrics(trace)
    assert m.comm_time == pytest.approx(40e-6) and m.comm_hidden == pytest.approx(0.5)
    assert m.exposed_comm == pytest.approx(20e-6) and m.critical_path <= m.device_span


def _rank(step_us: float, rank: int) -> list:
    """One rank: a compute kernel of ``step_us``, then an all-reduce that waits for it."""
    return [
        call("cudaLaunchKernel", 0, 2, 1), kernel("void elementwise_kernel", 3, step_us, 1),
        call("cudaEventRecord", 2, 1, 2), call("cudaStreamWaitEvent", 3, 1, 3),
        sync("Stream Wait Event", 4, 0, 3, stream=14, wait_on_stream=7, wait_on_cuda_event_record_corr_id=2),
        call("cudaLaunchKernel", 4, 2, 4), kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 4 + step_us, 56 - step_us, 4,
                                                  stream=14),
    ]


def test_two_ranks_skewed_all_reduce_waits_for_the_slow_rank(tmp_path):
    paths = [write(tmp_path / f"r{r}.json", _rank(step, r), rank=r, world=2) for r, step in ((0, 10), (1, 40))]
    trace, reports = import_ranks(paths)
    assert [r.rank for r in reports] == [0, 1] and trace.ranks == [0, 1]
    identity(trace)
    nccl = "ncclKernel_AllReduce_RING_LL_Sum_float"
    assert by_name(trace, 0)[nccl] == (14, 60) and by_name(trace, 1)[nccl] == (44, 60)
    out = replay(trace, whatif=K2).trace  # both computes twice as fast: rank 1 arrives at 24, transfer 16
    assert by_name(out, 0)["void elementwise_kernel"] == (3, 8) and by_name(out, 1)["void elementwise_kernel"] == (3, 23)
    assert by_name(out, 0)[nccl] == (9, 40) and by_name(out, 1)[nccl] == (24, 40)
    from megaloom.runtime.metrics import metrics

    assert metrics(out).comm_time == pytest.approx((31 + 16) / 2 * 1e-6)  # rank 0 waits 15 us of its 31


def test_gzipped_trace_loads(tmp_path):
    p = write(tmp_path / "t.json.gz", [call("cudaLaunchKernel", 0, 2, 1), kernel("A", 3, 5, 1)], gz=True)
    trace, rep = import_torch_profiler(p)
    assert rep.device_ops == 1 and trace.meta["profile"] == "a100"


def test_ranks_on_other_clocks_are_aligned_on_collective_ends(tmp_path):
    skewed = [dict(e, ts=e["ts"] + 1000) for e in _rank(40, 1)]  # rank 1's host clock runs 1 ms ahead
    paths = [write(tmp_path / "r0.json", _rank(10, 0), rank=0, world=2), write(tmp_path / "r1.json", skewed, rank=1, world=2)]
    trace, reports = import_ranks(paths)
    assert trace.meta["clock_offsets_us"] == {"1": pytest.approx(1000)} and "clock shifted by -1000.000 us" in reports[1].notes[0]
    nccl = "ncclKernel_AllReduce_RING_LL_Sum_float"
    assert by_name(trace, 0)[nccl] == (14, 60) and by_name(trace, 1)[nccl] == (44, 60)
    identity(trace)


def test_collectives_match_by_process_group_and_sequence_number(tmp_path):
    def rank(order):  # two groups' all-reduces, issued in the given order
        events, t = [], 0
        for i, (pg, seq) in enumerate(order):
            events += [cpu("record_param_comms", t, 3, **{"Collective name": "allreduce", "Process Group Name": pg,
                                                          "Seq": seq, "In msg nelems": 4, "dtype": "Float", "Group size": 2}),
                       call("cudaLaunchKernel", t + 1, 1, i + 1), kernel(f"ncclKernel_AllReduce_{pg}", 10 + 30 * i, 20, i + 1,
                                                                            stream=14 if pg == "a" else 15)]
            t += 5
        return events
    paths = [write(tmp_path / "r0.json", rank([("a", 1), ("b", 1)]), rank=0, world=2),
             write(tmp_path / "r1.json", rank([("b", 1), ("a", 1)]), rank=1, world=2)]
    trace, _ = import_ranks(paths)
    out = replay(trace).trace  # by order, a would meet b
    got = {(e.rank, e.task): (round(e.start * 1e6, 6), round(e.end * 1e6, 6)) for e in out.events if e.engine == "comm"}
    for k in ("a", "b"):  # matched by group: no rank's copy ends before the other rank has reached it
        mine, theirs = got[(0, f"ncclKernel_AllReduce_{k}")], got[(1, f"ncclKernel_AllReduce_{k}")]
        assert mine[1] >= theirs[0] and theirs[1] >= mine[0]


def test_flow_edges_join_forward_to_backward_across_threads(tmp_path):
    flow = {"cat": "fwdbwd", "name": "fwdbwd", "id": 1, "pid": 1}
    trace, rep, ev = load(tmp_path, [
        cpu("aten::mm", 0, 10, tid=1), dict(flow, ph="s", tid=1, ts=0),
        cpu("MmBackward0", 50, 10, tid=2), dict(flow, ph="f", tid=2, ts=50, bp="e"),
    ])
    assert ev["aten::mm"].task_id in ev["MmBackward0"].deps and rep.deps == {"flow fwdbwd": 1}
    out = by_name(replay(trace, whatif=WhatIf(speedup={"aten::mm": 0.1})).trace)  # forward 10x slower
    assert out["aten::mm"] == (0, 100) and out["MmBackward0"] == (140, 150)  # backward follows, its 40 us gap kept


def test_launch_blocked_on_a_full_queue_waits_for_the_device(tmp_path):
    trace, rep, ev = load(tmp_path, [
        call("cudaLaunchKernel", 0, 2, 1), kernel("A", 3, 200, 1),
        call("cudaLaunchKernel", 3, 2, 2), kernel("B", 203, 5, 2),
        call("cudaLaunchKernel", 6, 200, 3), kernel("C", 208, 5, 3),  # returns 3 us after A ends: blocked on it
    ])
    assert rep.inferred == {"implicit sync: launch queue full": 1}
    assert ev["A"].task_id in ev["cudaLaunchKernel#3"].deps  # the call's return piece, after its (empty) host part
    out = by_name(replay(trace, whatif=K2).trace)
    assert out["A"] == (3, 103) and out["cudaLaunchKernel#3"] == (103, 106)  # the launch returns when A ends
    assert out["C"] == (106, 108.5)


def test_host_thread_woken_by_another_threads_end_waits_for_it(tmp_path):
    trace, rep, ev = load(tmp_path, [
        cpu("aten::add", 0, 10, tid=1), cpu("aten::sum", 1000, 10, tid=1),   # idle 990 us, woken ...
        cpu("aten::mm", 20, 900, tid=2),                                     # ... 80 us after this ends
    ])
    assert rep.inferred == {"host waits for another thread (from timing)": 1}
    assert ev["aten::mm"].task_id in ev["aten::sum"].deps and ev["aten::sum"].tags["delay"] == pytest.approx(80e-6)
    out = by_name(replay(trace, whatif=WhatIf(speedup={"aten::mm": 2})).trace)
    assert out["aten::sum"] == (550, 560)


def test_host_idle_after_handing_a_collective_over_waits_for_it_however_late_it_woke(tmp_path):
    gloo = {"cat": "user_annotation", "pid": 1, "tid": 2, "ph": "X"}
    trace, rep, ev = load(tmp_path, [
        cpu("aten::add", 0, 10), cpu("c10d::allreduce_", 20, 300),          # issues the all-reduce, returns at 320
        dict(gloo, name="gloo:all_reduce", ts=100, dur=900),                   # gloo's thread runs it until 1000
        cpu("aten::sum", 3000, 10),                                            # the host wakes 2 ms late (a loaded machine)
    ])
    assert rep.inferred == {"host waits for the collective it handed over (from timing)": 1}
    assert ev["gloo:all_reduce"].task_id in ev["aten::sum"].deps and ev["aten::sum"].tags["delay"] == pytest.approx(2000e-6)
    out = by_name(replay(trace, whatif=WhatIf(comm_speedup=3)).trace)
    assert out["aten::sum"] == (2400, 2410)  # the collective lasts 300 us of its 900: the host wakes 600 us earlier
