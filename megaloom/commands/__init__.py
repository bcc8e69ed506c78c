"""CLI subcommands, one module each."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

from megaloom.runtime.errors import ConfigError


def write_file(write: Callable[..., Any], obj: Any, path: str, **kw: Any) -> None:
    """``write(obj, path, **kw)``; an unwritable path becomes a ConfigError naming it (exit 2)."""
    try:
        write(obj, path, **kw)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e


def pairs(items: list[str] | None, what: str, key: Callable[[str], Any] = str,
          value: Callable[[str], Any] = float) -> dict:
    """``KEY=VALUE`` items of option ``what`` (repeated or comma-separated); a bad one raises ConfigError."""
    out = {}
    for item in (x for text in items or () for x in text.split(",") if x.strip()):
        k, sep, v = item.partition("=")
        try:
            if not sep or not k.strip():
                raise ValueError(item)
            out[key(k.strip())] = value(v.strip())
        except ValueError:
            raise ConfigError(f"bad {what} {item!r}: expected {what.lstrip('-').upper()}=VALUE") from None
    return out


def require_positive(args: Any, *names: str) -> None:
    """ConfigError naming every ``--option`` among ``names`` whose value is set and not > 0."""
    bad = [f"--{n.replace('_', '-')} must be > 0, got {getattr(args, n)}" for n in names
           if getattr(args, n) is not None and getattr(args, n) <= 0]
    if bad:
        raise ConfigError("; ".join(bad))


@contextlib.contextmanager
def stop_signals(on_stop: Callable[[int], None]) -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM call ``on_stop(signum)`` and are added to the yielded list; the
    previous handlers come back after it. Outside the main thread (which alone may handle signals) nothing changes."""
    stopped_by: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        stopped_by.append(signum)
        on_stop(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        yield stopped_by
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
