"""Registries of named things (ops, graph builders, policies, executors, profiles, formats)
and the one ``name:key=value,...`` spec syntax that picks them on the command line.

A :class:`Registry` maps names to objects, loads plug-ins from an entry-point group the
first time a name is missing, and reports an unknown name with the names it knows.
"""
from __future__ import annotations

import inspect
import sys
import types
from importlib.metadata import entry_points
from typing import Any, Generic, Iterator, TypeVar

from megaloom.runtime.errors import ConfigError, MegaloomError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named ``T`` objects of one kind (``what``: "op", "policy", ...).

    ``group`` is an entry-point group: an entry point that loads a module registers what the
    module registers on import; one that loads an object is registered under its own name.
    """

    def __init__(self, what: str, group: str | None = None, error: type[MegaloomError] = ConfigError):
        self.what, self.group, self.error = what, group, error
        self._items: dict[str, T] = {}
        self._loaded = group is None

    def register(self, name: str, obj: T | None = None, *, replace: bool = False) -> Any:
        """Add ``obj`` as ``name`` (or decorate: ``@reg.register("name")``); returns ``obj``.

        A second, different object under a taken name needs ``replace=True``.
        """
        if obj is None:
            return lambda o: self.register(name, o, replace=replace)
        old = self._items.get(name)
        if old is not None and old is not obj and not replace:
            raise self.error(f"{self.what} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def _load_plugins(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for ep in entry_points(group=self.group):
            obj = ep.load()
            if not isinstance(obj, types.ModuleType):
                self._items.setdefault(ep.name, obj)

    def get(self, name: str) -> T:
        """The object registered as ``name``; an unknown name raises ``error`` listing the known ones."""
        if name not in self._items:
            self._load_plugins()
            if name not in self._items:
                raise self.error(f"unknown {self.what} {name!r}; known: {', '.join(self.names()) or 'none'}")
        return self._items[name]

    def names(self) -> list[str]:
        """Every registered name, plug-ins included, sorted."""
        self._load_plugins()
        return sorted(self._items)

    def items(self) -> dict[str, T]:
        self._load_plugins()
        return dict(self._items)

    def __contains__(self, name: str) -> bool:
        self._load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def describe(self) -> dict[str, str]:
        """Every name with a one-line description of its object (see :func:`describe`)."""
        return {name: describe(obj) for name, obj in sorted(self.items().items())}


def _paragraph(text: str | None) -> str:
    first = inspect.cleandoc(text or "").split("\n\n")[0]
    return " ".join(first.split()).replace("``", "")


def describe(obj: Any) -> str:
    """One line about a registered object: its ``doc`` text (an op's), else the first
    paragraph of its docstring; a plug-in function (a graph builder) is described by its
    module's docstring, since the module is what it builds."""
    doc = getattr(obj, "doc", None)
    if not isinstance(doc, str):
        module = sys.modules.get(obj.__module__) if inspect.isfunction(obj) else None
        doc = (module.__doc__ if module else None) or inspect.getdoc(obj)
    return _paragraph(doc)


def _value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_options(text: str, what: str = "option") -> dict[str, Any]:
    """``"k=v,k2=v2"`` as ``{"k": v, ...}``; numbers and booleans converted. A malformed
    item raises ConfigError naming it as a bad ``what``."""
    opts: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"bad {what} {item!r} in {text!r}: expected key=value")
        opts[k.strip()] = _value(v.strip())
    return opts


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:k=v,k2=v2"`` as ``("name", {"k": v, ...})``; numbers and booleans converted."""
    name, _, rest = spec.partition(":")
    if not name.strip():
        raise ConfigError(f"bad spec {spec!r}: expected name[:key=value,...]")
    return name.strip(), parse_options(rest)
