"""``megaloom export CONFIG --hf DIR [--checkpoint STEP] [--section.key=value ...]``: a training checkpoint
as a Hugging Face ``save_pretrained`` directory (with the config's ``data.tokenizer``, if it names one)."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a training checkpoint's model as a Hugging Face save_pretrained directory",
        description="Build CONFIG's transformers model, load the weights of a training checkpoint (megaloom's, or "
                    "torch DCP in the get_state_dict layout) and save_pretrained it into DIR, which "
                    "AutoModelForCausalLM.from_pretrained then loads. Overrides --section.key=value as for train.")
    p.add_argument("config", help="the training YAML config")
    p.add_argument("--hf", metavar="DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--checkpoint", metavar="PATH", help="a step folder or checkpoint folder (default: the latest "
                   "in the config's checkpoint.dir)")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value, e.g. --run.out_dir=runs/a")
    p.set_defaults(func=run)


def _flags(args: argparse.Namespace) -> list[str]:
    """Take --hf / --checkpoint given after CONFIG out of the overrides (REMAINDER keeps them)."""
    rest, it = [], iter(args.overrides)
    for item in it:
        name, eq, value = item.partition("=")
        if name in ("--hf", "--checkpoint"):
            setattr(args, name[2:], value if eq else next(it, None))
        else:
            rest.append(item)
    return rest


def run(args: argparse.Namespace) -> int:
    from megaloom.runtime.errors import ConfigError
    from megaloom.train.config import load_config
    from megaloom.train.data import load_tokenizer
    from megaloom.train.interop import export_hf, load_model

    overrides = _flags(args)
    if not args.hf:
        raise ConfigError("export: --hf DIR is required")
    cfg = load_config(args.config, overrides)
    export_hf(load_model(cfg, args.checkpoint), args.hf, log=lambda m: print(m, file=sys.stderr),
              tokenizer=load_tokenizer(cfg["data"]["tokenizer"]))
    return 0
