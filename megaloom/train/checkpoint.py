"""Training checkpoints in the comm layer's DCP format (:mod:`megaloom.comm.checkpoint`).

Layout: ``<dir>/step_<k>/`` is one DCP checkpoint (written atomically, SHA-256
manifest) holding every parameter, persistent buffer and optimizer state tensor as a
global tensor (FSDP shards and expert-parallel slices as chunks at their row offsets),
so it loads at any world size and parallel layout. The trainer's own state rides in
the same atomic save as ``megaloom.extra`` (msgpack, one entry per saving rank: step,
world size, CPU RNG state, the data stream's position). The lr schedule is a function of the step.
``<dir>/latest.json`` names the newest complete step; it is written after every rank
saved, so a crash mid-save leaves the previous checkpoint the latest.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from megaloom.runtime.errors import CheckpointError, ConfigError
from megaloom.runtime.files import atomic_write

LATEST = "latest.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def save(root: str, step: int, parallel: Any, optimizer: torch.optim.Optimizer, keep: int,
         state: dict[str, Any] | None = None) -> str:
    """Save model, optimizer and trainer state of ``step`` (with ``state``: more msgpack-able entries of it;
    a collective), mark it latest, prune; returns its directory."""
    from megaloom.comm.checkpoint import save_params  # imports torch.distributed.checkpoint

    path, comm = step_dir(root, step), parallel.comm
    extra = {"step": step, "world_size": comm.world_size, "rng": torch.get_rng_state().numpy().tobytes(),
             **(state or {})}
    save_params(path, comm, parallel.checkpoint_params(), optimizer, extra)
    if comm.rank == 0:
        mark_latest(root, step, comm.world_size, keep)
    comm.barrier()
    return path


def load(path: str, parallel: Any, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Load a step directory saved at any world size into ``parallel``'s model and ``optimizer`` (a collective).

    Restores this rank's RNG state (rank ``r`` of a run resumed at another world size
    takes saved rank ``r mod W_saved``'s) and returns the saved step and trainer state.
    """
    from megaloom.comm.checkpoint import load_params

    man = load_params(path, parallel.comm, parallel.checkpoint_params(), optimizer)
    extras = man["extra"]
    if not isinstance(extras, list) or not extras or not all(isinstance(e, dict) for e in extras):
        raise CheckpointError(f"{man['path']}: not a training checkpoint (no trainer state in it)")
    mine = extras[parallel.comm.rank % len(extras)]
    torch.set_rng_state(torch.frombuffer(bytearray(mine["rng"]), dtype=torch.uint8))
    return int(mine["step"]), mine


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
