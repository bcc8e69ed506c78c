"""Two gloo ranks: data parallel, FSDP (uneven shards) and expert parallel (MegaMoE), and resume
(same world size bit-exact; from 2 ranks to 1 and from 1 to 2 through the resharding checkpoints;
tensor parallel on 2 ranks to 1)."""
import json

import pytest
import torch

from megaloom.comm.spawn import run_world
from megaloom.train.trainer import Trainer, causal_lm_loss

from .tiny import tiny_config

MOE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}
UNEVEN = {"config": {"vocab_size": 129}}  # embedding / lm_head rows split 65 + 64
EP_FSDP = {"ep_size": 2, "fsdp": True}


def _trainer(comm, out_dir, steps, **sections):
    return Trainer(tiny_config(out_dir, steps=steps, model=UNEVEN, **sections), comm=comm)


def _losses(comm, out_dir, steps, **sections):
    return [r.loss for r in _trainer(comm, out_dir, steps, **sections).fit()]


def _batch_losses(trainer, step, ranks):
    """Loss of data rank ``r``'s batch of 0-based ``step`` under the current weights, for each ``r``."""
    with torch.no_grad():
        return [float(causal_lm_loss(trainer.model, trainer.data.batch(step, r, 2))) for r in ranks]


def world_runs(comm, tmp, one_rank_ckpt):
    rank_dir = f"{tmp}/r"  # shared by the ranks: one DCP checkpoint per step
    out = {
        "dp": _losses(comm, f"{tmp}/dp", 4),
        "fsdp": _losses(comm, f"{tmp}/fsdp", 4, parallel={"fsdp": True}),
        "ep_fsdp": _losses(comm, f"{tmp}/ep", 4, parallel=EP_FSDP, replace=MOE, trace={"steps": [2]}),
        "fsdp_bf16": _losses(comm, f"{tmp}/bf16", 4, parallel={"fsdp": True, "fsdp_param_dtype": "bfloat16",
                                                             "fsdp_reduce_dtype": "float32"}),
    }
    first = _trainer(comm, rank_dir, 4, parallel=EP_FSDP, replace=MOE, checkpoint={"interval": 1, "stop_after": 2})
    # each rank holds only its experts: their storage is the local rows, the full tensors are gone
    out["expert_storage"] = [p.untyped_storage().nbytes() / (p.numel() * p.element_size()) for p in first.parallel.ep_params]
    losses = [r.loss for r in first.fit()]
    out["step3_batch0"] = _batch_losses(first, 2, [0])[0]  # what a 1-rank resume must see at step 3
    rest = _losses(comm, rank_dir, 4, parallel=EP_FSDP, replace=MOE,
                   checkpoint={"interval": 1, "resume": True, "keep": 4})  # keep step 2 for the 1-rank resume
    out["resumed"] = losses + rest
    # a checkpoint saved by 1 rank: resumed here with EP + FSDP, saved again at once, then step 3
    two = _trainer(comm, f"{tmp}/from1", 4, parallel=EP_FSDP, replace=MOE,
                   checkpoint={"interval": 1, "stop_after": 3, "resume": one_rank_ckpt})
    out["from1_step"] = two.step
    two.save()
    out["from1"] = [r.loss for r in two.fit()]
    # tensor parallel (DTensor shards of heads and MLP columns) saved here, resumed by one process
    tp = _trainer(comm, f"{tmp}/tp", 4, parallel={"tp_size": 2}, checkpoint={"stop_after": 2})
    tp.fit()
    with torch.no_grad():  # a collective: both ranks run the one data rank's batch
        out["tp_step3"] = float(causal_lm_loss(tp.model, tp.data.batch(2, 0, 1)))
    return out


@pytest.mark.dist
def test_two_ranks_dp_fsdp_ep_and_resume(tmp_path):
    one = _trainer(None, tmp_path / "one", 4, replace=MOE, checkpoint={"interval": 1, "stop_after": 2})
    one_losses = [r.loss for r in one.fit()]
    with torch.no_grad():  # the stream goes on from where the 1-rank run stopped: its batches of steps 3 and 4
        one_next = [float(causal_lm_loss(one.model, one.data.batch(step, 0, 1))) for step in (2, 3)]
    one_ckpt = str(tmp_path / "one" / "checkpoints" / "step_00000002")

    ranks = run_world(world_runs, 2, str(tmp_path), one_ckpt, timeout=180, comm_timeout=30)
    r0, r1 = ranks
    assert r0 == r1  # every rank logs the same (all-reduced) loss
    dp = r0["dp"]
    assert dp[-1] < dp[0]
    for name in ("fsdp", "ep_fsdp"):
        assert r0[name] == pytest.approx(dp, rel=1e-5), name  # same maths, other parallel layout
    assert r0["resumed"] == r0["ep_fsdp"]  # bit-exact after stopping at step 2 and resuming
    assert r0["expert_storage"] == [1.0] * 4  # 2 layers x (gate_up, down), this rank's 4 of 8 experts
    # FSDP2 mixed precision: bfloat16 weights in the matmuls, float32 gradient reduction
    assert r0["fsdp_bf16"] == pytest.approx(dp, rel=2e-2) and r0["fsdp_bf16"] != dp

    # 1 rank -> 2 ranks (EP + FSDP): step 3 averages the next two batches' losses under the 1-rank weights
    assert r0["from1_step"] == 2
    assert r0["from1"][0] == pytest.approx(sum(one_next) / 2, rel=1e-5)
    # 2 ranks (EP + FSDP) -> 1 rank: step 3 is data rank 0's batch under the 2-rank weights
    to1 = _trainer(None, tmp_path / "to1", 4, replace=MOE,
                   checkpoint={"stop_after": 3, "resume": str(tmp_path / "r" / "checkpoints" / "step_00000002")})
    assert to1.step == 2
    assert to1.fit()[0].loss == pytest.approx(r0["step3_batch0"], rel=1e-5)
    # 1 -> 2 -> 1 ranks (saved again by the 2 ranks right after loading): weights, optimizer state
    # and RNG come back bit-exact, so the 1-rank run goes on exactly as if never interrupted
    back = _trainer(None, tmp_path / "back", 4, replace=MOE,
                    checkpoint={"resume": str(tmp_path / "from1" / "checkpoints" / "step_00000002")})
    full = [r.loss for r in _trainer(None, tmp_path / "full", 4, replace=MOE).fit()]
    assert one_losses + [r.loss for r in back.fit()] == full

    # tp 2 -> 1 rank: the DTensor shards load as whole tensors; step 3 is the same batch under the same weights
    tp1 = _trainer(None, tmp_path / "tp1", 4,
                   checkpoint={"stop_after": 3, "resume": str(tmp_path / "tp" / "checkpoints" / "step_00000002")})
    assert tp1.step == 2 and tp1.fit()[0].loss == pytest.approx(r0["tp_step3"], rel=1e-5)

    trace0 = json.loads((tmp_path / "ep" / "traces" / "step2.rank1.json").read_text())
    engines = {ev["args"]["name"].split(".")[0] for ev in trace0["traceEvents"] if ev.get("name") == "thread_name"}
    assert {"host", "cube", "vector", "comm"} <= engines  # MegaMoE graph tasks sit beside the module spans
    names = {ev.get("name", "") for ev in trace0["traceEvents"]}
    assert any(n.startswith("model.layers.1.mlp/") for n in names)       # MegaMoE tasks (EP: with comm)
    assert any(n.startswith("model.layers.1.mlp.gate/") for n in names)  # MegaGate tasks, router under FSDP
