"""Graph specs from options: one parser that reports every problem at once.

Options come as a mapping (``k=v`` options on the command line, a YAML section, keyword
arguments of a module); :func:`parse_spec` makes the spec dataclass of them. Every unknown,
missing or mistyped option goes into one ConfigError; well-formed options then meet the
spec's own value checks (its ``__post_init__``, with the helpers below), again every bad
value in one ConfigError: ``invalid <Spec>: <problem>; <problem>; ...``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, TypeVar

from megaloom.graphs.common.ops import acc_dtype
from megaloom.runtime.dtypes import dtype_name
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import load_yaml

S = TypeVar("S")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_spec(cls: type[S], data: Mapping[str, Any], *, what: str = "", also: Iterable[str] = ()) -> S:
    """The spec dataclass ``cls`` from ``data``; every unknown, missing and mistyped option in one
    ConfigError (then the spec's own checks). ``also``: further option names the caller takes
    (listed as known); ``what`` names the family in the unknown-option message."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    problems, kwargs = [], {}
    unknown = [k for k in data if k not in names]
    if unknown:
        refused = f" (unknown {what} options are refused)" if what else ""
        problems.append(f"unknown option(s) {', '.join(map(str, unknown))}{refused}; "
                        f"known: {', '.join([*names, *also])}")
    for key, value in data.items():
        if key not in names:
            continue
        kind = type(names[key].default) if names[key].default is not dataclasses.MISSING else int
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"option {key!r} must be {kind.__name__}, got {value!r}")
        kwargs[key] = value
    missing = [n for n, f in names.items() if f.default is dataclasses.MISSING and n not in kwargs]
    if missing:
        problems.append(f"missing option(s) {', '.join(missing)}")
    report(cls.__name__, problems)
    return cls(**kwargs)


class GraphSpec:
    """Base of the families' spec dataclasses (frozen, with a ``dtype`` field)."""

    __slots__ = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """From CLI options, a YAML section or keyword arguments (:func:`parse_spec`)."""
        return parse_spec(cls, data)

    @property
    def acc(self) -> str:
        """Accumulation dtype of the spec's dtype: float64 stays, everything else is float32."""
        return acc_dtype(self.dtype)  # type: ignore[attr-defined]


def report(what: str, problems: list[str]) -> None:
    """Raise ConfigError ``invalid <what>: <problems>`` when there are any."""
    if problems:
        raise ConfigError(f"invalid {what}: " + "; ".join(problems))


def positive(spec: Any, *names: str) -> list[str]:
    """A problem for each named field that is not a positive integer."""
    return [f"{n} must be a positive integer, got {getattr(spec, n)!r}" for n in names
            if not isinstance(getattr(spec, n), int) or isinstance(getattr(spec, n), bool) or getattr(spec, n) <= 0]


def bools(spec: Any, *names: str) -> list[str]:
    """A problem for each named field that is not a bool."""
    return [f"{n} must be a bool, got {getattr(spec, n)!r}" for n in names if not isinstance(getattr(spec, n), bool)]


def dtype_problems(spec: Any) -> list[str]:
    """Set ``spec.dtype`` to its canonical name; a problem unless it is one of :data:`DTYPES`."""
    try:
        object.__setattr__(spec, "dtype", dtype_name(spec.dtype))
    except Exception as e:  # noqa: BLE001  (reported as a config problem)
        return [str(e)]
    return [] if spec.dtype in DTYPES else [f"dtype must be one of {DTYPES}, got {spec.dtype!r}"]


def load_options(path: str | None, key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Options from the YAML file ``path`` (at top level or under ``key``), then ``overrides``.

    An unreadable file or a document that is not a mapping raises ConfigError naming the file.
    """
    data = {} if path is None else load_yaml(path, f"{key} spec") or {}
    data = data.get(key, data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ConfigError(f"{key} spec {path!r}: must hold a mapping of options")
    return {**data, **overrides}
