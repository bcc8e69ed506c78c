"""The ``low_precision:`` config section as a module-replacement rule.

    low_precision:
      format: mxfp8          # or none; ``linear:`` is accepted as another name for this key
      scale_mode: floor      # floor (OCP) or rceil
      include: ["*.mlp.*"]   # fully-qualified module-name globs
      exclude: ["lm_head"]

Every registered module type of the format whose name matches is replaced (``nn.Linear``
-> ``MXFP8Linear``, ``GroupedExperts`` -> ``MXFP8GroupedExperts``; more with
:func:`register_module_type`). The new modules hold the very same Parameter objects, so
state_dict keys and checkpoints are unchanged. Problems (unknown keys or format, bad
globs, an include glob matching nothing, dims that are not multiples of 32) are all
reported in one :class:`ConfigError` naming the key or module, before anything changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from megaloom.ops.mxfp8 import SCALE_MODES, GroupedExperts, MXFP8GroupedExperts, MXFP8Linear, dim_problems
from megaloom.replace import Check, Replacement, ReplacementPlan, Rule, glob_problem
from megaloom.runtime.errors import ConfigError

KEYS = ("format", "linear", "scale_mode", "include", "exclude")


@dataclass(frozen=True, slots=True)
class ModuleType:
    """How one module type is swapped for a format: ``build(module, scale_mode)``, ``check``, ``target``."""

    source: type
    target: type
    build: Callable[[nn.Module, str], nn.Module]
    check: Check


FORMATS: dict[str, list[ModuleType]] = {"mxfp8": [
    ModuleType(nn.Linear, MXFP8Linear, MXFP8Linear.from_float,
               lambda m: dim_problems({"in_features": m.in_features, "out_features": m.out_features})),
    ModuleType(GroupedExperts, MXFP8GroupedExperts, MXFP8GroupedExperts.from_float,
               lambda m: dim_problems({"dim": m.dim, "hidden": m.hidden})),
]}


def register_module_type(fmt: str, kind: ModuleType) -> None:
    """Let ``low_precision`` swap another module type (e.g. a model's own expert block)."""
    FORMATS.setdefault(fmt, []).append(kind)


def _kind_of(fmt: str, module: nn.Module) -> ModuleType:
    """The most specific registered type of ``module`` (earliest in its MRO)."""
    mro = type(module).__mro__
    return min((k for k in FORMATS[fmt] if isinstance(module, k.source)), key=lambda k: mro.index(k.source))


def _globs(section: Mapping[str, Any], key: str, default: list[str], problems: list[str]) -> tuple[str, ...]:
    globs = section.get(key, default)
    if not isinstance(globs, (list, tuple)):
        problems.append(f"low_precision.{key} must be a list of module-name globs, got {globs!r}")
        return ()
    problems += [f"low_precision.{key}: bad glob {p}" for p in map(glob_problem, globs) if p]
    return tuple(globs)


def low_precision_rules(section: Mapping[str, Any] | None) -> list[Rule]:
    """The replacement rules of a ``low_precision`` section (none when absent or format ``none``)."""
    section = dict(section or {})
    problems = [f"low_precision: unknown key {k!r} (known: {', '.join(KEYS)})" for k in section if k not in KEYS]
    fmt = section.get("format", section.get("linear", "none"))
    if "format" in section and "linear" in section and section["format"] != section["linear"]:
        problems.append(f"low_precision: format {section['format']!r} and linear {section['linear']!r} disagree")
    if fmt != "none" and fmt not in FORMATS:
        problems.append(f"low_precision.format: unknown format {fmt!r} (known: none, {', '.join(FORMATS)})")
    mode = section.get("scale_mode", "floor")
    if mode not in SCALE_MODES:
        problems.append(f"low_precision.scale_mode: unknown mode {mode!r} (known: {', '.join(SCALE_MODES)})")
    include = _globs(section, "include", ["*"], problems)
    exclude = _globs(section, "exclude", [], problems)
    if problems:
        raise ConfigError("\n".join(problems))
    if fmt == "none":
        return []
    kinds = FORMATS[fmt]
    return [Rule(f"low_precision {fmt}", tuple(k.source for k in kinds),
                 lambda m: _kind_of(fmt, m).build(m, mode), include, exclude,
                 check=lambda m: _kind_of(fmt, m).check(m), skip=tuple(k.target for k in kinds))]


def apply_low_precision(model: nn.Module, section: Mapping[str, Any] | None) -> list[Replacement]:
    """Swap the modules the section selects; all problems raise one ConfigError, model unchanged."""
    return ReplacementPlan(low_precision_rules(section)).apply(model)
