"""Training-step time of a transformers MoE model, as is and with megaloom modules swapped in.

One JSON line per (model, variant): median wall and process-CPU seconds per step over
``--steps`` steps after one warm-up step, and the ratios to the unmodified model in the
same run (CPU time is the steadier figure on a shared machine).

    python benchmarks/train_step.py [--steps 5] [--hidden 128] [--seq 64] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from megaloom.train.config import validate
from megaloom.train.trainer import Trainer

VARIANTS = {
    "transformers": {},
    "mega_moe": {"replace": {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe"}]}},
    "mega_moe+mega_gate": {"replace": {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe",
                                                   "options": {"gate": "mega_gate"}}]}},
    "mxfp8_linear": {"low_precision": {"format": "mxfp8"}},
}


def qwen3(hidden: int) -> dict:
    return {"kind": "qwen3_moe", "config": dict(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    base = None
    for name, extra in VARIANTS.items():
        with tempfile.TemporaryDirectory() as out:
            raw = {"run": {"out_dir": out, "progress": False}, "model": qwen3(a.hidden),
                   "data": {"seq_len": a.seq, "batch_size": a.batch}, "schedule": {"steps": a.steps + 1}, **extra}
            trainer = Trainer(validate(raw))
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


if __name__ == "__main__":
    main()
