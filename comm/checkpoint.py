"""Checkpoints of uneven shards through ``torch.distributed.checkpoint`` (DCP).

Each sharded tensor is saved as DCP chunks: the global shape once, and per shard its
row offset and real size, so standard tooling reads it (``dcp_to_torch_save`` gives
the full state dict) and a load at another world size reads exactly the rows each
rank's new shard covers (save on 4 ranks, load on 3 or 2, bit-exact).

Keys: ``model.<param>`` for parameters (shards, or whole when replicated) and buffers,
``optim.state.<param>.<state>`` for optimizer state (sharded like its parameter when it has
the shard's shape, else replicated): the layout ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` gives a model and optimizer saved as ``{"model": ..., "optim": ...}``. :func:`save` / :func:`load` take a ShardedModule;
:func:`save_params` / :func:`load_params` take any ``{name: (local tensor, layout or
None)}`` map (the trainer's whole model: FSDP shards, expert-parallel slices, replicated
weights). ``extra`` is one small msgpack value per rank (step, RNG states, ...), saved as
``megaloom.extra`` inside the same atomic save and returned as ``manifest["extra"]``.

Safety. DCP writes into ``<path>.partial``; rank 0 then adds ``megaloom.manifest``
(msgpack: layouts and the size and SHA-256 of every file) and swaps the folder in with
two renames (old -> ``<path>.old``, new -> ``<path>``). A crash at any point leaves
either the previous or the new checkpoint complete; :func:`load` falls back to
``<path>.old`` when ``<path>`` is missing. Before DCP opens anything, every file is
checked against the manifest, so a truncated or tampered checkpoint is refused with
:class:`CheckpointError` (DCP's own metadata file is a pickle: it is only read once
its hash matches the manifest written alongside it).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from typing import Any

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
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megaloom.comm.fsdp import ShardedModule
from megaloom.comm.sharding import ShardLayout
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import FileFormatError
from megaloom.runtime.files import atomic_write, read_msgpack

MANIFEST, EXTRA = "megaloom.manifest", "megaloom.extra"
OPTIM = "optim.state."  # optimizer state keys: optim.state.<param>.<state>, as torch's get_state_dict names them
FORMAT, VERSION = "megaloom-checkpoint", 1


Params = dict[str, tuple[torch.Tensor, ShardLayout | None]]  # name -> (local tensor, its layout; None: replicated)


class CheckpointError(FileFormatError):
    """A checkpoint is missing, truncated, tampered with, or does not fit the model."""



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
        return self.state_dict[index.fqn]


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
            chunk = _chunk(lay) if lay else ChunkStorageMetadata(torch.Size([0] * t.dim()), t.shape)
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def params_of(model: ShardedModule) -> Params:
    """The shards of a ShardedModule with their layouts."""
    return {fqn: (model.shard(fqn), lay) for fqn, lay in model.layouts.items()}


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


def save(path: str | os.PathLike, model: ShardedModule, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None) -> None:
    """Save the shards of ``model`` (and ``optimizer`` state, and ``extra``) atomically; a collective."""
    save_params(path, model.comm, params_of(model), optimizer, extra)


def save_params(path: str | os.PathLike, comm: Any, params: Params, optimizer: torch.optim.Optimizer | None = None,
                extra: Any = None) -> None:
    """Save ``params`` (and their ``optimizer`` state) atomically; ``extra``: this rank's msgpack value. A collective."""
    path = os.fspath(path)
    tmp = path + ".partial"
    state, layouts = state_of(params, optimizer)
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    with _single_process_ok():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner(layouts),
                 process_group=getattr(comm, "group", None) if dist.is_initialized() else None)
    shards = comm.exchange({k: [lay.offset, lay.size] for k, lay in layouts.items()})
    extras = comm.exchange(extra, "checkpoint extra") if extra is not None else None
    if comm.rank == 0:
        if extras is not None:
            atomic_write(os.path.join(tmp, EXTRA), msgpack.packb(extras, use_bin_type=True))
        tensors = {k: {"shape": list(t.shape) if k not in layouts else list(layouts[k].shape),
                       "dtype": dtype_name(t.dtype),
                       "shards": [s[k] for s in shards] if k in layouts else None} for k, t in state.items()}
        files = {n: _digest(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        atomic_write(os.path.join(tmp, MANIFEST), msgpack.packb({"format": FORMAT, "version": VERSION,
                                                         "world_size": comm.world_size, "tensors": tensors,
                                                         "files": files}, use_bin_type=True))
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def _digest(path: str) -> list[Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return [os.path.getsize(path), h.hexdigest()]


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's manifest, after checking every file's size and hash against it."""
    path = os.fspath(path)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path = path + ".old"  # a crash between the two renames of save()
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no checkpoint there")
    try:
        man = read_msgpack(os.path.join(path, MANIFEST), FORMAT, VERSION)
    except FileFormatError as e:
        raise CheckpointError(f"{path}: bad or missing manifest: {e}") from None
    files, tensors = man.get("files"), man.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise CheckpointError(f"{path}: manifest lacks its file or tensor table")
    for name, want in files.items():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise CheckpointError(f"{path}: file {name!r} is missing")
        got = _digest(f)
        if got[0] != want[0]:
            raise CheckpointError(f"{path}: file {name!r} has {got[0]} bytes, expected {want[0]} (truncated?)")
        if got[1] != want[1]:
            raise CheckpointError(f"{path}: file {name!r} does not match its SHA-256 in the manifest (tampered?)")
    man["path"] = path
    return man


def load(path: str | os.PathLike, model: ShardedModule, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load into ``model``'s shards (any saved world size); returns the manifest. A collective.

    Optimizer state named in the checkpoint is created for the new layout and filled.
    """
    return load_params(path, model.comm, params_of(model), optimizer)


def load_params(path: str | os.PathLike, comm: Any, params: Params, optimizer: torch.optim.Optimizer | None = None
                ) -> dict[str, Any]:
    """Load into ``params`` (any saved world size and layout); returns the manifest, with ``extra``:
    the list of every saving rank's extra value (None if none was saved). A collective."""
    man: dict[str, Any] | None = None
    err = ""
    try:
        man = verify(path)
    except CheckpointError as e:
        err = str(e)
    errors = [e for e in comm.exchange(err) if e]
    if errors:
        raise CheckpointError(errors[0])
    assert man is not None
    man["extra"] = _read_extra(man)
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
        dcp.load(state, storage_reader=dcp.FileSystemReader(man["path"]), planner=_LoadPlanner(layouts),
                 process_group=getattr(comm, "group", None) if dist.is_initialized() else None)
    return man


def _read_extra(man: dict[str, Any]) -> Any:
    if EXTRA not in man["files"]:
        return None
    with open(os.path.join(man["path"], EXTRA), "rb") as f:  # its hash was checked by verify()
        return msgpack.unpackb(f.read(), raw=False)


def _make_optimizer_state(tensors: dict[str, Any], params: Params, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state named in the checkpoint, created (zeros) in the shape the new layout gives it."""
    for key, info in tensors.items():
        if not key.startswith(OPTIM):
            continue
        fqn, name = key[len(OPTIM):].rsplit(".", 1)
        if fqn not in params:
            raise CheckpointError(f"checkpoint entry {key!r} names parameter {fqn!r}, which the model lacks")
        t, lay = params[fqn]
        shape = tuple(info["shape"])
        if lay is not None and shape == lay.shape:  # sharded like its parameter (whatever the saved layout)
            shape = lay.local_shape
        optimizer.state[t][name] = torch.zeros(shape, dtype=torch_dtype(info["dtype"]))
