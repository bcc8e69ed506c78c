"""Training-step time of a transformers MoE model, as is and with megaloom modules swapped in.

One JSON line per (model, variant): median step seconds over ``--steps`` steps after one
warm-up step, tokens/s, and the ratio to the unmodified model in the same run.

    python benchmarks/train_step.py [--steps 5] [--hidden 128] [--seq 64] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from megaloom.config import validate
from megaloom.trainer import Trainer

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
            recs = Trainer(validate(raw)).fit()
        t = statistics.median(r.time_s for r in recs[1:])
        base = base or t
        print(json.dumps({"model": f"qwen3_moe h{a.hidden} e8 k2", "variant": name, "tokens": recs[-1].tokens,
                          "step_s": round(t, 4), "tokens_per_s": round(recs[-1].tokens / t, 1),
                          "vs_transformers": round(t / base, 2), "final_loss": round(recs[-1].loss, 4)}), flush=True)


if __name__ == "__main__":
    main()
