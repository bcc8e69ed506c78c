"""Training configuration: YAML sections, a declarative schema, validation and overrides.

A config file has the sections of :data:`SCHEMA`; every key is optional (defaults below).
Command-line overrides ``--section.key=value`` (value parsed as YAML) are applied before
validation, so they are checked like the file. Every problem found is collected and
raised together as one :class:`ConfigError` naming the key and the allowed values.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import load_yaml, parse_yaml


@dataclass(slots=True, frozen=True)
class Key:
    """One config key: its default, accepted Python types, and optional extra check."""

    default: Any
    types: tuple[type, ...]
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None  # returns a problem description or None


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
               list: "a list", dict: "a mapping", type(None): "null"}


def _finite_numbers(v: Any, where: str = "") -> str | None:
    """The first non-finite number inside a (nested) value, as a problem (naming where it sits), or None."""
    if isinstance(v, float) and not math.isfinite(v):
        return f"{where} is {v!r}, numbers must be finite" if where else "numbers must be finite"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    return next(filter(None, (_finite_numbers(x, f"{where}.{k}" if where else str(k)) for k, x in items)), None)


def _model_config(v: dict) -> str | None:
    """Sizes (``*_size``, ``*_dim``, ``num_*``, ``n_*``, ...) outside [0, 2**24]."""
    sizes = {k: x for k, x in v.items() if str(k).endswith(("_size", "_dim", "_layers", "_heads", "_experts"))
             or str(k).startswith(("num_", "n_"))}
    bad = [f"{k} is {x!r}, a size must be within [0, 2**24]" for k, x in sizes.items()
           if isinstance(x, int) and not isinstance(x, bool) and not 0 <= x <= 1 << 24]
    return bad[0] if bad else None


def _check(ok: Callable[[Any], bool], problem: str) -> Callable[[Any], str | None]:
    """A :attr:`Key.check` that reports ``problem`` for a value ``ok`` rejects."""
    return lambda v: None if ok(v) else problem


def _recompute(v: Any) -> str | None:
    if isinstance(v, str):
        return None if v in ("none", "full") else "expected 'none', 'full' or a list of module-name globs"
    return None if v and all(isinstance(s, str) and s for s in v) else "must be a non-empty list of module-name globs"


_seed = _check(lambda v: 0 <= v < 1 << 63, "must be within [0, 2**63)")
_positive = _check(lambda v: v > 0, "must be > 0")
_count = _check(lambda v: 0 < v <= 1 << 20, "must be within [1, 2**20]")
_non_negative = _check(lambda v: v >= 0, "must be >= 0")
_fraction = _check(lambda v: 0 <= v <= 1, "must be within [0, 1]")
_betas = _check(lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
                "must be two numbers in [0, 1)")
_int_list = _check(lambda v: all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v),
                   "must be a list of step numbers >= 0")
_str_list = _check(lambda v: all(isinstance(s, str) for s in v), "must be a list of strings")
_rules = _check(lambda v: all(isinstance(r, dict) for r in v), "must be a list of mappings (one per rule)")

_NUM = (int, float)
_OPT_STR = (str, type(None))

SCHEMA: dict[str, dict[str, Key]] = {
    "run": {
        "seed": Key(0, (int,), check=_seed),  # seed of model init, data order and every RNG
        "out_dir": Key("runs/train", (str,)),  # metrics.jsonl, traces and (by default) checkpoints go here
        "log_interval": Key(1, (int,), check=_positive),  # steps between progress/metrics lines
        "progress": Key(True, (bool,)),  # draw the progress bar on stderr (rank 0)
        # hardware profile whose peak matmul rate per rank is MFU's denominator (auto: cpu, or the profile named in the
        # GPU's name; null: no MFU)
        "hardware": Key("auto", _OPT_STR),
        # start afresh in an out_dir holding a previous run (its metrics, events and checkpoints are deleted); without
        # it such an out_dir is refused
        "overwrite": Key(False, (bool,)),
        # a NaN / inf loss or gradient norm: stop the run, or skip the step's update
        "on_nonfinite": Key("stop", (str,), choices=("stop", "skip")),
        "tensorboard": Key(True, (bool,)),  # write TensorBoard event files beside metrics.jsonl
    },
    "model": {
        # a transformers model type (qwen3_moe, qwen2_moe, deepseek_v3, mixtral, olmoe, ...) built with random weights,
        # or 'path' for a local checkpoint
        "kind": Key("qwen3_moe", (str,)),
        # keyword arguments of the transformers config class (e.g. hidden_size)
        "config": Key({}, (dict,), check=_model_config),
        "path": Key(None, _OPT_STR),  # local directory with config.json (+ weights) when kind is 'path'
        "dtype": Key("float32", (str,), choices=("float32", "bfloat16")),  # parameter dtype
        "autocast": Key(None, _OPT_STR, choices=(None, "bfloat16", "float16")),  # run forward under torch.autocast
        "compile": Key(False, (bool, str)),  # torch.compile each decoder layer (true: inductor; or a backend name)
    },
    "data": {
        "source": Key("synthetic", (str,), choices=("synthetic", "files")),  # seeded token stream or local files
        "path": Key(None, _OPT_STR),  # files: a .jsonl / .json, .parquet or .txt file, a directory or a glob of them
        "tokenizer": Key(None, _OPT_STR),  # files: a tokenizer directory or tokenizer.json (null: UTF-8 bytes)
        "text_field": Key("text", (str,)),  # files: the field of a json / parquet record holding its text
        "shuffle_buffer": Key(0, (int,), check=_non_negative),  # files: documents shuffled in a buffer this big
        "seq_len": Key(16, (int,), check=_count),  # tokens per sequence
        "batch_size": Key(4, (int,), check=_count),  # sequences per step per data-parallel rank
        "branching": Key(2, (int,), check=_positive),  # synthetic stream: successors per token (lower = easier)
    },
    "optimizer": {
        # muon: Muon for weight matrices (and stacked expert matrices), AdamW for the rest
        "name": Key("adamw", (str,), choices=("adamw", "sgd", "muon")),
        "lr": Key(1e-3, _NUM, check=_positive),
        "weight_decay": Key(0.0, _NUM, check=_non_negative),
        "betas": Key([0.9, 0.95], (list,), check=_betas),
        "eps": Key(1e-8, _NUM, check=_positive),
        "momentum": Key(0.0, _NUM, check=_fraction),  # sgd only
        "grad_clip": Key(1.0, _NUM, check=_non_negative),  # max global grad norm; 0 disables
        "grad_accum_steps": Key(1, (int,), check=_positive),  # micro-batches per optimizer step and data rank
        "muon_momentum": Key(0.95, _NUM, check=_fraction),  # muon only
        # muon only: lr scaling per matrix shape (match_rms_adamw: one lr fits AdamW and Muon)
        "muon_adjust_lr": Key("match_rms_adamw", (str,), choices=("match_rms_adamw", "original")),
    },
    "schedule": {
        "steps": Key(20, (int,), check=_positive),  # total optimizer steps
        "warmup_steps": Key(0, (int,), check=_non_negative),
        "decay": Key("constant", (str,), choices=("constant", "linear", "cosine")),
        "min_lr_ratio": Key(0.1, _NUM, check=_fraction),  # final lr / peak lr for linear and cosine decay
    },
    "eval": {
        "interval": Key(0, (int,), check=_non_negative),  # steps between evaluations (loss, perplexity); 0: none
        "batches": Key(2, (int,), check=_positive),  # batches (of data.batch_size per data rank) per evaluation
        "path": Key(None, _OPT_STR),  # files: the eval split's files (null: the first eval.holdout_docs documents)
        "holdout_docs": Key(0, (int,), check=_non_negative),  # files: documents held out of training for eval
    },
    "moe": {
        # aux_loss, bias (aux-loss-free correction-bias update) or none; auto: aux_loss when
        # model.config.output_router_logits
        "balance": Key("auto", (str,), choices=("auto", "none", "aux_loss", "bias")),
        # weight of the load-balancing loss (null: model.config.router_aux_loss_coef)
        "aux_loss_coef": Key(None, _NUM + (type(None),), check=_non_negative),
        "bias_rate": Key(1e-3, _NUM, check=_positive),  # bias: step of the correction-bias update
    },
    "parallel": {
        # tensor parallel: attention heads and dense MLPs split over this many ranks
        "tp_size": Key(1, (int,), check=_positive),
        "cp_size": Key(1, (int,), check=_positive),  # context parallel: each sequence split over this many ranks
        # expert parallel: experts split over this many data / context ranks
        "ep_size": Key(1, (int,), check=_positive),
        "fsdp": Key(False, (bool,)),  # shard parameters over the data and context ranks (torch FSDP2, uneven shards)
        # activation recomputation: none, full (every decoder layer) or module-name globs
        "recompute": Key("none", (str, list), check=_recompute),
        # FSDP mixed precision: dtype of gathered parameters (null: the model's)
        "fsdp_param_dtype": Key(None, _OPT_STR, choices=(None, "float32", "bfloat16")),
        # FSDP mixed precision: dtype of gradient reduction (null: as param_dtype)
        "fsdp_reduce_dtype": Key(None, _OPT_STR, choices=(None, "float32", "bfloat16")),
        # FSDP: free gathered weights after forward (gathered again for backward)
        "reshard_after_forward": Key(True, (bool,)),
        # FSDP: layers whose weight gather is issued ahead explicitly (0: FSDP2's own backward prefetch)
        "prefetch": Key(0, (int,), check=_non_negative),
        "backend": Key("gloo", (str,), choices=("gloo", "nccl")),  # torch.distributed backend under torchrun
        "timeout_s": Key(60, _NUM, check=_positive),  # collective timeout
    },
    "low_precision": {
        # 'mxfp8': nn.Linear -> MXFP8Linear and MegaMoE experts' GEMMs in MXFP8
        "format": Key("none", (str,), choices=("none", "mxfp8")),
        "linear": Key(None, (str, type(None)), choices=(None, "none", "mxfp8")),  # another name for format
        "scale_mode": Key("floor", (str,), choices=("floor", "rceil")),  # MX block scale rounding
        "include": Key(["*"], (list,), check=_str_list),  # module-name globs of the Linear layers / experts to swap
        "exclude": Key(["lm_head"], (list,), check=_str_list),  # globs kept in high precision
        # bound on the MXFP8 model's logits error before training (null: 0.1 float32, 0.15 bfloat16)
        "rtol": Key(None, _NUM + (type(None),), check=_positive),
    },
    "replace": {
        "rules": Key([], (list,), check=_rules),  # the replacement plan: list of {match, type, with, options}
        "check_outputs": Key(True, (bool,)),  # compare the replaced model's logits with the original's before training
        # relative tolerance of that check (null: 1e-5 float32, 2e-2 bfloat16)
        "rtol": Key(None, _NUM + (type(None),), check=_positive),
    },
    "checkpoint": {
        "interval": Key(0, (int,), check=_non_negative),  # steps between checkpoints; 0 saves only at the end
        "dir": Key(None, _OPT_STR),  # checkpoint directory (default: <run.out_dir>/checkpoints)
        "resume": Key(False, (bool, str)),  # true: resume from the latest checkpoint in dir; a path: from that one
        "keep": Key(2, (int,), check=_positive),  # checkpoints kept on disk
        # stop (after saving) once this step is done; for tests and preemption
        "stop_after": Key(None, (int, type(None)), check=_positive),
    },
    "trace": {
        "steps": Key([], (list,), check=_int_list),  # steps (1-based) whose forward/backward are recorded
        "dir": Key(None, _OPT_STR),  # trace directory (default: <run.out_dir>/traces)
        "perfetto": Key(True, (bool,)),  # also write Chrome Trace Event JSON that Perfetto opens
    },
}


class Config(dict):
    """A validated config: ``cfg["section"]["key"]``."""

    def to_yaml(self) -> str:
        return yaml.safe_dump(dict(self), sort_keys=False)


def _check_value(section: str, name: str, key: Key, value: Any) -> str | None:
    where = f"{section}.{name}"
    number = isinstance(value, int) and not isinstance(value, bool) and float in key.types  # an int is a number
    typed = number or (isinstance(value, key.types) and (bool in key.types or not isinstance(value, bool)))
    if not typed or (key.choices is not None and value not in key.choices):
        allowed = ("one of " + ", ".join(map(repr, key.choices)) if key.choices is not None
                   else " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in key.types))
        return f"{where}: got {value!r}, expected {allowed}"
    problem = _finite_numbers(value) or (key.check(value) if key.check is not None and value is not None else None)
    return f"{where}: got {value!r}, {problem}" if problem else None


def validate(raw: dict[str, Any] | None) -> Config:
    """Fill defaults and check every section and key; raise one ConfigError listing all problems."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    problems = [f"unknown section {name!r}; allowed: {', '.join(SCHEMA)}" for name in raw if name not in SCHEMA]
    out = Config()
    for section, keys in SCHEMA.items():
        given = raw.get(section) or {}
        if section == "replace" and isinstance(given, list):  # shorthand: the section is the rule list
            given = {"rules": given}
        if not isinstance(given, dict):
            problems.append(f"{section}: expected a mapping of keys, got {type(given).__name__}")
            given = {}
        problems += [f"unknown key {section}.{name}; allowed: {', '.join(keys)}" for name in given if name not in keys]
        values = out[section] = {name: copy.deepcopy(given.get(name, key.default)) for name, key in keys.items()}
        problems += filter(None, (_check_value(section, name, key, values[name]) for name, key in keys.items()))
    problems += _cross_checks(out)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return out


def _cross_checks(cfg: Config) -> list[str]:
    """Problems between keys (a value of the wrong type is reported already, and is skipped here)."""
    m, d, ev, par, lp = (cfg[s] for s in ("model", "data", "eval", "parallel", "low_precision"))
    cp, seq, steps = par["cp_size"], d["seq_len"], cfg["schedule"]["steps"]
    files, ints = d["source"] == "files", isinstance(cp, int) and isinstance(seq, int) and isinstance(steps, int)
    rules = [
        (m["kind"] == "path" and not m["path"], "model.path: required when model.kind is 'path'"),
        (m["kind"] == "path" and m["config"],
         "model.config: not used when model.kind is 'path' (the directory's config.json is)"),
        (files and not d["path"], "data.path: required when data.source is 'files'"),
        (files and ev["interval"] and not (ev["path"] or ev["holdout_docs"]),
         "eval.interval: evaluating files needs eval.path or eval.holdout_docs"),
        (ints and cp > 0 and seq % cp,
         f"parallel.cp_size: {cp} does not divide data.seq_len={seq} (each rank takes an equal part)"),
        (isinstance(par["tp_size"], int) and par["tp_size"] > 1 and (lp["linear"] or lp["format"]) == "mxfp8",
         "parallel.tp_size: tensor parallelism splits nn.Linear layers, which low_precision.format=mxfp8 replaces; "
         "use one or the other"),
    ]
    rules += [(ints and isinstance(step, int) and not 1 <= step <= steps,
               f"trace.steps[{i}]: step {step} outside 1..{steps} (schedule.steps)")
              for i, step in enumerate(cfg["trace"]["steps"] if isinstance(cfg["trace"]["steps"], list) else [])]
    return [problem for bad, problem in rules if bad]


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--optimizer.lr=0.01", "--model.config.hidden_size=64"]`` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"bad override {arg!r}: expected --section.key=value (sections: {', '.join(SCHEMA)})")
        path, text = arg[2:].split("=", 1)
        try:
            value = parse_yaml(text) if text else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {arg!r}: value is not valid YAML ({e.problem})") from None
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r} conflicts with an earlier override of {p!r}")
        node[leaf] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base`` (mappings merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Read a YAML file (or nothing: all defaults), apply overrides, validate."""
    raw = (load_yaml(path, "config") or {}) if path is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: config must be a mapping of sections, got {type(raw).__name__}")
    if overrides:
        over = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        if isinstance(raw.get("replace"), list) and "replace" in over:
            raw["replace"] = {"rules": raw["replace"]}
        raw = merge(raw, over)
    return validate(raw)
