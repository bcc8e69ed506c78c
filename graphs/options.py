"""Graph-builder options from a YAML file plus overrides (the ``simulate --graph`` entry points)."""
from __future__ import annotations

from typing import Any, Mapping

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import load_yaml


def load_options(path: str | None, key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Options from the YAML file ``path`` (at top level or under ``key``), then ``overrides``.

    An unreadable file or a document that is not a mapping raises ConfigError naming the file.
    """
    opts: dict[str, Any] = {}
    if path is not None:
        data = load_yaml(path, f"{key} spec") or {}
        data = data.get(key, data) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise ConfigError(f"{key} spec {path!r}: must hold a mapping of options")
        opts.update(data)
    opts.update(overrides)
    return opts
