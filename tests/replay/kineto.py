"""Hand-written Kineto (torch.profiler) traces for the replay tests: times in microseconds,
one host thread (pid 1, tid 1) and GPU 0 (pid 0) with streams as tids."""
import gzip
import json
import os
from pathlib import Path

from megaloom.runtime.trace import Trace
from megaloom.scheduler.replay import replay

DEVICE = {"id": 0, "name": "NVIDIA A100-SXM4-40GB", "computeMajor": 8, "computeMinor": 0, "numSms": 108, "warpSize": 32}


def traces_dir() -> Path | None:
    """The shared real traces: ``$MEGALOOM_TRACES``, else the first ``shared/traces`` beside the
    repository or one of its parents (a checkout may sit deeper than the shared folder)."""
    env = os.environ.get("MEGALOOM_TRACES")
    found = [Path(env)] if env else [d / "shared" / "traces" for d in Path(__file__).resolve().parents[2:]]
    return next((d for d in found if d.is_dir() and any(d.glob("*.json.gz"))), None)


def cpu(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def call(name, ts, dur, corr, tid=1, **args):
    return cpu(name, ts, dur, tid, "cuda_runtime", correlation=corr, **args)


def kernel(name, ts, dur, corr, stream=7, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0, **args}}


def sync(kind, ts, dur, corr, stream=-1, **args):
    return {"ph": "X", "cat": "cuda_sync", "name": kind, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"cuda_sync_kind": kind, "stream": stream, "correlation": corr, "device": 0, **args}}


def write(path, events, rank=None, world=None, gz=False):
    data = {"schemaVersion": 1, "deviceProperties": [DEVICE], "traceEvents": events}
    if rank is not None:
        data["distributedInfo"] = {"rank": rank, "world_size": world or 1}
    text = json.dumps(data).encode()
    Path(path).write_bytes(gzip.compress(text) if gz else text)
    return path


def by_name(trace: Trace, rank=None) -> dict:
    """Events by task name (times in microseconds, rounded to 1e-6 us) as ``(start, end)``."""
    return {e.task: (round(e.start * 1e6, 6), round(e.end * 1e6, 6)) for e in trace.events
            if rank is None or e.rank == rank}


def identity(trace: Trace) -> Trace:
    """Replay ``trace`` on its own device; assert it gives the recording back (to a picosecond:
    the replay adds up durations in floating point)."""
    out = replay(trace).trace
    got = {(e.rank, e.task_id): (e.start, e.end) for e in out.events}
    want = {(e.rank, e.task_id): (e.start, e.end) for e in trace.events}
    assert got.keys() == want.keys()
    bad = [(k, want[k], got[k]) for k in want if max(abs(a - b) for a, b in zip(want[k], got[k])) > 1e-12]
    assert not bad, bad[:5]
    return out
