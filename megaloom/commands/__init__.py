"""CLI subcommands, one module each."""
from __future__ import annotations

from typing import Any, Callable

from megaloom.runtime.errors import ConfigError


def write_file(write: Callable[..., Any], obj: Any, path: str, **kw: Any) -> None:
    """``write(obj, path, **kw)``; an unwritable path becomes a ConfigError naming it (exit 2)."""
    try:
        write(obj, path, **kw)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e


def require_positive(args: Any, *names: str) -> None:
    """ConfigError naming every ``--option`` among ``names`` whose value is set and not > 0."""
    bad = [f"--{n.replace('_', '-')} must be > 0, got {getattr(args, n)}" for n in names
           if getattr(args, n) is not None and getattr(args, n) <= 0]
    if bad:
        raise ConfigError("; ".join(bad))
