"""Files megaloom reads and writes: atomic writes, versioned msgpack, YAML.

Every file megaloom writes goes through :func:`atomic_write`, so a crash mid-write leaves
the earlier file intact, and the new file gets the mode a plain ``open()`` would give it
(the umask applies; an overwritten file keeps its mode). Every versioned msgpack file is
read through :func:`read_msgpack`, which turns any failure into one named error.
"""
from __future__ import annotations

import ctypes
import gc
import os
import re
import secrets
import stat
import sys
import tempfile
from contextlib import contextmanager
from typing import IO, Any, Iterable, Iterator

import msgpack
import yaml

from megaloom.runtime.errors import ConfigError, FileFormatError


def umask() -> int:
    """The process's file mode creation mask."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` at ``path`` so that a crash leaves the earlier file or the new one, never a part.

    The new file is made beside the target, nameless until complete (``O_TMPFILE``, so a kill
    leaves nothing behind; else a ``.tmp-*`` file), then renamed over it; its mode is the old
    file's, or ``0o666`` less the umask. A link is followed (it stays a link). What is not a
    regular file is never replaced but written directly, as a shell redirection would: ``-``
    (standard output), a FIFO, a device, a terminal, ``/proc/self/fd/1`` of a pipe.
    """
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode if path != "-" else 0  # through links, /proc's too
    except FileNotFoundError:
        mode = stat.S_IFREG | 0o666 & ~umask()
    if not stat.S_ISREG(mode):
        with open(path if path != "-" else os.dup(1), "wb") as f:
            f.write(data)
        return
    target = os.path.realpath(path)
    d, tmp = os.path.dirname(target), None
    try:
        fd = os.open(d, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except (AttributeError, OSError):  # not Linux, or a file system without O_TMPFILE
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(fd, stat.S_IMODE(mode))
            os.fsync(fd)
            if tmp is None:  # give it a temporary name (os.link cannot follow /proc's link)
                tmp = os.path.join(d, f".tmp-{secrets.token_hex(8)}")
                if ctypes.CDLL(None, use_errno=True).linkat(-100, f"/proc/self/fd/{fd}".encode(), -100,
                                                            os.fsencode(tmp), 0x400):  # AT_FDCWD, AT_SYMLINK_FOLLOW
                    raise OSError(ctypes.get_errno(), "cannot link the new file in", tmp)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def check_outputs(outputs: Iterable[str | None], inputs: Iterable[str] = (), force: bool = False) -> None:
    """Refuse (ConfigError) an output that is one of ``inputs`` or, unless ``force``, an existing
    non-empty regular file megaloom did not write: one whose first 64 bytes do not name megaloom
    (its msgpack ``format``, Chrome JSON ``otherData``, PNG ``Software``, text's first line).
    With an output to ``-``, messages go to standard error."""
    outputs = [o for o in outputs if o is not None]
    if "-" in outputs:
        sys.stdout = sys.stderr
    for out in filter(os.path.isfile, outputs):  # what else is at an output path is written, never replaced
        if same := [i for i in inputs if os.path.exists(i) and os.path.samefile(out, i)]:
            raise ConfigError(f"output {out!r} is the input {same[0]!r}; refused (name another output)")
        with open(out, "rb") as f:
            head = f.read(64)
        if not force and head and b"megaloom" not in head:
            raise ConfigError(f"{out!r} exists and megaloom did not write it; refused (--force overwrites it)")


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


MAX_YAML_NODES = 1_000_000


def parse_yaml(text: str | IO[str]) -> Any:
    """Parse YAML safely (no python tags) with YAML 1.2 floats; ``yaml.YAMLError`` on bad text,
    nesting too deep, a recursive alias, or aliases expanding past :data:`MAX_YAML_NODES` nodes."""
    try:
        data = yaml.load(text, _Loader)
        _nodes(data, {})
    except RecursionError:
        raise yaml.MarkedYAMLError(problem="YAML nested too deeply, or a recursive alias") from None
    return data


def _nodes(v: Any, seen: dict[int, int]) -> int:
    """How many nodes ``v`` spans with every alias expanded (a node shared by aliases counts once per
    use, computed once); a recursive alias recurses without end, into a RecursionError."""
    if not isinstance(v, (list, dict)):
        return 1
    if id(v) not in seen:
        seen[id(v)] = 1 + sum(_nodes(x, seen) for x in (v.values() if isinstance(v, dict) else v))
        if seen[id(v)] > MAX_YAML_NODES:
            raise yaml.MarkedYAMLError(problem=f"YAML aliases expand past {MAX_YAML_NODES} nodes (an alias bomb?)")
    return seen[id(v)]


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
