"""The ``replace`` and ``low_precision`` config sections as :mod:`megaloom.replace` plans.

    replace:
      rules:
        - match: "model.layers.*.mlp"        # glob or list of globs (fully-qualified names)
          type: Qwen3MoeSparseMoeBlock       # optional: restrict to this class
          with: mega_moe                     # mega_moe | mega_gate
          options: {gate: mega_gate, schedule: interleaved, executor: thread}

Both plans are matched and checked on the untouched model first (globs matching
nothing, types the target cannot take, dims or settings it cannot run, rule keys),
and every problem is raised in one ConfigError; only then are modules swapped:
first the megaloom modules (exact: the logits must match the original's within
``replace.rtol``), then MXFP8 (logits within ``low_precision.rtol``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from megaloom.hf_moe import MOE_BLOCKS
from megaloom.replace import Replacement, ReplacementPlan, Rule
from megaloom.runtime.errors import ConfigError
from megaloom.swaps import GATE_SCORES, MegaMoEBlock, gate_problems, make_gate, moe_problems

RULE_KEYS = ("match", "exclude", "type", "with", "options")
MOE_OPTIONS = ("gate", "executor", "units", "policy", "cache_size", "tile_m", "cube_split", "wgrad_split",
               "schedule", "group_size")
GATE_OPTIONS = ("tile_tokens", "weight_cols")


@dataclass(frozen=True, slots=True)
class Target:
    """A ``with:`` value: the class names it replaces and the option names it takes."""

    sources: tuple[str, ...]
    options: tuple[str, ...]
    describe: str


TARGETS = {
    "mega_moe": Target(tuple(MOE_BLOCKS), MOE_OPTIONS, "MegaMoEBlock (routed experts as MegaMoE graphs)"),
    "mega_gate": Target(tuple(GATE_SCORES), GATE_OPTIONS, "MegaGate (router as graphs)"),
}


def _globs(value: Any, where: str, problems: list[str]) -> tuple[str, ...]:
    globs = [value] if isinstance(value, str) else value
    if not isinstance(globs, list) or not globs or not all(isinstance(g, str) for g in globs):
        problems.append(f"{where}: expected a glob or a list of globs, got {value!r}")
        return ()
    return tuple(globs)


def _rule(i: int, raw: dict, types: dict[str, type], comm: Any, problems: list[str]) -> Rule | None:
    where = f"replace.rules[{i}]"
    problems += [f"{where}: unknown key {k!r}; allowed: {', '.join(RULE_KEYS)}" for k in raw if k not in RULE_KEYS]
    target = TARGETS.get(raw.get("with"))
    if target is None:
        problems.append(f"{where}.with: got {raw.get('with')!r}, expected one of {', '.join(map(repr, TARGETS))}")
        return None
    include = _globs(raw.get("match"), f"{where}.match", problems)
    exclude = _globs(raw["exclude"], f"{where}.exclude", problems) if "exclude" in raw else ()
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        problems.append(f"{where}.options: expected a mapping, got {options!r}")
        options = {}
    problems += [f"{where}.options: unknown option {k!r} for {raw['with']}; allowed: {', '.join(target.options)}"
                 for k in options if k not in target.options]
    wanted = raw.get("type")
    names = target.sources
    if wanted is not None:
        if wanted not in target.sources:
            problems.append(f"{where}.type: {wanted!r} cannot become {target.describe}; "
                            f"supported: {', '.join(target.sources)}")
            return None
        names = (wanted,)
    source = tuple(types[n] for n in names if n in types)
    if not source:
        problems.append(f"{where}: the model has no module of type {' / '.join(names)} for {raw['with']}")
        return None
    if not include:
        return None
    factory, check = _factory(raw["with"], dict(options), comm, where, problems)
    return Rule(f"{where} ({raw['with']})", source, factory, include, exclude, check=check,
                skip=(MegaMoEBlock,))


def _factory(target: str, options: dict, comm: Any, where: str,
             problems: list[str]) -> tuple[Callable[[nn.Module], nn.Module], Callable[[nn.Module], list[str]]]:
    ep = getattr(comm, "world_size", 1)
    if target == "mega_gate":
        return (lambda m: make_gate(m, **options)), gate_problems
    gate = options.pop("gate", "hf")
    if gate not in ("hf", "mega_gate"):
        problems.append(f"{where}.options.gate: got {gate!r}, expected one of 'hf', 'mega_gate'")

    def check(block: nn.Module) -> list[str]:
        return moe_problems(block, ep) + (gate_problems(block.gate) if gate == "mega_gate" else [])

    def build(block: nn.Module) -> nn.Module:
        router = make_gate(block.gate) if gate == "mega_gate" else None
        return MegaMoEBlock(block, comm=comm if ep > 1 else None, gate=router, **options)
    return build, check


def config_plans(model: nn.Module, cfg: dict, comm: Any = None) -> tuple[ReplacementPlan, ReplacementPlan]:
    """(megaloom-module plan, low-precision plan) for a validated config; both fully checked on ``model``.

    ``comm`` is passed to MegaMoE when ``parallel.ep_size`` > 1 (expert parallelism).
    """
    from megaloom.low_precision import low_precision_rules

    problems: list[str] = []
    ep = cfg["parallel"]["ep_size"]
    if ep > 1 and getattr(comm, "world_size", 1) != ep:
        problems.append(f"parallel.ep_size: {ep} must equal the size of the expert-parallel group "
                        f"({getattr(comm, 'world_size', 1)} ranks) MegaMoE is given")
    types = {type(m).__name__: type(m) for m in model.modules()}
    rules = [_rule(i, r, types, comm if ep > 1 else None, problems) if isinstance(r, dict) else None
             for i, r in enumerate(cfg["replace"]["rules"])]
    modules = ReplacementPlan([r for r in rules if r is not None])
    lp = {k: v for k, v in cfg["low_precision"].items() if k in ("format", "linear", "scale_mode", "include", "exclude")
          and v is not None}
    try:
        low = ReplacementPlan(low_precision_rules(lp))
    except ConfigError as e:
        problems.append(str(e))
        low = ReplacementPlan([])
    for plan in (modules, low):
        try:
            plan.match(model)
        except ConfigError as e:
            problems += str(e).splitlines()[1:]
    if problems:
        raise ConfigError("replacement plan is invalid, model left unchanged:\n  " + "\n  ".join(p.strip() for p in problems))
    return modules, low


def probe_logits(model: nn.Module, vocab: int, seq_len: int, seed: int) -> torch.Tensor:
    """Logits of a fixed seeded batch (2 sequences): the parity probe."""
    ids = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of ``want`` (the parity metric)."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _check_parity(err: float, rtol: float, log: Callable[[str], None], note: str, problem: str, **fmt: Any) -> None:
    """Log ``note``; raise ConfigError ``problem`` when ``err > rtol`` (both formatted with err, rtol, ``fmt``)."""
    log(note.format(err=err, rtol=rtol, **fmt))
    if err > rtol:
        raise ConfigError(problem.format(err=err, rtol=rtol, **fmt))


def apply_config_plan(model: nn.Module, cfg: dict, log: Callable[[str], None] = print,
                      comm: Any = None) -> list[Replacement]:
    """Check both plans, swap modules in, and check the logits against the original model's."""
    modules, low = config_plans(model, cfg, comm)
    check = cfg["replace"]["check_outputs"]
    probe = (lambda: probe_logits(model, int(model.config.vocab_size), cfg["data"]["seq_len"], cfg["run"]["seed"]))
    want = probe() if check else None
    done = modules.apply(model)
    for block in model.modules():
        if isinstance(block, MegaMoEBlock):
            block.keep_local_experts()
    for r in done:
        log(f"replaced {r.path} ({type(r.old).__name__}) with {type(r.new).__name__}: parameters kept by identity"
            + (" (expert weights passed as transposed views, no copy)" if isinstance(r.new, MegaMoEBlock) else ""))
    if check and done:
        _check_parity(max_rel_err(probe(), want), cfg["replace"]["rtol"], log,
                      "logits after replacing {n} module(s): max relative error {err:.2e} (bound {rtol:g})",
                      "replace: the replaced model's logits differ from the original's by {err:.2e} "
                      "(relative), more than replace.rtol={rtol:g}", n=len(done))
    lowered = low.apply(model)
    if lowered:
        log(f"low_precision: {len(lowered)} Linear layer(s) now MXFP8Linear (same Parameters)")
    if check and lowered:
        _check_parity(max_rel_err(probe(), want), cfg["low_precision"]["rtol"], log,
                      "logits with MXFP8: max relative error {err:.2e} vs float32 (bound low_precision.rtol={rtol:g})",
                      "low_precision: MXFP8 logits differ from float32 by {err:.2e} (relative), "
                      "more than low_precision.rtol={rtol:g}")
    return done + lowered
