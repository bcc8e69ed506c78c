"""Replay of real GPU training traces: the identity replay against the recording, and the
import's figures side by side with Holistic Trace Analysis (HTA) on the same files.

    pip install -e '.[bench]'        # holistictraceanalysis 0.5 (pandas < 3)
    python benchmarks/replay_fidelity.py [TRACES_DIR] [--repeats 5]

TRACES_DIR defaults to ``$MEGALOOM_TRACES``, else the first ``shared/traces`` beside the
repository or one of its parents. Prints one JSON line per figure:

* per trace, ``device_delay``: the time before each device op that its dependencies leave
  unexplained (launch and queue latency; large values would mean missing dependencies);
* per trace, ``frozen``: the share of the run no what-if moves, by cause; what every device op
  1000x faster and ``--comm-speedup 2`` do to the run (``device_ops_1000x_faster``, ``comm_speedup_2``);
* per trace, identity replay: ``span_error`` (device span, target |e| <= 2%),
  ``exposed_comm_error`` (target |e| <= 10% of the recorded exposed comm or 1% of the span),
  ``on_time`` (device ops starting within 1% of the span of their recorded start, target >= 95%);
* per trace, against HTA on the events HTA analyses (it drops the last, incomplete profiler
  step and the kernels it launched): ``overlap`` (comm time overlapped by compute, %, where the
  trace has comm kernels) and ``critical_path`` (HTA's critical path length against ours, the
  longest chain of busy time along our dependencies: :func:`megaloom.runtime.metrics.busy_path`),
  also under HTA's conventions (no flow edges between threads, no edges inferred from timing,
  zero time for the calls HTA counts as blocking) to show where the difference comes from;
* on the largest trace, import time against HTA's ``parse_trace_dataframe`` (alternating, medians).
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from megaloom.runtime.metrics import HOST_ENGINES, busy_path, metrics
from megaloom.runtime.trace import Trace
from megaloom.scheduler.fidelity import fidelity, frozen_share
from megaloom.scheduler.importers import import_torch_profiler
from megaloom.scheduler.replay import WhatIf, replay


def traces_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("MEGALOOM_TRACES"):
        return Path(os.environ["MEGALOOM_TRACES"])
    for d in Path(__file__).resolve().parents[1:]:
        if (d / "shared" / "traces").is_dir():
            return d / "shared" / "traces"
    raise SystemExit("no traces: pass TRACES_DIR or set MEGALOOM_TRACES")


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def hta_window(path: Path, trace: Trace) -> list:
    """Our events that HTA analyses: with two or more ProfilerStep annotations, HTA keeps CPU
    events that start before the last step does and the kernels those launched."""
    events = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())["traceEvents"]
    steps = [e["ts"] for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep")
             and e.get("cat") == "user_annotation"]
    if len(steps) < 2:
        return list(trace.events)
    cut = (max(steps) - trace.meta["t0_us"]) * 1e-6
    kept = {e.task_id for e in trace.events if e.engine in HOST_ENGINES and e.start < cut}
    by_tid = {e.task_id: e for e in trace.events}
    for e in trace.events:  # device ops follow their launch call (a host dependency)
        if e.engine not in HOST_ENGINES and any(d in kept and by_tid[d].engine in HOST_ENGINES for d in e.deps):
            kept.add(e.task_id)
    return [e for e in trace.events if e.task_id in kept]


HTA_BLOCKING = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventQuery", "cudaEventSynchronize",
                          "cudaMemcpy", "cudaMemcpyAsync"})
"""Calls HTA 0.5 counts as zero time on its critical path (``CPGraph.BLOCKING_SYNC_CALLS``), blocking or not."""


def hta_conventions(events: list) -> list:
    """Copies of ``events`` as HTA's graph sees them: no flow edges between host threads, no
    edges inferred from timing, and the calls HTA treats as blocking lasting no time."""
    by_tid = {e.task_id: e for e in events}
    out = []
    for e in events:
        drop = set(e.tags.get("inferred", ()))
        end = e.end
        if e.engine in HOST_ENGINES:
            drop |= {d for d in e.deps if d in by_tid and by_tid[d].engine in HOST_ENGINES
                     and by_tid[d].tags.get("thread") != e.tags.get("thread")}
            if e.op in HTA_BLOCKING:
                end = e.start
        out.append(type(e)(e.task_id, e.task, e.op, e.engine, e.unit, e.rank, e.start, end, e.flops, e.bytes,
                           e.comm_bytes, [d for d in e.deps if d not in drop], e.tags, e.precision))
    return out


def hta_figures(path: Path) -> dict:
    """HTA's comm/compute overlap (%) and critical path (us, with its breakdown), or the error it raised."""
    from hta.trace_analysis import TraceAnalysis

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        os.symlink(path.resolve(), Path(d) / path.name)  # HTA reads a directory of traces
        analysis = TraceAnalysis(trace_dir=d)
        rank = next(iter(analysis.t.traces))
        try:
            pct = float(analysis.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0])
            out["overlap"] = None if pct != pct else pct
        except Exception as e:  # HTA raises several types on traces it cannot analyse
            out["overlap_error"] = f"{type(e).__name__}: {e}"
        try:
            res = analysis.critical_path_analysis(rank=rank, annotation="", instance_id=None)
            if res is None or not res[1]:
                out["cp_error"] = "HTA found no critical path"
            else:
                df = res[0].get_critical_path_breakdown()
                out["cp_us"] = float(df.duration.sum())
                out["cp_parts"] = {k: float(v) for k, v in df.groupby("bound_by").duration.sum().items() if k}
        except Exception as e:
            out["cp_error"] = f"{type(e).__name__}: {e}"
    return out


def fidelity_figures(path: Path) -> None:
    t = time.perf_counter()
    trace, report = import_torch_profiler(path)
    t_import = time.perf_counter() - t
    t = time.perf_counter()
    out = replay(trace).trace
    t_replay = time.perf_counter() - t
    f = fidelity(trace, out)
    name = path.name.removesuffix(".json.gz").removesuffix(".json")
    m = f.recorded
    emit(trace=name, device=report.device, tasks=len(trace.events), device_ops=report.device_ops,
         inferred=report.inferred, import_s=round(t_import, 3), replay_s=round(t_replay, 3))
    emit(trace=name, figure="span_error", value=f.error("span"), recorded_us=m.device_span * 1e6,
         replayed_us=f.replayed.device_span * 1e6, target=0.02, ok=abs(f.error("span")) <= 0.02)
    emit(trace=name, figure="exposed_comm_error", value=f.error("exposed_comm"), recorded_us=m.exposed_comm * 1e6,
         replayed_us=f.replayed.exposed_comm * 1e6, target=0.10, ok=abs(f.error("exposed_comm")) <= 0.10)
    emit(trace=name, figure="on_time", value=f.on_time, worst_start_us=f.worst_start * 1e6, target=0.95,
         ok=f.on_time >= 0.95)
    delays = sorted(e.tags.get("delay", 0.0) for e in trace.events if e.engine not in HOST_ENGINES)
    if delays:  # what the dependencies leave unexplained before each device op: launch and queue latency
        emit(trace=name, figure="device_delay", median_us=statistics.median(delays) * 1e6,
             p99_us=delays[int(0.99 * (len(delays) - 1))] * 1e6, max_us=delays[-1] * 1e6,
             share_of_device_busy=sum(delays) / sum(v for k, v in m.busy.items() if k not in HOST_ENGINES))
    share = frozen_share(trace)
    emit(trace=name, figure="frozen", share=sum(share.values()), causes=share)
    fast = metrics(replay(trace, whatif=WhatIf(speedup={k: 1000.0 for k in m.busy if k not in HOST_ENGINES})).trace)
    emit(trace=name, figure="device_ops_1000x_faster", makespan_ratio=fast.makespan / m.makespan,
         device_span_ratio=fast.device_span / m.device_span)
    if m.busy.get("comm"):
        comm = metrics(replay(trace, whatif=WhatIf(comm_speedup=2.0)).trace)
        emit(trace=name, figure="comm_speedup_2", makespan_ratio=comm.makespan / m.makespan)
    emit(trace=name, figure="critical_path_le_span", critical_path_us=m.critical_path * 1e6,
         device_span_us=m.device_span * 1e6, ok=m.critical_path <= m.device_span * (1 + 1e-9))
    try:
        hta = hta_figures(path)
    except ImportError:
        emit(trace=name, figure="hta", error="holistictraceanalysis is not installed (pip install -e '.[bench]')")
        return
    window = hta_window(path, trace)
    ours = metrics(Trace(window, trace.meta))
    if ours.comm_time > 0 or hta.get("overlap") is not None:
        ov = ours.comm_hidden * 100
        emit(trace=name, figure="overlap", hta_pct=hta.get("overlap"), ours_pct=ov, error=hta.get("overlap_error"),
             diff_pct_points=None if hta.get("overlap") is None else ov - hta["overlap"],
             ok=hta.get("overlap") is not None and abs(ov - hta["overlap"]) <= 5.0)
    length, parts = busy_path(window)
    same, _ = busy_path(hta_conventions(window))
    if "cp_us" in hta:
        emit(trace=name, figure="critical_path", hta_us=hta["cp_us"], ours_us=length * 1e6,
             ratio=length * 1e6 / hta["cp_us"], ours_hta_conventions_us=same * 1e6,
             hta_conventions_ratio=same * 1e6 / hta["cp_us"],
             hta_parts_us=hta["cp_parts"], ours_parts_us={k: v * 1e6 for k, v in parts.items()},
             ok=abs(length * 1e6 / hta["cp_us"] - 1) <= 0.05, events_in_window=len(window))
    else:
        emit(trace=name, figure="critical_path", hta_error=hta.get("cp_error"), ours_us=length * 1e6)


def throughput(path: Path, repeats: int) -> None:
    """Import time against HTA's parse of the same file, alternating, medians."""
    from hta.common.trace_parser import parse_trace_dataframe
    from hta.configs.parser_config import ParserConfig

    ours, theirs = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        parse_trace_dataframe(str(path), ParserConfig.get_default_cfg())
        theirs.append(time.perf_counter() - t)
        t = time.perf_counter()
        trace, _ = import_torch_profiler(path)
        ours.append(time.perf_counter() - t)
    a, b = statistics.median(theirs), statistics.median(ours)
    emit(trace=path.name, figure="import_throughput", hta_parse_s=a, ours_import_s=b, ratio=a / b,
         hta_range_s=[min(theirs), max(theirs)], ours_range_s=[min(ours), max(ours)],
         events_per_s=len(trace.events) / b, repeats=repeats, ok=a / b >= 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="?", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # HTA logs every parse
    d = traces_dir(args.traces)
    files = sorted(p for p in d.iterdir() if p.name.endswith((".json", ".json.gz")))
    emit(machine=f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}", traces=str(d),
         files=len(files))
    for p in files:
        fidelity_figures(p)
    if files:
        throughput(max(files, key=lambda p: p.stat().st_size), args.repeats)


if __name__ == "__main__":
    main()
