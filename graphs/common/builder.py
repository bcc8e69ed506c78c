"""One graph factory per family (MegaMoE, MegaGate, MegaMHC): its forward and backward
builders picked by direction, from a spec or from plain options.

    MEGAGATE.build(spec, "bwd")                        # a spec in, one direction's graph out
    MEGAGATE.from_options({"tokens": 4096, ...})       # plain options (spec fields and extras)
    MEGAGATE("gate.yaml", direction="bwd", tokens=8)   # the ``simulate --graph megagate:...`` entry point

A family object is what the ``megaloom.graph_builders`` entry points name; :data:`GRAPH_BUILDERS`
holds every builder that ``megaloom simulate --graph NAME[:k=v,...]`` and ``megaloom graphs`` know.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from megaloom.graphs.common.spec import load_options, parse_spec
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.plugins import Registry

DIRECTIONS = ("fwd", "bwd")
GRAPH_BUILDERS: Registry[Callable[..., TaskGraph]] = Registry("graph builder", "megaloom.graph_builders")
"""Named ``builder(**options) -> TaskGraph`` callables (a :class:`GraphBuilder`, or any function), plug-ins
from the ``megaloom.graph_builders`` entry points included."""


def register_graph_builder(name: str, builder: Callable[..., TaskGraph]) -> None:
    """Make ``megaloom simulate --graph NAME[:k=v,...]`` call ``builder(**options)``."""
    GRAPH_BUILDERS.register(name, builder, replace=True)


class GraphBuilder:
    """A family's builders, ``forward(spec, *args, **kw)`` and ``backward(spec, *args, **kw)``.

    ``name``: the builder's registered name and YAML key; ``label``: how messages name the
    family; ``spec``: its spec dataclass. :attr:`extras` are the options the family takes
    besides the spec's fields, with their defaults; :meth:`args` turns them into the
    builders' positional and keyword arguments after the spec (a subclass overrides both).
    """

    extras: dict[str, Any] = {"direction": "fwd"}

    def __init__(self, name: str, label: str, spec: type, forward: Callable[..., TaskGraph],
                 backward: Callable[..., TaskGraph]):
        self.name, self.label, self.spec = name, label, spec
        self.builders = dict(zip(DIRECTIONS, (forward, backward)))

    @property
    def doc(self) -> str:
        """What the family builds: the docstring of its builders' module (``megaloom graphs`` lists it)."""
        return sys.modules[self.builders["fwd"].__module__].__doc__ or ""

    def build(self, spec: Any, direction: str = "fwd", *args: Any, **kw: Any) -> TaskGraph:
        """The ``direction`` (``fwd`` or ``bwd``) graph of ``spec``."""
        if direction not in self.builders:
            raise ConfigError(f"{self.label}: direction must be 'fwd' or 'bwd', got {direction!r}")
        return self.builders[direction](spec, *args, **kw)

    def args(self, spec: Any, extras: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The builders' positional arguments after the spec and keyword arguments, from the extra
        options (none here)."""
        return (), {}

    def from_options(self, options: Mapping[str, Any]) -> TaskGraph:
        """A graph from plain options: the spec's fields plus :attr:`extras`."""
        opts = dict(options)
        extras = {k: opts.pop(k, v) for k, v in self.extras.items()}
        spec = parse_spec(self.spec, opts, what=self.label, also=self.extras)
        args, kw = self.args(spec, extras)
        return self.build(spec, extras["direction"], *args, **kw)

    def __call__(self, spec: str | None = None, direction: str | None = None, **options: Any) -> TaskGraph:
        """``megaloom simulate --graph NAME[:direction=bwd,k=v,...]``: ``spec`` is a YAML file of
        options (at top level or under a ``NAME:`` key), ``options`` override it."""
        if direction is not None:
            options["direction"] = direction
        with self.named():
            return self.from_options(load_options(spec, self.name, options))

    @contextmanager
    def named(self) -> Iterator[None]:
        """Prefix a ConfigError raised inside with ``graph builder NAME:`` (command-line errors say which)."""
        try:
            yield
        except ConfigError as e:
            raise ConfigError(f"graph builder {self.name!r}: {e}") from None

    def __repr__(self) -> str:
        return f"<{self.label} graph builder {self.name!r}>"

