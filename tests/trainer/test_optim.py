"""Muon: torch's update on plain matrices, the same update on sharded ones (DTensor shards over 2 gloo
ranks), expert stacks matrix by matrix; the trainer's Muon + AdamW split, accumulation and resume."""
import pytest
import torch

from megaloom.comm.spawn import run_world
from megaloom.train.optim import Chained, Muon, make_optimizer, muon_params
from megaloom.train.trainer import Trainer

from .tiny import tiny_config

SHAPES = [(7, 5), (5, 9), (3, 4, 6)]  # rows uneven over 2 ranks; a stack of 3 expert matrices


def _params_and_grads(steps: int):
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _run(opt_params, grads, opt, set_grad):
    for step in grads:
        for p, gr in zip(opt_params, step):
            set_grad(p, gr)
        opt.step()


def test_plain_muon_is_torch_muon():
    params, grads = _params_and_grads(3)
    ours = [torch.nn.Parameter(p.clone()) for p in params]
    theirs = [torch.nn.Parameter(p[None].clone() if p.ndim == 2 else p.clone()) for p in params]
    opt = Muon(ours, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    _run(ours, grads, opt, lambda p, g: setattr(p, "grad", g.clone()))
    ref = [torch.nn.Parameter(m.clone()) for t in theirs for m in t]  # every matrix on its own
    torch_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, g in zip(ref, [m for gr in step for m in (gr[None] if gr.ndim == 2 else gr)]):
            p.grad = g.clone()
        torch_opt.step()
    want = iter(ref)
    for p in ours:
        for m in (p[None] if p.ndim == 2 else p):
            assert torch.equal(m, next(want))  # bit for bit, expert stacks matrix by matrix


def sharded_muon(comm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (comm.world_size,))
    params, grads = _params_and_grads(3)
    out = {}
    # dim 0 (FSDP2, column parallel), dim 1 (row parallel); a stack split by experts needs no gather
    for dim in (0, 1):
        shard = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(dim)])) for p in params]
        opt = Muon(shard, lr=0.02, weight_decay=0.1)
        _run(shard, grads, opt, lambda p, g: setattr(p, "grad", distribute_tensor(g, mesh, p.placements)))
        out[f"dim{dim}"] = [p.full_tensor().flatten().tolist() for p in shard]
    return out


@pytest.mark.dist
def test_sharded_muon_equals_unsharded():
    params, grads = _params_and_grads(3)
    plain = [torch.nn.Parameter(p.clone()) for p in params]
    _run(plain, grads, Muon(plain, lr=0.02, weight_decay=0.1), lambda p, g: setattr(p, "grad", g.clone()))
    r0, r1 = run_world(sharded_muon, 2, timeout=120)
    assert r0 == r1
    for dim, got in r0.items():
        for p, g in zip(plain, got):
            torch.testing.assert_close(torch.tensor(g).view_as(p), p.detach(), rtol=0, atol=0, msg=dim)


def test_muon_takes_matrices_adamw_the_rest(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, steps=1, optimizer={"name": "muon"}))
    opt, model = trainer.optimizer, trainer.model
    assert isinstance(opt, Chained) and isinstance(opt.optimizers[0], Muon)
    names = {n for n, p in model.named_parameters() if id(p) in muon_params(model)}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert not any(n.endswith("norm.weight") for n in names)
    assert make_optimizer(model, {**trainer.cfg["optimizer"], "name": "adamw"}).__class__ is torch.optim.AdamW


SMALL = {"config": {"num_hidden_layers": 1, "num_experts": 4}}  # Newton-Schulz in bf16 is slow on CPUs


def test_muon_trains_and_resumes(tmp_path):
    opt = {"name": "muon", "lr": 2e-2}
    full = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=4, optimizer=opt, model=SMALL,
                                                data={"batch_size": 8})).fit()]
    assert full[-1] < full[0] - 0.2, full
    part = tiny_config(tmp_path / "b", steps=2, optimizer=opt, model=SMALL, checkpoint={"stop_after": 1})
    first = [r.loss for r in Trainer(part).fit()]
    rest = [r.loss for r in Trainer(tiny_config(tmp_path / "b", steps=2, optimizer=opt, model=SMALL,
                                                checkpoint={"resume": True})).fit()]
    again = [r.loss for r in Trainer(tiny_config(tmp_path / "c", steps=2, optimizer=opt, model=SMALL)).fit()]
    assert first + rest == again  # Muon's momentum comes back from the checkpoint bit for bit
