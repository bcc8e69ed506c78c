"""Training checkpoints: model, optimizer, RNG and data position, one file per rank.

Layout: ``<dir>/step_<k>/rank<r>.pt`` (``torch.save`` of tensors, numbers and strings
only; read back with ``weights_only=True``, never unpickled) and ``<dir>/latest.json``
naming the newest complete step, written last (atomically) once every rank has saved,
so a crash mid-save leaves the previous checkpoint the latest.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from typing import Any

import torch

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.trace import atomic_write

LATEST = "latest.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def save_rank(root: str, step: int, rank: int, state: dict[str, Any]) -> str:
    """Write this rank's state for ``step``; returns the file path."""
    d = step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    path = os.path.join(d, f"rank{rank}.pt")
    atomic_write(path, buf.getvalue())
    return path


def mark_latest(root: str, step: int, world_size: int, keep: int) -> None:
    """Point ``latest.json`` at ``step`` (call after every rank saved), then prune old steps."""
    atomic_write(os.path.join(root, LATEST), json.dumps({"step": step, "world_size": world_size}).encode())
    steps = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())
    for old in steps[:-keep]:
        if old != step:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def find(resume: bool | str, root: str) -> str | None:
    """The step directory to resume from: ``True`` -> latest in ``root`` (None if there is none), a path -> it."""
    if resume is False:
        return None
    if isinstance(resume, str):
        if os.path.isfile(os.path.join(resume, LATEST)):
            return find(True, resume)
        if not os.path.isdir(resume):
            raise ConfigError(f"checkpoint.resume: {resume!r} is not a checkpoint directory")
        return resume
    latest = os.path.join(root, LATEST)
    if not os.path.exists(latest):
        return None
    try:
        with open(latest, encoding="utf-8") as f:
            step = int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint: {latest} is unreadable ({e}); pass checkpoint.resume=<step dir>") from None
    return step_dir(root, step)


def load_rank(path: str, rank: int) -> dict[str, Any]:
    """This rank's state from a step directory (safe load: tensors and plain data only)."""
    f = os.path.join(path, f"rank{rank}.pt")
    if not os.path.exists(f):
        have = sorted(n for n in os.listdir(path) if n.endswith(".pt")) if os.path.isdir(path) else []
        raise ConfigError(f"checkpoint.resume: {path} has no state for rank {rank} (files: {have or 'none'}); "
                          "resume with the world size the checkpoint was saved with")
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types on corrupt files
        raise ConfigError(f"checkpoint.resume: {f} is corrupt or not a megaloom checkpoint ({type(e).__name__}: {e})") from None
