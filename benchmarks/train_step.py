"""Training-step time of a transformers MoE model: megaloom modules swapped in (one process), and the
trainer's parallel layouts against torch's FSDP2 on the same model (2 gloo ranks).

    python benchmarks/train_step.py [--rounds 5] [--steps 3] [--hidden 128] [--seq 64] [--batch 8]
    python benchmarks/train_step.py --parallel [--rounds 5] [--steps 3] [--layouts fsdp,mega_moe+fsdp]
    python benchmarks/train_step.py --parity [--parity-steps 20]

Every variant is built once and takes a warm-up step; then ``--rounds`` rounds run ``--steps``
steps of each variant in turn, so load on the machine hits all alike. Figures: median wall and
process-CPU seconds per step and their range, and the ratios of the medians to the baseline
(CPU time is the steadier figure on a shared machine; ``throughput_vs_*`` is baseline wall over
the variant's wall).

Default: one process at torch's default thread count, one line per swap variant; baseline the
unmodified model.

``--parallel``: 2 gloo ranks (one torch thread each), rank 0's figures; baselines ``fsdp2`` and
``fsdp2+muon``, a plain torch loop (``fully_shard`` per decoder layer and on the root, the trainer's
optimizer: AdamW, or Muon for the matrices and AdamW for the rest; gradient clipping, the loss
all-reduced) on the same model and batches; ``+muon`` variants are compared with ``fsdp2+muon``.

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
    "fsdp+muon": {"parallel": {"fsdp": True}, "optimizer": {"name": "muon"}},
    "mega_moe+fsdp+muon": {"parallel": {"fsdp": True}, "optimizer": {"name": "muon"}, **MOE},
}


def qwen3(hidden: int) -> dict:
    return {"kind": "qwen3_moe", "config": dict(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)}


def raw(a, out: str, steps: int, **sections) -> dict:
    return {"run": {"out_dir": out, "progress": False}, "model": qwen3(a.hidden),
            "data": {"seq_len": a.seq, "batch_size": a.batch}, "schedule": {"steps": steps}, **sections}


def interleaved(steppers: dict, rounds: int, steps: int) -> tuple[dict, dict, dict]:
    """Wall and process-CPU seconds per step, and the last loss, of each ``name: step() -> (wall s, loss)``:
    one warm-up step each, then ``rounds`` rounds of ``steps`` steps of each in turn."""
    wall: dict[str, list[float]] = {name: [] for name in steppers}
    cpu: dict[str, list[float]] = {name: [] for name in steppers}
    loss: dict[str, float] = {}
    for name, step in steppers.items():
        step()
    for _ in range(rounds):
        for name, step in steppers.items():
            for _ in range(steps):
                c0 = time.process_time()
                t, loss[name] = step()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(t)
    return wall, cpu, loss


def figures(name: str, wall: list[float], cpu: list[float], base: tuple[str, list[float], list[float]]) -> dict:
    """The JSON fields of one variant against the baseline ``(name, wall, cpu)``."""
    t, c, bt, bc = (statistics.median(x) for x in (wall, cpu, base[1], base[2]))
    return {"variant": name, "step_s": round(t, 4), "range_s": [round(min(wall), 4), round(max(wall), 4)],
            "cpu_s": round(c, 4), "cpu_range_s": [round(min(cpu), 4), round(max(cpu), 4)], "steps": len(wall),
            f"throughput_vs_{base[0]}": round(bt / t, 3), f"cpu_vs_{base[0]}": round(c / bc, 3)}


def swaps(a) -> None:
    out = tempfile.mkdtemp()
    trainers = {name: Trainer(validate(raw(a, f"{out}/{name}", 10_000, **extra))) for name, extra in VARIANTS.items()}

    def stepper(trainer):
        def step():
            rec = trainer.train_step()
            return rec.time_s, rec.loss
        return step
    wall, cpu, loss = interleaved({n: stepper(t) for n, t in trainers.items()}, a.rounds, a.steps)
    base = ("transformers", wall["transformers"], cpu["transformers"])
    for name in trainers:
        print(json.dumps({"model": f"qwen3_moe h{a.hidden} e8 k2 seq{a.seq} b{a.batch}", "torch_threads":
                          torch.get_num_threads(), **figures(name, wall[name], cpu[name], base),
                          "final_loss": round(loss[name], 5)}), flush=True)


class Fsdp2Loop:
    """The baseline: torch FSDP2 on the same model, batches, loss and optimizer as the trainer."""

    def __init__(self, trainer: Trainer):
        from torch.distributed.fsdp import fully_shard

        from megaloom.models.hf_moe import build_model
        from megaloom.train.optim import make_optimizer

        self.cfg, self.data, self.comm = trainer.cfg, trainer.data, trainer.comm
        self.model = build_model(self.cfg["model"], self.cfg["run"]["seed"])
        mesh = trainer.mesh.fsdp_mesh
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        self.opt = make_optimizer(self.model, self.cfg["optimizer"])
        self.step = 0

    def train_step(self) -> tuple[float, float]:
        import torch.distributed as dist

        from megaloom.train.trainer import causal_lm_loss

        t0 = time.perf_counter()
        loss = causal_lm_loss(self.model, self.data.batch(self.step, self.comm.rank, self.comm.world_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["optimizer"]["grad_clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        self.step += 1
        return time.perf_counter() - t0, loss.item() / self.comm.world_size


def parallel_world(comm, a: dict, out: str) -> dict:
    ns = argparse.Namespace(**a)
    layouts = {name: LAYOUTS[name] for name in ns.layouts.split(",")}
    trainers = {name: Trainer(validate(raw(ns, f"{out}/{name}", 10_000, **sections)), comm=comm)
                for name, sections in layouts.items()}
    steppers, comm_s = {}, {name: [] for name in trainers}
    for opt in ("adamw", "muon"):
        if any(_optimizer(name) == opt for name in trainers):
            ref = Trainer(validate(raw(ns, f"{out}/fsdp2_{opt}", 10_000, **LAYOUTS[BASELINES[opt]])), comm=comm)
            steppers[BASELINES[opt].replace("fsdp", "fsdp2", 1)] = Fsdp2Loop(ref).train_step

    def stepper(name: str, trainer: Trainer):
        def step():
            rec = trainer.train_step()
            comm_s[name].append(rec.comm_s)
            return rec.time_s, rec.loss
        return step
    steppers.update({name: stepper(name, t) for name, t in trainers.items()})
    wall, cpu, loss = interleaved(steppers, ns.rounds, ns.steps)
    return {"wall": wall, "cpu": cpu, "loss": loss, "comm_s": {k: v[1:] for k, v in comm_s.items()}}


def _optimizer(layout: str) -> str:
    return LAYOUTS[layout].get("optimizer", {}).get("name", "adamw")


BASELINES = {"adamw": "fsdp", "muon": "fsdp+muon"}  # the trainer layout whose model and optimizer fsdp2 copies


def parallel(a) -> None:
    from megaloom.comm.spawn import run_world

    with tempfile.TemporaryDirectory() as out:
        res = run_world(parallel_world, 2, vars(a), out, timeout=3000, comm_timeout=300)[0]
    for name, ts in res["wall"].items():
        base = "fsdp2+muon" if "muon" in name else "fsdp2"
        line = {"model": f"qwen3_moe h{a.hidden} e8 k2 seq{a.seq} b{a.batch}", "ranks": 2,
                **figures(name, ts, res["cpu"][name], (base, res["wall"][base], res["cpu"][base])),
                "final_loss": round(res["loss"][name], 5)}
        if res["comm_s"].get(name):
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
    ap.add_argument("--steps", type=int, default=3, help="steps of each variant per round")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--parallel", action="store_true", help="trainer layouts vs torch FSDP2 on 2 gloo ranks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="--parallel: the trainer layouts to time")
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
