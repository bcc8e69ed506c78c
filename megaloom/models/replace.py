"""Config-driven module replacement: a plan of rules, validated in full before anything changes.

A :class:`Rule` matches modules by fully-qualified name (``fnmatch`` globs, ``*`` crosses
dots: ``"*.mlp.*"`` matches ``layers.0.mlp.up``) and by type, and builds each replacement
with a factory that must re-use the module's own Parameter objects::

    plan = ReplacementPlan([Rule("mxfp8", (nn.Linear,), MXFP8Linear.from_float,
                                 include=("*.mlp.*",), exclude=("lm_head",), skip=(MXFP8Linear,))])
    done = plan.apply(model)   # ConfigError listing every problem, or every module swapped

:meth:`ReplacementPlan.apply` first matches every rule, checks every module, builds every
replacement and verifies it (same Parameter objects under the same names, same
state_dict keys), and only then swaps them in, so a bad plan leaves the model untouched.
A module reachable under several names (shared) is replaced under all of them by one new
module. Hooks registered on a replaced module are not carried over.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Sequence

from torch import nn

from megaloom.runtime.errors import ConfigError

Factory = Callable[[nn.Module], nn.Module]
Check = Callable[[nn.Module], list[str]]


@dataclass(frozen=True, slots=True)
class Rule:
    """Replace modules of a ``source`` type whose name matches ``include`` and not ``exclude``.

    ``check`` returns the problems that stop the plan (errors naming the module);
    ``unfit`` returns reasons to leave a module as it is (listed in :attr:`ReplacementPlan.skipped`,
    not errors: e.g. dims a format cannot take); ``skip`` types (or a predicate) are left alone
    (typically the target type, so a plan applies once); modules inside an ``inside`` type are
    never selected (e.g. expert MLPs whose weights another module reads);
    ``preview(module)``: what the replacement will make of the module's descendants, by id (stand-ins
    another plan is checked against before this one is applied).
    """

    name: str
    source: tuple[type, ...]
    factory: Factory
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    check: Check | None = None
    skip: tuple[type, ...] | Callable[[nn.Module], bool] = ()
    unfit: Check | None = None
    inside: tuple[type, ...] = ()
    preview: Callable[[nn.Module], dict[int, nn.Module]] | None = None

    def selects(self, path: str, module: nn.Module) -> bool:
        skipped = self.skip(module) if callable(self.skip) else isinstance(module, self.skip)
        return (isinstance(module, self.source) and not skipped
                and any(fnmatchcase(path, g) for g in self.include)
                and not any(fnmatchcase(path, g) for g in self.exclude))


@dataclass(frozen=True, slots=True)
class Replacement:
    """One swap: the module's names (first is canonical), the rule, the old and new modules."""

    paths: tuple[str, ...]
    rule: str
    old: nn.Module
    new: nn.Module

    @property
    def path(self) -> str:
        return self.paths[0]


def glob_problem(glob: object) -> str | None:
    """Why ``glob`` is not a usable name glob, or None."""
    if not isinstance(glob, str):
        return f"{glob!r} is not a string"
    if not glob.strip() or glob != glob.strip():
        return f"{glob!r} is empty or has surrounding spaces"
    depth = 0
    for ch in glob:
        depth += ch == "["
        depth -= ch == "]" and depth > 0
        if depth > 1:
            return f"{glob!r} nests '['"
    return f"{glob!r} has an unclosed '['" if depth else None


def _describe(module: nn.Module) -> str:
    extra = module.extra_repr()
    return f"{type(module).__name__}({extra})" if extra else type(module).__name__


def _param_problems(old: nn.Module, new: nn.Module) -> list[str]:
    problems = []
    before, after = dict(old.named_parameters()), dict(new.named_parameters())
    lost = [n for n, p in before.items() if after.get(n) is not p]
    if lost:
        problems.append(f"does not re-use the Parameter objects {lost}")
    if list(old.state_dict()) != list(new.state_dict()):
        problems.append(f"changes the state_dict keys {list(old.state_dict())} -> {list(new.state_dict())}")
    return problems


def _ancestor(path: str, names: set[str]) -> str | None:
    """The outermost proper ancestor of ``path`` in ``names``, or None."""
    parts = path.split(".")
    return next((q for q in (".".join(parts[:k]) for k in range(1, len(parts))) if q in names), None)


class ReplacementPlan:
    """An ordered list of rules; a module matched by two rules is an error, not a tie-break."""

    def __init__(self, rules: Sequence[Rule]):
        self.rules = list(rules)
        self.skipped: list[tuple[str, str, str]] = []  # (module name, rule, reason) of unfit modules, set by match

    @staticmethod
    def stand_ins(selected: list[tuple[tuple[str, ...], Rule, nn.Module]]) -> dict[int, nn.Module]:
        """What applying the ``selected`` matches will put in place of existing modules (by id), from
        the rules' previews."""
        return {i: new for _, rule, mod in selected if rule.preview is not None for i, new in rule.preview(mod).items()}

    def match(self, model: nn.Module, stand_ins: dict[int, nn.Module] | None = None
              ) -> list[tuple[tuple[str, ...], Rule, nn.Module]]:
        """(names, rule, module) of every module to replace; raises ConfigError listing every problem.
        ``stand_ins`` (by id) are matched in place of the model's modules (another plan's preview)."""
        problems: list[str] = []
        for rule in self.rules:
            for kind, globs in (("include", rule.include), ("exclude", rule.exclude)):
                if isinstance(globs, str):
                    problems.append(f"rule {rule.name!r}: {kind} must be a list of globs, got the string {globs!r}")
                    continue
                problems += [f"rule {rule.name!r}: bad {kind} glob {p}" for p in map(glob_problem, globs) if p]
        if problems:
            raise ConfigError("module replacement plan is invalid:\n  " + "\n  ".join(problems))
        paths: dict[int, list[str]] = {}
        modules: dict[int, nn.Module] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(mod), []).append(path)
            modules[id(mod)] = (stand_ins or {}).get(id(mod), mod)
        chosen: dict[int, Rule] = {}
        self.skipped = []
        for rule in self.rules:
            hidden = {p for i, ps in paths.items() if isinstance(modules[i], rule.inside) for p in ps}
            typed = [p for i, ps in paths.items() if isinstance(modules[i], rule.source) for p in ps]
            kinds = "/".join(t.__name__ for t in rule.source)  # each include glob must match a module of the type
            problems += [f"rule {rule.name!r}: include glob {glob!r} matches no {kinds} module"
                         for glob in rule.include if not any(fnmatchcase(p, glob) for p in typed)]
            for i, ps in paths.items():
                mod = modules[i]
                if not any(rule.selects(p, mod) and _ancestor(p, hidden) is None for p in ps):
                    continue
                reasons = rule.unfit(mod) if rule.unfit else []
                if reasons:
                    self.skipped.append((ps[0], rule.name, "; ".join(reasons)))
                    continue
                if i in chosen:
                    problems.append(f"module {ps[0]!r} is matched by rules {chosen[i].name!r} and {rule.name!r}")
                    continue
                chosen[i] = rule
                problems += [f"module {ps[0]!r} ({_describe(mod)}): {p}" for p in (rule.check(mod) if rule.check else [])]
        selected = [(tuple(paths[i]), rule, modules[i]) for i, rule in chosen.items()]
        names = {p for ps, _, _ in selected for p in ps}
        problems += [f"rule {rule.name!r} matches the root module, which cannot be replaced in place"
                     for ps, rule, _ in selected if "" in ps]
        problems += [f"module {p!r} lies inside {outer!r}, which is replaced too"
                     for ps, _, _ in selected for p in ps if (outer := _ancestor(p, names)) is not None]
        if problems:
            raise ConfigError("module replacement plan is invalid:\n  " + "\n  ".join(problems))
        return selected

    def apply(self, model: nn.Module) -> list[Replacement]:
        """Validate, build and verify every replacement, then swap them all in; returns them."""
        done, problems = [], []
        for ps, rule, mod in self.match(model):
            try:
                new = rule.factory(mod)
            except Exception as e:  # reported with every other problem, before any change
                problems.append(f"module {ps[0]!r}: rule {rule.name!r} failed: {type(e).__name__}: {e}")
                continue
            problems += [f"module {ps[0]!r}: rule {rule.name!r} {p}" for p in _param_problems(mod, new)]
            done.append(Replacement(ps, rule.name, mod, new))
        if problems:
            raise ConfigError("module replacement failed, model left unchanged:\n  " + "\n  ".join(problems))
        for r in done:
            for p in r.paths:
                parent, _, child = p.rpartition(".")
                setattr(model.get_submodule(parent), child, r.new)
        return done
