"""Two gloo ranks: data parallel, FSDP (uneven shards) and expert parallel (MegaMoE), and resume."""
import json

import pytest

from megaloom.comm.spawn import run_world
from megaloom.trainer import Trainer

from .tiny import tiny_config

MOE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}
UNEVEN = {"config": {"vocab_size": 129}}  # embedding / lm_head rows split 65 + 64


def _losses(comm, out_dir, steps, **sections):
    return [r.loss for r in Trainer(tiny_config(out_dir, steps=steps, model=UNEVEN, **sections), comm=comm).fit()]


def world_runs(comm, tmp):
    rank_dir = f"{tmp}/r"  # shared by the ranks: checkpoints hold one file per rank
    out = {
        "dp": _losses(comm, f"{tmp}/dp", 4),
        "fsdp": _losses(comm, f"{tmp}/fsdp", 4, parallel={"fsdp": True}),
        "ep_fsdp": _losses(comm, f"{tmp}/ep", 4, parallel={"ep_size": 2, "fsdp": True}, replace=MOE,
                           trace={"steps": [2]}),
    }
    ck = {"interval": 1, "stop_after": 2}
    first = _losses(comm, rank_dir, 4, parallel={"ep_size": 2, "fsdp": True}, replace=MOE, checkpoint=ck)
    rest = _losses(comm, rank_dir, 4, parallel={"ep_size": 2, "fsdp": True}, replace=MOE,
                   checkpoint={"interval": 1, "resume": True})
    out["resumed"] = first + rest
    return out


@pytest.mark.dist
def test_two_ranks_dp_fsdp_ep_and_resume(tmp_path):
    ranks = run_world(world_runs, 2, str(tmp_path), timeout=120, comm_timeout=30)
    r0, r1 = ranks
    assert r0 == r1  # every rank logs the same (all-reduced) loss
    dp = r0["dp"]
    assert dp[-1] < dp[0]
    for name in ("fsdp", "ep_fsdp"):
        assert r0[name] == pytest.approx(dp, rel=1e-5), name  # same maths, other parallel layout
    assert r0["resumed"] == r0["ep_fsdp"]  # bit-exact after stopping at step 2 and resuming
    trace0 = json.loads((tmp_path / "ep" / "traces" / "step2.rank1.json").read_text())
    engines = {ev["args"]["name"].split(".")[0] for ev in trace0["traceEvents"] if ev.get("name") == "thread_name"}
    assert {"host", "cube", "vector", "comm"} <= engines  # MegaMoE graph tasks sit beside the module spans
    names = {ev.get("name", "") for ev in trace0["traceEvents"]}
    assert any(n.startswith("model.layers.1.mlp/") for n in names)       # MegaMoE tasks (EP: with comm)
    assert any(n.startswith("model.layers.1.mlp.gate/") for n in names)  # MegaGate tasks, router under FSDP
