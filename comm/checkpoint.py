"""Checkpoints of uneven shards through ``torch.distributed.checkpoint`` (DCP).

Each sharded tensor is saved as DCP chunks: the global shape once, and per shard its
row offset and real size, so standard tooling reads it (``dcp_to_torch_save`` gives
the full state dict) and a load at another world size reads exactly the rows each
rank's new shard covers (save on 4 ranks, load on 3 or 2, bit-exact).

Keys: ``model.<param>`` for parameters (shards, or whole when replicated) and buffers,
``optim.state.<param>.<state>`` for optimizer state (sharded like its parameter when it has
the shard's shape, else replicated): the layout ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` gives a model and optimizer saved as ``{"model": ..., "optim": ...}``.
:func:`save_params` / :func:`load_params` take a ``{name: (local tensor, layout or None)}``
map (the trainer's whole model: expert-parallel slices, replicated weights; DTensors, such
as FSDP2 and tensor-parallel parameters, carry their own layout and are written and read as
the chunks they hold). ``extra`` is one small msgpack value per rank (step, RNG states, ...),
saved as ``megaloom.extra`` inside the same atomic save and returned as ``manifest["extra"]``.

Safety. DCP writes into ``<path>.partial``; rank 0 then adds ``megaloom.manifest``
(msgpack: layouts, DCP's metadata, and the size and SHA-256 of every file) and swaps the
folder in with two renames (old -> ``<path>.old``, new -> ``<path>``). At every moment
``<path>`` or ``<path>.old`` is a complete checkpoint (:func:`load_params` falls back to
``<path>.old`` when ``<path>`` is missing); the next save first puts such an ``.old`` back
and removes leftovers (``.partial``, a stale ``.old``). Before anything reads a file,
:func:`verify` checks the folder against the manifest: every file listed, none other
present, every name a plain file name inside the folder, every size and hash matching.
Nothing is unpickled: DCP's ``.metadata`` (a pickle, kept for standard tools) is never
opened; DCP gets its metadata from the manifest (:mod:`megaloom.comm.dcp_meta`) and reads
chunks with ``torch.load(weights_only=True)``. Every failure is a :class:`CheckpointError`
(a dead peer: :class:`CommError`). The manifest guards against corruption and against files
that are not what it lists, not against someone who rewrites both consistently.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import re
import shutil
import stat
import warnings
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner, DefaultSavePlanner, create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megaloom.comm import dcp_meta
from megaloom.comm.sharding import ShardLayout
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import CheckpointError, CommError, FileFormatError, GraphError, MegaloomError
from megaloom.runtime.files import atomic_write, read_msgpack

MANIFEST, EXTRA = "megaloom.manifest", "megaloom.extra"
OPTIM = "optim.state."  # optimizer state keys: optim.state.<param>.<state>, as torch's get_state_dict names them
FORMAT, VERSION = "megaloom-checkpoint", 2  # 2: DCP metadata in the manifest (1 relied on DCP's pickle)
MAX_MANIFEST = 256 << 20
_FILE_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

Params = dict[str, tuple[torch.Tensor, ShardLayout | None]]  # name -> (local tensor, its layout; None: replicated)


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP warns that it assumes one process; a world of one is meant."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield

def _chunk(lay: ShardLayout) -> ChunkStorageMetadata:
    offsets = torch.Size([lay.offset] + [0] * (len(lay.shape) - 1))
    return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(lay.local_shape))


class _SavePlanner(DefaultSavePlanner):
    """Sharded entries become SHARD write items at their row offset; the rest as usual."""

    def __init__(self, layouts: dict[str, ShardLayout]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.layouts = layouts

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self.layouts}
        items = list(create_default_local_save_plan(rest, self.is_coordinator).items)
        for fqn, lay in self.layouts.items():
            t = self.state_dict[fqn]
            chunk = _chunk(lay)
            items.append(WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                                                               size=torch.Size(lay.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        t = self.state_dict[index.fqn]
        return t.to_local() if isinstance(t, DTensor) else t


class _LoadPlanner(DefaultLoadPlanner):
    """Each rank reads the saved chunks that overlap its own shard (any saved layout)."""

    def __init__(self, layouts: dict[str, ShardLayout]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.layouts = layouts

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, t in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            lay = self.layouts.get(fqn)
            shape = lay.shape if lay else tuple(t.shape)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "nothing"
                raise CheckpointError(f"checkpoint entry {fqn!r} holds {got}, the model expects {shape}")
            chunk = _chunk(lay) if lay else _dtensor_chunk(t) if isinstance(t, DTensor) else \
                ChunkStorageMetadata(torch.Size([0] * t.dim()), t.shape)
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        t = self.state_dict[index.fqn]
        return t.to_local() if isinstance(t, DTensor) else t


def _dtensor_chunk(t: DTensor) -> ChunkStorageMetadata:
    """Where this rank's piece of a DTensor (FSDP2 or tensor-parallel shard, or a replica) lies."""
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))


def state_of(params: Params, optimizer: torch.optim.Optimizer | None = None
             ) -> tuple[dict[str, torch.Tensor], dict[str, ShardLayout]]:
    """The flat state dict of local tensors (views, not copies) and the layout of each sharded key."""
    state: dict[str, torch.Tensor] = {}
    layouts: dict[str, ShardLayout] = {}
    for fqn, (t, lay) in params.items():
        state[f"model.{fqn}"] = t.detach()
        if lay is not None:
            layouts[f"model.{fqn}"] = lay
        if optimizer is None:
            continue
        for key, v in optimizer.state.get(t, {}).items():
            if isinstance(v, torch.Tensor):
                state[f"{OPTIM}{fqn}.{key}"] = v.detach()
                if lay is not None and v.dim() and tuple(v.shape) == lay.local_shape:
                    layouts[f"{OPTIM}{fqn}.{key}"] = lay
    return state, layouts


def save_params(path: str | os.PathLike, comm: Any, params: Params, optimizer: torch.optim.Optimizer | None = None,
                extra: Any = None) -> None:
    """Save ``params`` (and their ``optimizer`` state) atomically; ``extra``: this rank's msgpack value. A collective."""
    path = os.fspath(path)
    tmp = path + ".partial"
    state, layouts = state_of(params, optimizer)
    if comm.rank == 0:
        _prepare(path, tmp)
    comm.barrier()
    try:
        with _single_process_ok():
            md = _dcp_call(f"{path}: saving", lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner(layouts),
                process_group=getattr(comm, "group", None) if dist.is_initialized() else None))
        shards = comm.exchange({k: [lay.offset, lay.size] for k, lay in layouts.items()})
        extras = comm.exchange(extra, "checkpoint extra") if extra is not None else None
        if comm.rank == 0:
            _write_manifest(tmp, comm.world_size, state, layouts, shards, extras, md)
            _install(path, tmp)
    except Exception as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the next save would remove it too
        if isinstance(e, OSError):
            full = " (disk full)" if e.errno == errno.ENOSPC else ""
            raise CheckpointError(f"{path}: cannot write the checkpoint{full}: {e}") from e
        raise
    comm.barrier()


def _prepare(path: str, tmp: str) -> None:
    """Make room for a save: put back an ``.old`` left by a save that died between its
    renames (then it is the only complete checkpoint), drop other leftovers."""
    old = path + ".old"
    try:
        if os.path.isdir(old) and not os.path.exists(path):
            os.replace(old, path)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot prepare the checkpoint folder: {e}") from e


def _write_manifest(tmp: str, world_size: int, state: dict[str, torch.Tensor], layouts: dict[str, ShardLayout],
                    shards: list[dict], extras: list | None, md: Any) -> None:
    if extras is not None:
        atomic_write(os.path.join(tmp, EXTRA), msgpack.packb(extras, use_bin_type=True))
    tensors = {k: {"shape": list(t.shape) if k not in layouts else list(layouts[k].shape),
                   "dtype": dtype_name(t.dtype),
                   "shards": [s[k] for s in shards] if k in layouts else None} for k, t in state.items()}
    files = {n: _digest(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
    atomic_write(os.path.join(tmp, MANIFEST), msgpack.packb(
        {"format": FORMAT, "version": VERSION, "world_size": world_size, "tensors": tensors, "files": files,
         "dcp": dcp_meta.encode(md)}, use_bin_type=True))


def _install(path: str, tmp: str) -> None:
    """Swap the new checkpoint in; ``<path>`` or ``<path>.old`` is complete at every step."""
    old = path + ".old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _dcp_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run a DCP save or load. DCP reports each rank's own failure as a CheckpointException
    (no Exception subclass): it becomes CheckpointError (a megaloom error raised inside DCP
    keeps its type). Anything else escaping DCP in a process group came from its collectives,
    so a peer died: CommError."""
    try:
        return fn()
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for c in causes:
            if isinstance(c, MegaloomError) or not isinstance(c, Exception):  # or KeyboardInterrupt on a rank
                raise c from None
        disk_full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes)
        ranks = "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, c in zip(e.failures, causes))
        raise CheckpointError(f"{what} failed{' (disk full)' if disk_full else ''}: {ranks}") from None
    except (MegaloomError, OSError):
        raise
    except Exception as e:
        if dist.is_initialized():
            raise CommError(f"{what} failed, a peer is gone: {type(e).__name__}: {str(e).splitlines()[0]}") from e
        raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e


def _digest(path: str) -> list[Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return [os.path.getsize(path), h.hexdigest()]


def _open_plain(path: str):
    """Open a regular file for reading, refusing a symbolic link in its place."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return os.fdopen(fd, "rb")


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's manifest, after checking the folder against it: every file listed,
    nothing else present, every size and SHA-256 matching, DCP's metadata well formed
    (kept as ``manifest["metadata"]``)."""
    path = os.fspath(path)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path = path + ".old"  # a crash between the two renames of save()
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no checkpoint there")
    man = _read_manifest(path)
    files: dict[str, Any] = man["files"]
    try:
        present = {e.name: e for e in os.scandir(path) if e.name != MANIFEST}
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the checkpoint folder: {e.strerror}") from None
    for name, entry in sorted(present.items()):
        if name not in files:
            raise CheckpointError(f"{path}: file {name!r} is not listed in the manifest (refused)")
        if not entry.is_file(follow_symlinks=False):
            raise CheckpointError(f"{path}: {name!r} is not a regular file (a link or a folder; refused)")
    for name, (size, digest) in files.items():
        if name not in present:
            raise CheckpointError(f"{path}: file {name!r} is missing")
        try:
            with _open_plain(os.path.join(path, name)) as f:
                got = os.fstat(f.fileno()).st_size
                if got != size:
                    raise CheckpointError(f"{path}: file {name!r} has {got} bytes, expected {size} (truncated?)")
                h = hashlib.sha256()
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read file {name!r}: {e.strerror or e}") from None
        if h.hexdigest() != digest:
            raise CheckpointError(f"{path}: file {name!r} does not match its SHA-256 in the manifest (tampered?)")
    data = {n: size for n, (size, _) in files.items() if n not in (EXTRA, ".metadata")}
    man["metadata"] = md = dcp_meta.decode(man.get("dcp"), data, path)
    for k, t in man["tensors"].items():
        m = md.state_dict_metadata.get(k)
        if m is None or list(m.size) != t["shape"] or m.properties.dtype != torch_dtype(t["dtype"]):
            raise CheckpointError(f"{path}: manifest entry {k!r} disagrees with DCP's metadata")
    man["path"] = path
    return man


def _read_manifest(path: str) -> dict[str, Any]:
    """The manifest with its file and tensor tables checked field by field."""
    f = os.path.join(path, MANIFEST)
    try:
        if os.path.islink(f) or os.path.getsize(f) > MAX_MANIFEST:
            raise CheckpointError(f"{path}: the manifest is a link or larger than {MAX_MANIFEST} bytes")
        man = read_msgpack(f, FORMAT, VERSION)
    except (OSError, FileFormatError) as e:
        raise CheckpointError(f"{path}: bad or missing manifest: {e}") from None
    if man["version"] < VERSION:
        raise CheckpointError(f"{path}: checkpoint format {man['version']} is read through a pickle, which megaloom "
                              f"no longer opens; save it again with this version")
    files, tensors = man.get("files"), man.get("tensors")
    if not isinstance(files, dict) or not files or not isinstance(tensors, dict):
        raise CheckpointError(f"{path}: manifest lacks its file or tensor table")
    for name, want in files.items():
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", "..", MANIFEST):
            raise CheckpointError(f"{path}: manifest lists {name!r}, which is not a plain file name in the folder")
        if not (isinstance(want, list) and len(want) == 2 and isinstance(want[0], int) and want[0] >= 0
                and isinstance(want[1], str) and _SHA256.fullmatch(want[1])):
            raise CheckpointError(f"{path}: manifest entry of file {name!r} is malformed")
    for k, t in tensors.items():
        ok = isinstance(k, str) and isinstance(t, dict) and isinstance(t.get("shape"), list) \
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in t["shape"])
        try:
            ok = ok and bool(torch_dtype(t.get("dtype")))
        except GraphError:
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: manifest entry of tensor {k!r} is malformed")
    return man


def load_params(path: str | os.PathLike, comm: Any, params: Params, optimizer: torch.optim.Optimizer | None = None
                ) -> dict[str, Any]:
    """Load into ``params`` (any saved world size and layout); returns the manifest, with ``extra``:
    the list of every saving rank's extra value (None if none was saved). A collective."""
    man: dict[str, Any] | None = None
    err = ""
    try:
        man = verify(path)
        man["extra"] = _read_extra(man)
    except CheckpointError as e:
        err = str(e)
    errors = [e for e in comm.exchange(err) if e]
    if errors:
        raise CheckpointError(errors[0])
    assert man is not None
    if optimizer is not None:
        _make_optimizer_state(man["tensors"], params, optimizer)
    state, layouts = state_of(params, optimizer)
    missing = sorted(k for k in state if k not in man["tensors"])
    if missing:
        raise CheckpointError(f"{man['path']}: checkpoint has no entry for {', '.join(missing[:5])}")
    wrong = [f"{k!r} holds {tuple(man['tensors'][k]['shape'])}, the model expects {shape}" for k, t in state.items()
             if tuple(man["tensors"][k]["shape"]) != (shape := layouts[k].shape if k in layouts else tuple(t.shape))]
    if wrong:
        raise CheckpointError(f"{man['path']}: " + "; ".join(wrong[:5]))
    with _single_process_ok():
        _dcp_call(f"{man['path']}: loading", lambda: dcp.load(
            state, storage_reader=dcp_meta.ManifestReader(man["path"], man["metadata"]), planner=_LoadPlanner(layouts),
            process_group=getattr(comm, "group", None) if dist.is_initialized() else None))
    return man


def _read_extra(man: dict[str, Any]) -> Any:
    if EXTRA not in man["files"]:
        return None
    with open(os.path.join(man["path"], EXTRA), "rb") as f:  # its hash was checked by verify()
        raw = f.read()
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise CheckpointError(f"{man['path']}: {EXTRA} is not valid msgpack ({type(e).__name__})") from None


def _make_optimizer_state(tensors: dict[str, Any], params: Params, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state named in the checkpoint, created (zeros) in the shape the new layout gives it.

    No state may be larger than its parameter, so a manifest cannot make this allocate more."""
    for key, info in tensors.items():
        if not key.startswith(OPTIM):
            continue
        fqn, _, name = key[len(OPTIM):].rpartition(".")
        if fqn not in params:
            raise CheckpointError(f"checkpoint entry {key!r} names parameter {fqn!r}, which the model lacks")
        t, lay = params[fqn]
        shape = tuple(info["shape"])
        if math.prod(shape) > max(1, math.prod(lay.shape if lay is not None else t.shape)):
            raise CheckpointError(f"checkpoint entry {key!r} holds {shape}, more than its parameter {fqn!r}")
        if isinstance(t, DTensor) and shape == tuple(t.shape):  # a DTensor like its parameter
            optimizer.state[t][name] = torch.zeros_like(t, dtype=torch_dtype(info["dtype"]))
            continue
        if lay is not None and shape == lay.shape:  # sharded like its parameter (whatever the saved layout)
            shape = lay.local_shape
        optimizer.state[t][name] = torch.zeros(shape, dtype=torch_dtype(info["dtype"]))
