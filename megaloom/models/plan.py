"""The one replacement plan of a config: its ``replace`` and ``low_precision`` sections as
:mod:`megaloom.models.replace` rules, checked in full, then applied.

    replace:
      rules:
        - match: "model.layers.*.mlp"        # glob or list of globs (fully-qualified names)
          type: Qwen3MoeSparseMoeBlock       # optional: restrict to this class
          with: mega_moe                     # a replacement target: mega_moe | mega_gate
          options: {gate: mega_gate, schedule: interleaved, executor: thread}
    low_precision:
      format: mxfp8          # a low-precision format, or none; ``linear:`` is another name for this key
      scale_mode: floor      # floor (OCP) or rceil
      include: ["*.mlp.*"]   # fully-qualified module-name globs
      exclude: ["lm_head"]

Replacement targets (:data:`TARGETS`) and low-precision formats (:data:`FORMATS`) are
registries. A format swaps every registered module type whose name matches (``nn.Linear``
-> ``MXFP8Linear``, ``GroupedExperts`` -> ``MXFP8GroupedExperts``; more with
:func:`register_module_type`), keeping the very same Parameter objects.

Both parts are matched and checked on the untouched model first (globs matching nothing,
types the target cannot take, dims or settings it cannot run, rule keys), and every
problem is raised in one ConfigError; only then are modules swapped: first the megaloom
modules (exact: the logits must match the original's within ``replace.rtol``), then the
low-precision ones (logits within ``low_precision.rtol``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from megaloom.models.hf_moe import ROUTER_NAMES, block_parts, is_moe_block, is_router, max_rel_err
from megaloom.models.replace import Check, Factory, Replacement, ReplacementPlan, Rule, glob_problem
from megaloom.models.routers import gate_settings
from megaloom.models.swaps import MegaMoEBlock, RoutedExperts, make_gate, moe_problems, routed_experts
from megaloom.ops.mxfp8 import SCALE_MODES, GroupedExperts, MXFP8GroupedExperts, MXFP8Linear, dim_problems
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.plugins import Registry

RULE_KEYS = ("match", "exclude", "type", "with", "options")
MOE_OPTIONS = ("gate", "executor", "units", "policy", "cache_size", "tile_m", "cube_split", "wgrad_split",
               "schedule", "group_size")
GATE_OPTIONS = ("tile_tokens", "weight_cols")
LP_KEYS = ("format", "linear", "scale_mode", "include", "exclude")
# default parity bounds (max |logits - original| / max |original|) by model dtype
REPLACE_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}
MXFP8_RTOL = {"float32": 0.1, "bfloat16": 0.15}


@dataclass(frozen=True, slots=True)
class Target:
    """A ``with:`` value: which modules it takes (``accepts``, by structure; ``kind`` names them),
    the option names it takes, and ``rule(options, comm, where, problems) -> (factory, check)``."""

    accepts: Callable[[nn.Module], bool]
    kind: str
    options: tuple[str, ...]
    describe: str
    rule: Callable[[dict, Any, str, list[str]], tuple[Factory, Check]]
    preview: Callable[[nn.Module], dict[int, nn.Module]] | None = None


@dataclass(frozen=True, slots=True)
class ModuleType:
    """How a low-precision format swaps one module type: ``build(module, scale_mode)``; ``check``: reasons
    a module is left in high precision (listed, not errors); ``applied``: already in the format (default:
    an instance of ``target``)."""

    source: type
    target: type
    build: Callable[[nn.Module, str], nn.Module]
    check: Check
    applied: Callable[[nn.Module], bool] | None = None

    def done(self, module: nn.Module) -> bool:
        if self.applied is None:
            return isinstance(module, self.target)
        return isinstance(module, self.source) and self.applied(module)


def _globs(value: Any, where: str, problems: list[str], *, single: bool = False) -> tuple[str, ...]:
    """Module-name globs at ``where``: a list of strings (or, with ``single``, one string); each
    problem goes to ``problems`` and then none are returned."""
    globs = [value] if single and isinstance(value, str) else value
    if not isinstance(globs, (list, tuple)) or not all(isinstance(g, str) for g in globs) or (single and not globs):
        problems.append(f"{where} must be {'a glob or ' if single else ''}a list of module-name globs, got {value!r}")
        return ()
    bad = [f"{where}: bad glob {p}" for p in map(glob_problem, globs) if p]
    problems += bad
    return () if bad else tuple(globs)


def _ours(t: type) -> bool:
    return t.__module__.startswith("megaloom.")


def _rule(i: int, raw: dict, modules: dict[str, nn.Module], comm: Any, problems: list[str]) -> Rule | None:
    """The Rule of ``replace.rules[i]``; ``modules``: one module of each type name in the model."""
    where = f"replace.rules[{i}]"
    problems += [f"{where}: unknown key {k!r}; allowed: {', '.join(RULE_KEYS)}" for k in raw if k not in RULE_KEYS]
    kind = raw.get("with")
    target = TARGETS.items().get(kind) if isinstance(kind, str) else None
    if target is None:
        problems.append(f"{where}.with: got {kind!r}, expected one of {', '.join(map(repr, TARGETS.items()))}")
        return None
    include = _globs(raw.get("match"), f"{where}.match", problems, single=True)
    exclude = _globs(raw["exclude"], f"{where}.exclude", problems, single=True) if "exclude" in raw else ()
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        problems.append(f"{where}.options: expected a mapping, got {options!r}")
        options = {}
    problems += [f"{where}.options: unknown option {k!r} for {raw['with']}; allowed: {', '.join(target.options)}"
                 for k in options if k not in target.options]
    accepted = {n: type(m) for n, m in modules.items() if not _ours(type(m)) and target.accepts(m)}
    wanted = raw.get("type")
    if wanted is not None:
        if wanted not in modules:
            problems.append(f"{where}: the model has no module of type {wanted} for {raw['with']}")
            return None
        if wanted not in accepted:
            problems.append(f"{where}.type: {wanted!r} cannot become {target.describe}: it is not {target.kind}")
            return None
        accepted = {wanted: accepted[wanted]}
    if not accepted:
        near = sorted({f"{type(m).__name__} (a router next to " + ", ".join(
                       f"{n} ({type(c).__name__})" for n, c in m.named_children() if n not in ROUTER_NAMES) + ")"
                       for m in modules.values() if any(hasattr(m, n) for n in ROUTER_NAMES) and not target.accepts(m)})
        problems.append(f"{where}: the model has no module that is {target.kind} for {raw['with']}" + (
            f"; {', '.join(near)}: no 'experts' child holding the expert weights (3-D gate_up_proj and down_proj, or "
            "a ModuleList of gated MLPs)" if near and kind == "mega_moe" else ""))
        return None
    if not include:
        return None
    factory, check = target.rule(dict(options), comm, where, problems)
    return Rule(f"{where} ({kind})", tuple(accepted.values()), factory, include, exclude, check=check,
                skip=lambda m: _ours(type(m)), preview=target.preview)


def _mega_gate(options: dict, comm: Any, where: str, problems: list[str]) -> tuple[Factory, Check]:
    return (lambda m: make_gate(m, **options)), (lambda m: gate_settings(m)[1])  # check: why it cannot


def _mega_moe(options: dict, comm: Any, where: str, problems: list[str]) -> tuple[Factory, Check]:
    ep = getattr(comm, "world_size", 1)
    gate = options.pop("gate", "hf")
    if gate not in ("hf", "mega_gate"):
        problems.append(f"{where}.options.gate: got {gate!r}, expected one of 'hf', 'mega_gate'")

    def check(block: nn.Module) -> list[str]:
        problems = moe_problems(block, ep)
        if problems or gate != "mega_gate":
            return problems
        parts = block_parts(block)
        return gate_settings(parts.router, bool(parts.bias_name))[1]

    def build(block: nn.Module) -> nn.Module:
        parts = block_parts(block)
        bias = getattr(block, parts.bias_name) if parts.bias_name else None
        router = make_gate(parts.router, bias) if gate == "mega_gate" else None
        return MegaMoEBlock(block, comm=comm if ep > 1 else None, gate=router, **options)
    return build, check


TARGETS: Registry[Target] = Registry("replacement target")
def _experts_preview(block: nn.Module) -> dict[int, nn.Module]:
    """A block's experts as the MegaMoEBlock will hold them (so ``low_precision`` can select them)."""
    experts = block_parts(block).experts
    return {id(experts): routed_experts(experts)}


TARGETS.register("mega_moe", Target(is_moe_block, "an MoE block (a router and experts)", MOE_OPTIONS,
                                    "MegaMoEBlock (routed experts as MegaMoE graphs)", _mega_moe, _experts_preview))
TARGETS.register("mega_gate", Target(is_router, "an MoE router (a 2-D weight and top_k)", GATE_OPTIONS,
                                     "MegaGate (router as graphs)", _mega_gate))


FORMATS: Registry[list[ModuleType]] = Registry("low-precision format")
FORMATS.register("mxfp8", [
    ModuleType(nn.Linear, MXFP8Linear, MXFP8Linear.from_float,
               lambda m: dim_problems({"in_features": m.in_features, "out_features": m.out_features})),
    ModuleType(GroupedExperts, MXFP8GroupedExperts, MXFP8GroupedExperts.from_float,
               lambda m: dim_problems({"dim": m.dim, "hidden": m.hidden})),
    ModuleType(RoutedExperts, RoutedExperts, lambda m, mode: m.with_mx(mode),
               lambda m: dim_problems({"hidden": m.hidden, "intermediate": m.intermediate}),
               applied=lambda m: m.mx is not None),
])


def register_module_type(fmt: str, kind: ModuleType) -> None:
    """Let ``low_precision`` swap another module type (e.g. a model's own expert block) for format ``fmt``."""
    if fmt not in FORMATS:
        FORMATS.register(fmt, [])
    FORMATS.get(fmt).append(kind)


def _kind_of(fmt: str, module: nn.Module) -> ModuleType:
    """The most specific registered type of ``module`` (earliest in its MRO)."""
    mro = type(module).__mro__
    return min((k for k in FORMATS.get(fmt) if isinstance(module, k.source)), key=lambda k: mro.index(k.source))


def low_precision_rules(section: Mapping[str, Any] | None) -> list[Rule]:
    """The replacement rules of a ``low_precision`` section (none when absent or format ``none``)."""
    section = dict(section or {})
    problems = [f"low_precision: unknown key {k!r} (known: {', '.join(LP_KEYS)})" for k in section if k not in LP_KEYS]
    fmt = section.get("format", section.get("linear", "none"))
    if "format" in section and "linear" in section and section["format"] != section["linear"]:
        problems.append(f"low_precision: format {section['format']!r} and linear {section['linear']!r} disagree")
    if fmt != "none" and fmt not in FORMATS:
        problems.append(f"low_precision.format: unknown format {fmt!r} (known: none, {', '.join(FORMATS)})")
    mode = section.get("scale_mode", "floor")
    if mode not in SCALE_MODES:
        problems.append(f"low_precision.scale_mode: unknown mode {mode!r} (known: {', '.join(SCALE_MODES)})")
    include = _globs(section.get("include", ["*"]), "low_precision.include", problems)
    exclude = _globs(section.get("exclude", []), "low_precision.exclude", problems)
    if problems:
        raise ConfigError("\n".join(problems))
    if fmt == "none":
        return []
    kinds = FORMATS.get(fmt)
    return [Rule(f"low_precision {fmt}", tuple(k.source for k in kinds),
                 lambda m: _kind_of(fmt, m).build(m, mode), include, exclude,
                 unfit=lambda m: _kind_of(fmt, m).check(m), skip=lambda m: any(k.done(m) for k in kinds),
                 inside=(RoutedExperts,))]


def apply_low_precision(model: nn.Module, section: Mapping[str, Any] | None) -> list[Replacement]:
    """Swap the modules the section selects; all problems raise one ConfigError, model unchanged."""
    return ReplacementPlan(low_precision_rules(section)).apply(model)


def config_plans(model: nn.Module, cfg: dict, comm: Any = None) -> tuple[ReplacementPlan, ReplacementPlan]:
    """(megaloom-module plan, low-precision plan) for a validated config; both fully checked on ``model``.

    ``comm`` is passed to MegaMoE when ``parallel.ep_size`` > 1 (expert parallelism).
    """
    problems: list[str] = []
    ep = cfg["parallel"]["ep_size"]
    if ep > 1 and getattr(comm, "world_size", 1) != ep:
        problems.append(f"parallel.ep_size: {ep} must equal the size of the expert-parallel group "
                        f"({getattr(comm, 'world_size', 1)} ranks) MegaMoE is given")
    modules = {type(m).__name__: m for m in model.modules()}
    rules = [_rule(i, r, modules, comm if ep > 1 else None, problems) if isinstance(r, dict) else None
             for i, r in enumerate(cfg["replace"]["rules"])]
    modules = ReplacementPlan([r for r in rules if r is not None])
    lp = {k: v for k, v in cfg["low_precision"].items() if k in LP_KEYS and v is not None}
    try:
        low = ReplacementPlan(low_precision_rules(lp))
    except ConfigError as e:
        problems.append(str(e))
        low = ReplacementPlan([])
    stand_ins: dict[int, nn.Module] = {}
    for plan in (modules, low):  # low precision is checked against the model as the module plan leaves it
        try:
            selected = plan.match(model, stand_ins)
            stand_ins = plan.stand_ins(selected) if plan is modules else stand_ins
        except ConfigError as e:
            problems += str(e).splitlines()[1:]
    if problems:
        raise ConfigError("replacement plan is invalid, model left unchanged:\n  " + "\n  ".join(p.strip() for p in problems))
    return modules, low


def probe_logits(model: nn.Module, vocab: int, seq_len: int, seed: int) -> torch.Tensor:
    """Logits of a fixed seeded batch (2 sequences): the parity probe; any random draw of the model's (a
    sampling router) starts from the same seed each time."""
    ids = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model(input_ids=ids, use_cache=False).logits.float()


def _check_logits(got: torch.Tensor, want: torch.Tensor, what: str, section: str, defaults: dict[str, float],
                  cfg: dict, log: Callable[[str], None]) -> None:
    """Log the relative error of the logits ``what`` (after a plan); ConfigError above ``<section>.rtol``
    (null: ``defaults`` by model dtype)."""
    dt = cfg["model"]["dtype"]
    bound = defaults[dt] if cfg[section]["rtol"] is None else cfg[section]["rtol"]
    err = max_rel_err(got, want)
    log(f"logits {what}: max relative error {err:.2e} (bound {bound:g} in {dt}: {section}.rtol)")
    if err > bound:
        raise ConfigError(f"{section}: the logits {what} differ from the {dt} model's by {err:.2e} (relative), "
                          f"more than {section}.rtol={bound:g}")


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
        _check_logits(probe(), want, f"after replacing {len(done)} module(s)", "replace", REPLACE_RTOL, cfg, log)
    lowered = low.apply(model)
    if lowered:
        kinds = Counter(type(r.old).__name__ for r in lowered)
        log(f"low_precision: {', '.join(f'{n} {k}' for k, n in kinds.items())} now MXFP8 (same Parameters)")
    if low.skipped:
        log(f"low_precision: {len(low.skipped)} module(s) kept in high precision: "
            + "; ".join(f"{path} ({reason})" for path, _, reason in low.skipped))
    if check and lowered:
        _check_logits(probe(), want, "with MXFP8", "low_precision", MXFP8_RTOL, cfg, log)
    return done + lowered
