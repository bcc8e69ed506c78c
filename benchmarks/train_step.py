"""Training-step time of a transformers MoE model: megaloom modules swapped in (one process), and the
trainer's parallel layouts against torch's FSDP2 on the same model (2 gloo ranks).

    python benchmarks/train_step.py [--steps 5] [--hidden 128] [--seq 64] [--batch 8]
    python benchmarks/train_step.py --parallel [--rounds 5] [--steps 3]
    python benchmarks/train_step.py --parity [--parity-steps 20]

Default: one JSON line per swap variant, median wall and process-CPU seconds per step over
``--steps`` steps after a warm-up step, and the ratios to the unmodified model (CPU time is the
steadier figure on a shared machine).

``--parallel``: on 2 gloo ranks, every variant is built once, then ``--rounds`` rounds run
``--steps`` steps of each variant in turn (so load on the machine hits all alike); one line
per variant with the median wall and process-CPU time per step of rank 0 and their ratios to
``fsdp2``, a plain torch loop
(``fully_shard`` per decoder layer and on the root, AdamW, gradient clipping, the loss
all-reduced) on the same model and batches.

``--parity``: every parallel layout trains ``--parity-steps`` steps on 2 ranks; one line each
with the largest relative difference of its losses from one process reading the same batches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from megaloom.train.config import validate
from megaloom.train.trainer import Trainer

VARIANTS = {
    "transformers": {},
    "mega_moe": {"replace": {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe"}]}},
    "mega_moe+mega_gate": {"replace": {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe",
                                                   "options": {"gate": "mega_gate"}}]}},
    "mxfp8_linear": {"low_precision": {"format": "mxfp8"}},
}
MOE = {"replace": {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe"}]}}
LAYOUTS = {  # trainer layouts on 2 ranks (dp is what tp and cp leave)
    "dp": {},
    "fsdp": {"parallel": {"fsdp": True}},
    "tp2": {"parallel": {"tp_size": 2}},
    "cp2+fsdp": {"parallel": {"cp_size": 2, "fsdp": True}},
    "mega_moe+fsdp": {"parallel": {"fsdp": True}, **MOE},  # the experts EP runs, without EP
    "ep2+fsdp": {"parallel": {"ep_size": 2, "fsdp": True}, **MOE},
    "fsdp+recompute": {"parallel": {"fsdp": True, "recompute": "full"}},
}


def qwen3(hidden: int) -> dict:
    return {"kind": "qwen3_moe", "config": dict(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)}


def raw(a, out: str, steps: int, **sections) -> dict:
    return {"run": {"out_dir": out, "progress": False}, "model": qwen3(a.hidden),
            "data": {"seq_len": a.seq, "batch_size": a.batch}, "schedule": {"steps": steps}, **sections}


def swaps(a) -> None:
    base = None
    for name, extra in VARIANTS.items():
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(validate(raw(a, out, a.steps + 1, **extra)))
            recs, cpu = [], []
            for _ in range(a.steps + 1):
                c0 = time.process_time()
                recs.append(trainer.train_step())
                cpu.append(time.process_time() - c0)
        t, c = statistics.median(r.time_s for r in recs[1:]), statistics.median(cpu[1:])
        base = base or (t, c)
        print(json.dumps({"model": f"qwen3_moe h{a.hidden} e8 k2 seq{a.seq} b{a.batch}", "variant": name,
                          "step_s": round(t, 4), "cpu_s": round(c, 4), "wall_vs_transformers": round(t / base[0], 2),
                          "cpu_vs_transformers": round(c / base[1], 2), "final_loss": round(recs[-1].loss, 5)}),
              flush=True)


class Fsdp2Loop:
    """The baseline: torch FSDP2 on the same model, batches, loss and optimizer as the trainer."""

    def __init__(self, trainer: Trainer):
        from torch.distributed.fsdp import fully_shard

        from megaloom.models.hf_moe import build_model

        self.cfg, self.data, self.comm = trainer.cfg, trainer.data, trainer.comm
        self.model = build_model(self.cfg["model"], self.cfg["run"]["seed"])
        mesh = trainer.mesh.fsdp_mesh
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        opt = self.cfg["optimizer"]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]),
                                     eps=opt["eps"], weight_decay=opt["weight_decay"], foreach=False)
        self.step = 0

    def train_step(self) -> float:
        import torch.distributed as dist

        from megaloom.train.trainer import causal_lm_loss

        t0 = time.perf_counter()
        loss = causal_lm_loss(self.model, self.data.batch(self.step, self.comm.rank, self.comm.world_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["optimizer"]["grad_clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())
        self.step += 1
        return time.perf_counter() - t0


def parallel_world(comm, a: dict, out: str) -> dict:
    ns = argparse.Namespace(**a)
    trainers = {name: Trainer(validate(raw(ns, f"{out}/{name}", 10_000, **sections)), comm=comm)
                for name, sections in LAYOUTS.items()}
    baseline = Fsdp2Loop(trainers["fsdp"])
    names = ["fsdp2", *trainers]
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    comm_s: dict[str, list[float]] = {name: [] for name in trainers}

    def one(name: str) -> None:
        c0 = time.process_time()
        if name == "fsdp2":
            times[name].append(baseline.train_step())
        else:
            rec = trainers[name].train_step()
            times[name].append(rec.time_s)
            comm_s[name].append(rec.comm_s)
        cpu[name].append(time.process_time() - c0)

    for name in names:  # warm-up
        one(name)
    for series in (times, cpu, comm_s):
        for v in series.values():
            v.clear()
    for _ in range(ns.rounds):
        for name in names:
            for _ in range(ns.steps):
                one(name)
    return {"times": times, "cpu": cpu, "comm_s": comm_s}


def parallel(a) -> None:
    from megaloom.comm.spawn import run_world

    with tempfile.TemporaryDirectory() as out:
        res = run_world(parallel_world, 2, vars(a), out, timeout=3000, comm_timeout=300)[0]
    base, base_cpu = statistics.median(res["times"]["fsdp2"]), statistics.median(res["cpu"]["fsdp2"])
    for name, ts in res["times"].items():
        t, c = statistics.median(ts), statistics.median(res["cpu"][name])
        line = {"model": f"qwen3_moe h{a.hidden} e8 k2 seq{a.seq} b{a.batch}", "ranks": 2, "variant": name,
                "step_s": round(t, 4), "wall_vs_fsdp2": round(t / base, 3), "cpu_s": round(c, 4),
                "cpu_vs_fsdp2": round(c / base_cpu, 3), "steps": len(ts), "range_s": [round(min(ts), 4), round(max(ts), 4)]}
        if name in res["comm_s"]:
            line["comm_s"] = round(statistics.median(res["comm_s"][name]), 4)
        print(json.dumps(line), flush=True)


PARITY = {  # layout -> sections (2 ranks)
    "fsdp": {"parallel": {"fsdp": True}},
    "tp2": {"parallel": {"tp_size": 2}},
    "cp2": {"parallel": {"cp_size": 2}},
    "tp2+fsdp+recompute": {"parallel": {"tp_size": 2, "fsdp": True, "recompute": "full"}},
    "cp2+fsdp": {"parallel": {"cp_size": 2, "fsdp": True}},
    "ep2+fsdp": {"parallel": {"ep_size": 2, "fsdp": True}, **MOE},
    "cp2+ep2+recompute": {"parallel": {"cp_size": 2, "ep_size": 2, "recompute": ["model.layers.*.mlp"]}, **MOE},
}


def parity_world(comm, a: dict, out: str) -> dict:
    ns = argparse.Namespace(**a)
    return {name: [r.loss for r in Trainer(validate(raw(ns, f"{out}/{name}", ns.parity_steps, **sections)),
                                           comm=comm).fit()]
            for name, sections in PARITY.items()}


def parity(a) -> None:
    from megaloom.comm.spawn import run_world

    with tempfile.TemporaryDirectory() as out:
        got = run_world(parity_world, 2, vars(a), out, timeout=3000, comm_timeout=300)[0]
        for name, sections in PARITY.items():
            par = sections.get("parallel", {})
            dp = 2 // (par.get("tp_size", 1) * par.get("cp_size", 1))
            single = {k: v for k, v in sections.items() if k != "parallel"}
            want = [r.loss for r in Trainer(validate(raw(a, f"{out}/ref_{name}", a.parity_steps,
                                                         optimizer={"grad_accum_steps": dp}, **single))).fit()]
            err = max(abs(g - w) / abs(w) for g, w in zip(got[name], want))
            print(json.dumps({"model": f"qwen3_moe h{a.hidden} e8 k2 seq{a.seq} b{a.batch}", "ranks": 2,
                              "layout": name, "steps": a.parity_steps, "max_rel_diff_vs_1_process": float(f"{err:.3g}"),
                              "first_loss": round(want[0], 4), "last_loss": round(want[-1], 4)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--parallel", action="store_true", help="trainer layouts vs torch FSDP2 on 2 gloo ranks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parity", action="store_true", help="losses of every layout vs one process")
    ap.add_argument("--parity-steps", type=int, default=20)
    a = ap.parse_args()
    if a.parallel:
        parallel(a)
    elif a.parity:
        parity(a)
    else:
        swaps(a)


if __name__ == "__main__":
    main()
