"""``megaloom train config.yaml [--section.key=value ...]``: train a model as the YAML config says."""
from __future__ import annotations

import argparse
import os
import sys

from megaloom.train.config import SCHEMA


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a transformers model from a YAML config (megaloom modules swapped in by config)",
        description="Train as CONFIG says. Overrides --section.key=value (value as YAML) come after it; "
                    f"sections: {', '.join(SCHEMA)}. Under torchrun every rank runs this command.")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value, e.g. --optimizer.lr=3e-4")
    p.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    p.add_argument("--plot", action="store_true",
                   help="after training, write <run.out_dir>/metrics.png: loss and tokens/s per step (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.train.config import load_config

    flags = {"--print-config", "--plot"}  # REMAINDER also takes flags written after the config
    cfg = load_config(args.config, [o for o in args.overrides if o not in flags])
    if args.print_config or "--print-config" in args.overrides:
        print(cfg.to_yaml(), end="")
        return 0
    plot = args.plot or "--plot" in args.overrides
    if plot:
        from megaloom.runtime.plot import _pyplot
        _pyplot()  # no matplotlib: say so before training, not after
    from megaloom.train.trainer import Trainer

    trainer = Trainer(cfg, log=lambda msg: print(f"[rank {os.environ.get('RANK', '0')}] {msg}", file=sys.stderr))
    records = trainer.fit()
    if trainer.rank == 0 and records:
        first, last = records[0], records[-1]
        metrics = os.path.join(cfg["run"]["out_dir"], "metrics.jsonl")
        print(f"trained steps {first.step}..{last.step}: loss {first.loss:.4f} -> {last.loss:.4f}; "
              f"metrics in {metrics}")
        if plot:
            from megaloom.train.plot import plot_metrics
            png = os.path.join(cfg["run"]["out_dir"], "metrics.png")
            plot_metrics(metrics, png)
            print(f"plot of loss and throughput: {png}")
    return 0
