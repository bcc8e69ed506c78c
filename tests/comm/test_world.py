"""Multi-process gloo checks: several checks per spawned world, so the file stays fast.

World functions run on every rank (``fn(comm, *args)``) and return msgpack data.
Expected values are computed in plain torch from the same seeded data on each rank.
"""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
from torch import nn

from megaloom.comm import ShardLayout, gather_uneven, reduce_scatter_uneven, shard_offsets, shard_sizes
from megaloom.comm.checkpoint import CheckpointError, load_params, save_params, verify
from megaloom.comm.ops import chain
from megaloom.comm.spawn import run_world
from megaloom.comm.stream import Collector, TraceStreamer
from megaloom.runtime import CommError, ExecContext, ReferenceExecutor, TaskGraph, ThreadExecutor

pytestmark = pytest.mark.dist
STEPS = 3
SKEW = 100.0  # seconds rank 1's clock runs ahead in the clock-alignment check


def _data(rank: int, rows: int, cols: int = 3, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, cols, generator=g).to(dtype)


def _splits(world: int) -> list[list[int]]:
    """send[r][p]: rows rank r sends to rank p (uneven, some zero)."""
    return [[(r * 2 + p) % 3 for p in range(world)] for r in range(world)]


def _check_collectives(comm) -> None:
    r, w = comm.rank, comm.world_size
    send = _splits(w)
    x = _data(r, sum(send[r]))
    out = torch.empty(sum(send[p][r] for p in range(w)), 3)
    comm.all_to_all(out, x, send[r], [send[p][r] for p in range(w)])
    pieces = []
    for p in range(w):
        xp = _data(p, sum(send[p]))
        pieces.append(xp[sum(send[p][:r]): sum(send[p][:r + 1])])
    assert torch.equal(out, torch.cat(pieces)), "all_to_all"

    x = _data(r, 2)
    everyone = [_data(p, 2) for p in range(w)]
    gathered = torch.empty(2 * w, 3)
    comm.all_gather(gathered, x, async_op=True).wait()
    assert torch.equal(gathered, torch.cat(everyone)), "all_gather"

    full = _data(r, 2 * w)
    total = sum(_data(p, 2 * w) for p in range(w))
    mine = torch.empty(2, 3)
    comm.reduce_scatter(mine, full, "sum")
    assert torch.allclose(mine, total[2 * r: 2 * r + 2], atol=1e-6), "reduce_scatter sum"
    comm.reduce_scatter(mine, full, "avg")
    assert torch.allclose(mine, total[2 * r: 2 * r + 2] / w, atol=1e-6), "reduce_scatter avg"

    y = _data(r, 4)
    h = comm.all_reduce(y, "max", async_op=True)
    h.wait()
    assert torch.equal(y, torch.stack([_data(p, 4) for p in range(w)]).amax(0)), "all_reduce max"

    # strided (non-contiguous) output views are filled too
    wide = torch.zeros(2 * w, 6)
    comm.all_gather(wide[:, 1:4], x)
    assert torch.equal(wide[:, 1:4], torch.cat(everyone)) and not wide[:, 4:].any(), "strided all_gather"

    nxt, prv = (r + 1) % w, (r - 1) % w
    got = torch.empty(2, 3)
    hs = comm.send(_data(r, 2), nxt, async_op=True)
    comm.recv(got, prv)
    hs.wait()
    assert torch.equal(got, _data(prv, 2)), "send/recv ring"
    assert comm.exchange({"rank": r}) == [{"rank": p} for p in range(w)]


def _check_mismatch(comm) -> list[str]:
    """Wrong splits, then wrong dtype: CommError on every rank before data moves; group still usable."""
    r, w = comm.rank, comm.world_size
    errors = []
    recv = [1] * w
    if r == 1:
        recv[0] = 2  # rank 1 expects 2 rows from rank 0, which sends 1
    try:
        comm.all_to_all(torch.empty(sum(recv), 3), torch.zeros(w, 3), [1] * w, recv)
    except CommError as e:
        errors.append(str(e))
    dt = torch.float64 if r == w - 1 else torch.float32
    try:
        comm.all_to_all(torch.empty(w, 3, dtype=dt), torch.zeros(w, 3, dtype=dt), [1] * w, [1] * w)
    except CommError as e:
        errors.append(str(e))
    try:
        comm.all_gather(torch.empty(w * (2 + (r == 2)), 3), torch.zeros(2 + (r == 2), 3))
    except CommError as e:
        errors.append(str(e))
    t = torch.ones(1)
    comm.all_reduce(t)
    assert t.item() == w
    return errors


def _check_uneven(comm, rows: int) -> None:
    r, w = comm.rank, comm.world_size
    sizes, offs = shard_sizes(rows, w), shard_offsets(shard_sizes(rows, w))
    full = _data(7, rows)
    out = torch.empty(rows, 3)
    gather_uneven(comm, full[offs[r]: offs[r] + sizes[r]].clone(), sizes, out)
    assert torch.equal(out, full), f"uneven gather {rows}/{w}"
    grads = [_data(50 + p, rows) for p in range(w)]
    mine = torch.empty(sizes[r], 3)
    reduce_scatter_uneven(comm, grads[r], sizes, mine, "avg")
    want = (sum(grads) / w)[offs[r]: offs[r] + sizes[r]]
    assert torch.allclose(mine, want, atol=1e-6), f"uneven reduce_scatter {rows}/{w}"


def _overlap_graph(comm) -> TaskGraph:
    """x @ w on the cube while the all-to-all of another buffer runs, then an uneven gather."""
    w, r = comm.world_size, comm.rank
    send = _splits(w)
    sizes = shard_sizes(7, w)
    g = TaskGraph(f"world-rank{r}")
    a, x, wt = g.input("a", (sum(send[r]), 3)), g.input("x", (4, 3)), g.input("w", (3, 3))
    b = g.output("b", (sum(send[p][r] for p in range(w)), 3))
    s, full = g.input("s", (sizes[r], 3)), g.output("full", (7, 3))
    y = g.output("y", (4, 3))
    t1 = g.task("all_to_all", [a], [b], attrs={"send_splits": send[r], "recv_splits": [send[p][r] for p in range(w)]})
    g.task("matmul", [x, wt], [y])
    t2 = g.task("shard_all_gather", [s], [full], attrs={"sizes": sizes, "rank": r})
    chain(t1, t2)
    return g


def _check_graph(comm, streamer=None):
    """Run the overlap graph for real (events to ``streamer``) and check it; returns the run's trace."""
    r = comm.rank
    g = _overlap_graph(comm)
    inputs = {"a": _data(r, g.buffers["a"].shape[0]), "x": _data(9, 4), "w": _data(10, 3)[:3],
              "s": _data(7, 7)[shard_offsets(shard_sizes(7, comm.world_size))[r]:][: g.buffers["s"].shape[0]]}
    ctx = ExecContext(rank=r, world_size=comm.world_size, comm=comm)
    ref = ReferenceExecutor(ctx).run(g, inputs)
    real = ThreadExecutor({"cube": 1, "comm": 1}, ctx=ctx, observers=[streamer] if streamer else []).run(g, inputs)
    for name in ("b", "full", "y"):
        assert torch.equal(real[name], ref[name]), name
    assert torch.equal(ref["full"], _data(7, 7))
    return real.trace


def _sharded(comm, seed: int):
    """This rank's uneven dim-0 shards of an MLP's parameters (as FSDP keeps them) after STEPS Adam steps
    on gradients every rank draws alike, and the optimizer: ``({name: (shard, layout)}, optimizer)``."""
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))
    params = {}
    for fqn, p in mlp.named_parameters():
        lay = ShardLayout.of(tuple(p.shape), comm.world_size, comm.rank, fqn)
        params[fqn] = (nn.Parameter(lay.shard(p.detach()).clone()), lay)
    opt = torch.optim.Adam([t for t, _ in params.values()], lr=1e-2)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(seed * 100 + step)
        for t, lay in params.values():
            t.grad = lay.shard(torch.randn(lay.shape, generator=g)).clone()
        opt.step()
    return params, opt


def _full_state(comm, params, opt) -> dict[str, list]:
    """Every full tensor of the sharded state (gathered), as nested lists."""
    out = {}
    for fqn, (t, lay) in params.items():
        for key, v in [("", t.detach()), *opt.state[t].items()]:
            if v.dim():
                full = torch.empty(lay.shape, dtype=v.dtype)
                gather_uneven(comm, v.contiguous(), list(lay.sizes), full)
                v = full
            out[f"optim.state.{fqn}.{key}" if key else f"model.{fqn}"] = v.tolist()
    return out


def world_four(comm, ckpt: str):
    _check_collectives(comm)
    errors = _check_mismatch(comm)
    for rows in (7, 6):
        _check_uneven(comm, rows)
    _check_graph(comm)
    params, opt = _sharded(comm, 0)
    save_params(ckpt, comm, params, opt)
    save_params(ckpt, comm, params, opt)  # overwriting an existing checkpoint swaps it in whole
    again, opt2 = _sharded(comm, 1)
    load_params(ckpt, comm, again, opt2)  # same world size
    assert _full_state(comm, again, opt2) == _full_state(comm, params, opt)
    return {"errors": errors, "state": _full_state(comm, params, opt)}


def world_reload(comm, ckpt: str, endpoint: str | None, bad: str | None):
    r, w = comm.rank, comm.world_size
    _check_uneven(comm, 9 if w == 3 else 5)
    own = []  # this rank's all_to_all (start, end) on its own clock: time.perf_counter, SKEW ahead on rank 1
    if endpoint:
        clock = time.perf_counter
        time.perf_counter = (lambda: clock() + SKEW) if r == 1 else clock  # what the streamer and executor read
        try:
            streamer = TraceStreamer(endpoint, r)
            own = [(e.start, e.end) for e in _check_graph(comm, streamer).events if e.op == "all_to_all"]
            streamer.close()
        finally:
            time.perf_counter = clock
    params, opt = _sharded(comm, 123)  # other values than the saved ones, to be overwritten
    bad_error = ""
    if bad:
        try:
            load_params(bad, comm, params, opt)
        except CheckpointError as e:
            bad_error = str(e)
    man = load_params(ckpt, comm, params, opt)
    return {"state": _full_state(comm, params, opt), "saved_world": man["world_size"], "bad_error": bad_error,
            "own": own}


def world_dead_peer(comm):
    comm.barrier()
    if comm.rank == comm.world_size - 1:
        time.sleep(0.5)  # let every peer leave the barrier and enter the all_reduce
        os._exit(0)  # dies without a word
    comm.check = False  # fail in the data collective itself, not the metadata exchange
    t = torch.ones(3)
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
    except CommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": "", "seconds": time.monotonic() - t0}


def world_absent_peer(comm, port: int):
    import torch.distributed as dist

    from megaloom.comm import TorchCommunicator

    dist.destroy_process_group()
    t0 = time.monotonic()
    try:
        TorchCommunicator(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=1.5)
    except CommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": "", "seconds": time.monotonic() - t0}


def world_from_env(comm, port: int):
    """Re-join the world from torchrun-style environment variables alone (what ``megaloom launch`` sets)."""
    import torch.distributed as dist

    from megaloom.comm import TorchCommunicator

    rank, world = comm.rank, comm.world_size
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    c = TorchCommunicator(timeout=10)
    t = torch.full((2,), float(rank + 1))
    c.all_reduce(t)
    return [c.rank, c.world_size, c.backend, t.tolist()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "step3")
    results = run_world(world_four, 4, ckpt, timeout=80, comm_timeout=20)
    return ckpt, results


def _tensor(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_four_ranks_collectives_mismatch_and_sharding(saved):
    _, results = saved
    for res in results:
        split_err, dtype_err, gather_err = res["errors"]
        assert "rank 0 sends 1 rows to rank 1, which expects 2" in split_err
        assert "rank 3 sends torch.float64" in dtype_err
        assert "all_gather: ranks disagree" in gather_err and "rank 2 has torch.float32 (3, 3)" in gather_err


def test_checkpoint_is_readable_by_dcp_to_torch_save(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt, results = saved
    out = tmp_path / "full.pt"
    dcp_to_torch_save(ckpt, out)
    full = torch.load(out, weights_only=True)
    assert set(full) == set(results[0]["state"])
    assert full["model.0.weight"].shape == (9, 6) and full["optim.state.2.bias.exp_avg_sq"].shape == (5,)
    for k, v in results[0]["state"].items():
        assert torch.equal(full[k], _tensor(v)), k
    man = verify(ckpt)
    assert man["world_size"] == 4 and man["tensors"]["model.0.weight"]["shards"] == [[0, 3], [3, 2], [5, 2], [7, 2]]
    assert not os.path.exists(ckpt + ".partial") and not os.path.exists(ckpt + ".old")


def test_tampered_and_truncated_checkpoints_are_refused(saved, tmp_path):
    ckpt, _ = saved
    for how in ("truncate", "flip", "manifest"):
        bad = str(tmp_path / how)
        shutil.copytree(ckpt, bad)
        data = sorted(f for f in os.listdir(bad) if f.endswith(".distcp"))[0]
        target = os.path.join(bad, "megaloom.manifest" if how == "manifest" else data)
        raw = bytearray(open(target, "rb").read())
        raw = raw[: len(raw) // 2] if how != "flip" else raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
        open(target, "wb").write(bytes(raw))
        with pytest.raises(CheckpointError, match="truncated|tampered|manifest"):
            verify(bad)


def test_crash_between_renames_falls_back_to_previous(saved, tmp_path):
    ckpt, _ = saved
    half = str(tmp_path / "ck")
    shutil.copytree(ckpt, half + ".old")  # save() died after moving the old one aside
    shutil.copytree(ckpt, half + ".partial")
    assert verify(half)["path"] == half + ".old"


@pytest.mark.parametrize("world", [3, 2])
def test_reload_on_fewer_ranks_bit_exact(saved, tmp_path, world):
    ckpt, results = saved
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    meta = os.path.join(bad, ".metadata")
    open(meta, "ab").write(b"x")
    col = Collector() if world == 2 else None
    box: dict = {}
    th = None
    if col:
        th = threading.Thread(target=lambda: box.setdefault("trace", col.run(world, idle=30)), daemon=True)
        th.start()
    out = run_world(world_reload, world, ckpt, col.endpoint if col else None, bad, timeout=80, comm_timeout=20)
    want = results[0]["state"]
    for res in out:
        assert res["saved_world"] == 4
        assert "'.metadata'" in res["bad_error"] and "bytes" in res["bad_error"]
        assert set(res["state"]) == set(want)
        for k, v in want.items():
            assert torch.equal(_tensor(res["state"][k]), _tensor(v)), f"{k} differs after loading on {world} ranks"
    if col:
        th.join(30)
        col.close()
        trace = box["trace"]
        assert trace.ranks == [0, 1] and len(trace.events) == 2 * 3
        assert col.stats.malformed == col.stats.bad_rows == 0 and col.stats.finished == {0, 1}
        # aligned clocks: the collector moves each rank's events by that rank's clock offset, known up to the
        # one-way delay of its quickest message. Rank 1's clock runs SKEW ahead of rank 0's (one host, one
        # monotonic clock otherwise): its shift is SKEW less, up to those delays (however long a rank
        # waited around the collective)
        shift = {e.rank: e.start - out[e.rank]["own"][0][0] for e in trace.events if e.op == "all_to_all"}
        assert [len(res["own"]) for res in out] == [1, 1] and abs(shift[0] - shift[1] - SKEW) < 0.25, shift


def test_dead_peer_gives_comm_error_on_every_survivor():
    out = run_world(world_dead_peer, 4, timeout=40, comm_timeout=3, allow_fail=True)
    assert out[3] is None
    for res in out[:3]:
        assert "all_reduce failed" in res["error"] and res["seconds"] < 3 + 2


def test_absent_peer_gives_comm_error_within_timeout():
    from megaloom.comm.spawn import free_port

    (res,) = run_world(world_absent_peer, 1, free_port(), timeout=30)
    assert "cannot join a world of 2 ranks" in res["error"] and res["seconds"] < 1.5 + 2


def test_torchrun_environment_joins_the_world():
    from megaloom.comm.spawn import free_port

    assert run_world(world_from_env, 2, free_port(), timeout=30) == [[0, 2, "gloo", [3.0, 3.0]], [1, 2, "gloo", [3.0, 3.0]]]
