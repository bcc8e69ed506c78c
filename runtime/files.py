"""Files megaloom reads and writes: atomic writes, versioned msgpack, YAML.

Every file megaloom writes goes through :func:`atomic_write`, so a crash mid-write leaves
the earlier file intact, and the new file gets the mode a plain ``open()`` would give it
(the umask applies; an overwritten file keeps its mode). Every versioned msgpack file is
read through :func:`read_msgpack`, which turns any failure into one named error.
"""
from __future__ import annotations

import gc
import os
import re
import tempfile
from contextlib import contextmanager
from typing import IO, Any, Iterator

import msgpack
import yaml

from megaloom.runtime.errors import ConfigError, FileFormatError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, then rename over it.

    The new file's mode is the existing file's mode, or ``0o666`` less the umask.
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def gc_paused(pause: bool = True) -> Iterator[None]:
    """Keep Python's cyclic garbage collector off inside the block (reference counting still
    frees memory): making or reading millions of small objects otherwise triggers collections
    that each walk the whole heap, several times the work itself."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


def read_msgpack(path: str | os.PathLike, fmt: str, version: int,
                 error: type[FileFormatError] = FileFormatError) -> dict[str, Any]:
    """Decode a versioned megaloom msgpack file; every failure raises ``error`` naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from e
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        hint = " (it looks like JSON; megaloom writes its own files as msgpack)" if raw[:1] in (b"{", b"[") else ""
        raise error(f"{path}: not a valid msgpack file ({type(e).__name__}: {e}){hint}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise error(f"{path}: not a {fmt} file")
    v = data.get("version")
    if not isinstance(v, int) or v < 1:
        raise error(f"{path}: missing or bad schema version {v!r}")
    if v > version:
        raise error(f"{path}: schema version {v} is newer than this megaloom reads ({version})")
    return data


class _Loader(yaml.SafeLoader):
    """Safe YAML loading that also reads YAML 1.2 floats: ``1e-3`` is a number, not a string."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def parse_yaml(text: str | IO[str]) -> Any:
    """Parse YAML safely (no python tags) with YAML 1.2 floats; ``yaml.YAMLError`` on bad text."""
    return yaml.load(text, _Loader)


def load_yaml(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a YAML file; an unreadable or malformed file raises ConfigError naming it and ``what``."""
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            return parse_yaml(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: {what} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {what} is not valid YAML: {e}") from None
