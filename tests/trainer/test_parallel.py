"""Every parallel layout trains like one process: (tp, cp, ep, dp, fsdp, recompute) on 2 and 4 gloo
ranks against the single-process run that accumulates the same global batch."""
import re

import pytest

from megaloom.comm.spawn import run_world
from megaloom.runtime.errors import ConfigError
from megaloom.train.trainer import Trainer

from .tiny import tiny_config, write_corpus

STEPS = 4
MOE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe"}]}
MOE_GATE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}
UNEVEN = {"config": {"vocab_size": 129}}  # embedding / lm_head rows split unevenly
QWEN_KV4 = {"config": {"vocab_size": 129, "num_key_value_heads": 4}}  # 4 KV heads: tp 4 splits them

# name -> (model family, sections); dp is what tp and cp leave of the world
TWO = {
    "fsdp+prefetch": ("qwen3_moe", {"parallel": {"fsdp": True, "prefetch": 1}, "model": UNEVEN}),
    "tp2": ("qwen3_moe", {"parallel": {"tp_size": 2}, "model": UNEVEN}),
    "cp2+fsdp": ("qwen3_moe", {"parallel": {"cp_size": 2, "fsdp": True}, "model": UNEVEN}),
    "ep2+fsdp+recompute": ("qwen3_moe", {"parallel": {"ep_size": 2, "fsdp": True, "recompute": "full"},
                                         "replace": MOE, "model": UNEVEN}),
    "tp2+recompute_mlp": ("qwen3_moe", {"parallel": {"tp_size": 2, "recompute": ["model.layers.*.mlp"]},
                                        "model": UNEVEN}),
    "ds_tp2+fsdp": ("deepseek_v3", {"parallel": {"tp_size": 2, "fsdp": True}}),
    "ds_cp2+ep2": ("deepseek_v3", {"parallel": {"cp_size": 2, "ep_size": 2}, "replace": MOE}),
    "ep2+aux_loss": ("qwen3_moe", {"parallel": {"ep_size": 2}, "replace": MOE_GATE, "model": UNEVEN,
                                   "moe": {"balance": "aux_loss", "aux_loss_coef": 0.5}}),
    "ds_ep2+bias": ("deepseek_v3", {"parallel": {"ep_size": 2}, "replace": MOE_GATE,
                                    "moe": {"balance": "bias", "bias_rate": 0.05}}),
    "dp2+accum2": ("qwen3_moe", {"optimizer": {"grad_accum_steps": 2}, "model": UNEVEN}),
    "fsdp+muon": ("qwen3_moe", {"parallel": {"fsdp": True}, "optimizer": {"name": "muon", "lr": 1e-2},
                                "model": {"config": {"vocab_size": 129, "num_hidden_layers": 1, "num_experts": 4}}}),
}
FOUR = {
    "dp2xtp2+fsdp": ("qwen3_moe", {"parallel": {"tp_size": 2, "fsdp": True, "reshard_after_forward": False},
                                   "model": UNEVEN}),
    "dp2xcp2+ep2": ("qwen3_moe", {"parallel": {"cp_size": 2, "ep_size": 2}, "replace": MOE, "model": UNEVEN}),
    "ep2xdp2+fsdp": ("qwen3_moe", {"parallel": {"ep_size": 2, "fsdp": True}, "replace": MOE, "model": UNEVEN}),
    "cp2xtp2+recompute": ("qwen3_moe", {"parallel": {"cp_size": 2, "tp_size": 2, "recompute": "full"}, "model": UNEVEN}),
    "tp4": ("qwen3_moe", {"parallel": {"tp_size": 4}, "model": QWEN_KV4}),
    "ds_ep4+fsdp": ("deepseek_v3", {"parallel": {"ep_size": 4, "fsdp": True}, "replace": MOE}),
}


def _losses(comm, out_dir, kind, sections):
    return [r.loss for r in Trainer(tiny_config(out_dir, kind, steps=STEPS, **sections), comm=comm).fit()]


def runs(comm, tmp, cases):
    return {name: _losses(comm, f"{tmp}/{name}", kind, sections) for name, (kind, sections) in cases.items()}


_REFERENCES: dict[str, list[float]] = {}


def reference(tmp, kind, sections, world):
    """One process reading, per step, the micro-batches of every data rank of ``world`` (cached: layouts
    with the same data ranks share it)."""
    par = sections.get("parallel", {})
    dp = world // (par.get("tp_size", 1) * par.get("cp_size", 1))
    single = {k: v for k, v in sections.items() if k != "parallel"}
    single["optimizer"] = {**single.get("optimizer", {}),
                           "grad_accum_steps": dp * single.get("optimizer", {}).get("grad_accum_steps", 1)}
    key = repr((kind, sorted(single.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = [r.loss for r in Trainer(tiny_config(tmp, kind, steps=STEPS, **single)).fit()]
    return _REFERENCES[key]


def _check(tmp_path, cases, world):
    got = run_world(runs, world, str(tmp_path), cases, timeout=400, comm_timeout=60)
    for rank in got[1:]:
        assert rank == got[0]  # every rank reports the same (all-reduced) loss
    for name, (kind, sections) in cases.items():
        want = reference(tmp_path / f"ref_{name}", kind, sections, world)
        assert got[0][name] == pytest.approx(want, rel=1e-5), name


@pytest.mark.dist
def test_two_ranks_match_one_process(tmp_path):
    """... and context parallelism keeps packed documents apart (a jsonl corpus, BPE tokens)."""
    path, tokenizer = write_corpus(tmp_path)
    packed = {"data": {"source": "files", "path": path, "tokenizer": tokenizer}, "model": UNEVEN}
    _check(tmp_path, {**TWO, "cp2_packed": ("qwen3_moe", {"parallel": {"cp_size": 2}, **packed})}, 2)


@pytest.mark.dist
@pytest.mark.slow
def test_four_ranks_match_one_process(tmp_path):
    _check(tmp_path, FOUR, 4)


def mesh_errors(comm, tmp, cases):
    out = []
    for i, (sections, _) in enumerate(cases):
        try:
            Trainer(tiny_config(f"{tmp}/{i}", steps=1, **sections), comm=comm)
            out.append("")
        except ConfigError as e:
            out.append(str(e))
    comm.barrier()  # rank 0 hosts the store the others may still need to build their last process groups
    return out


MESH_ERRORS = [
    ({"parallel": {"tp_size": 3}}, "parallel.tp_size=3 x parallel.cp_size=1 = 3 ranks per data-parallel replica "
                                   "does not divide the world size 2"),
    ({"parallel": {"tp_size": 2, "cp_size": 2}}, "parallel.tp_size=2 x parallel.cp_size=2 = 4 ranks"),
    ({"parallel": {"ep_size": 2, "tp_size": 2}, "replace": MOE}, "parallel.ep_size=2 does not divide the 1 data x context ranks"),
    ({"parallel": {"ep_size": 2}}, "parallel.ep_size: 2 needs MoE blocks swapped for MegaMoE"),
    ({"parallel": {"recompute": ["model.layers.*.mlpx"]}}, "parallel.recompute: 'model.layers.*.mlpx' matches no module"),
    ({"parallel": {"cp_size": 2}, "model": {"config": {"num_experts": 3}}, "replace": MOE},
     ""),  # possible: MegaMoE without expert parallelism under CP
]


@pytest.mark.dist
def test_impossible_meshes_name_their_keys(tmp_path):
    r0, r1 = run_world(mesh_errors, 2, str(tmp_path), MESH_ERRORS, timeout=120)
    assert r0 == r1
    for got, (_, want) in zip(r0, MESH_ERRORS):
        assert (want in got) if want else got == "", (want, got)


def test_config_only_mesh_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.cp_size: 3 does not divide data.seq_len=16"):
        tiny_config(tmp_path, parallel={"cp_size": 3})
    with pytest.raises(ConfigError, match=r"parallel.tp_size: tensor parallelism splits nn.Linear"):
        tiny_config(tmp_path, parallel={"tp_size": 2}, low_precision={"format": "mxfp8"})
    with pytest.raises(ConfigError, match=r"parallel.recompute: got 'some', expected 'none', 'full'"):
        tiny_config(tmp_path, parallel={"recompute": "some"})
    with pytest.raises(ConfigError, match=r"optimizer.name: got 'lamb', expected one of 'adamw', 'sgd', 'muon'"):
        tiny_config(tmp_path, optimizer={"name": "lamb"})
    with pytest.raises(ConfigError, match=r"parallel.tp_size=4 does not divide model.config.num_key_value_heads=2"):
        from megaloom.models.hf_moe import build_model
        from megaloom.train.parallel.tensor import plan
        plan(build_model(tiny_config(tmp_path)["model"], 0), 4)


def test_recompute_runs_forward_again_and_logs_what_it_saves(tmp_path):
    logs = []
    trainer = Trainer(tiny_config(tmp_path, steps=1, parallel={"recompute": ["model.layers.*.mlp"]}), log=logs.append)
    line = next(m for m in logs if m.startswith("recompute 2 module(s) (model.layers.0.mlp, ...)"))
    kept, less, saved = map(float, re.search(r"micro-batch ([\d.]+) MiB -> ([\d.]+) MiB \(([\d.]+) MiB saved", line).groups())
    assert 0 < less < kept and saved == pytest.approx(kept - less, abs=0.02), line
    calls = []
    trainer.model.model.layers[0].mlp.gate.register_forward_hook(lambda *a: calls.append(1))
    trainer.train_step()
    assert len(calls) == 2  # forward, then again in backward
    with pytest.raises(ConfigError, match="model.layers.0.mlp lies inside model.layers.0, which is recomputed already"):
        Trainer(tiny_config(tmp_path / "b", steps=1, parallel={"recompute": ["model.layers.0", "model.layers.0.mlp"]}))
