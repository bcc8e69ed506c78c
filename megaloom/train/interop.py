"""Checkpoints in and out of plain torch: resume from a torch DCP checkpoint, export a Hugging Face directory.

**torch DCP.** megaloom's training checkpoints use the key layout of
``torch.distributed.checkpoint.state_dict.get_state_dict`` saved as ``{"model": ..., "optim":
...}``: ``model.<param>`` and ``optim.state.<param>.<state>`` (see :mod:`megaloom.comm.checkpoint`).
So a torch user restores a megaloom checkpoint with ``get_state_dict`` + ``dcp.load`` +
``set_state_dict`` (``DefaultLoadPlanner(allow_partial_load=True)``: megaloom writes no
``optim.param_groups.*``, its hyper-parameters come from the config), and megaloom resumes
from a checkpoint torch wrote that way (:func:`load_torch`). Such a folder has no megaloom
manifest, so nothing vouches for its files: DCP's ``.metadata`` pickle is read by a restricted
unpickler that builds only DCP's own metadata types (:data:`ALLOWED`), never arbitrary
objects; every chunk it names must lie in a regular file of the folder itself
(:func:`megaloom.comm.dcp_meta.confine`); the tensor files are read by DCP with
``torch.load(weights_only=True)``, and a file that is not what the metadata says is a
CheckpointError; ``optim.param_groups.*`` entries (pickled Python values) are not read at
all. The step resumed is the optimizer's, which must be a whole number >= 0.

**Hugging Face.** :func:`export_hf` writes the model of a training checkpoint as a
``save_pretrained`` directory (config and safetensors weights) that
``AutoModelForCausalLM.from_pretrained`` loads as the plain transformers model.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata

from megaloom.comm.checkpoint import (MANIFEST, _dcp_call, _LoadPlanner, _make_optimizer_state, _single_process_ok,
                                      load_params, state_of)
from megaloom.comm.communicator import LocalCommunicator
from megaloom.comm.dcp_meta import ManifestReader, confine
from megaloom.models.hf_moe import build_model
from megaloom.runtime.dtypes import dtype_name
from megaloom.runtime.errors import CheckpointError, ConfigError
from megaloom.runtime.files import umask

METADATA = ".metadata"
# what the restricted unpickler may build: DCP's metadata records, torch sizes, dtypes and layouts, paths
ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


def is_torch_checkpoint(path: str) -> bool:
    """A DCP folder written by torch (``.metadata``, no megaloom manifest)."""
    return os.path.isfile(os.path.join(path, METADATA)) and not os.path.exists(os.path.join(path, MANIFEST))


def read_metadata(path: str) -> metadata.Metadata:
    """DCP's metadata of ``path``, through the restricted unpickler; a CheckpointError names what is wrong."""
    f = os.path.join(path, METADATA)
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{f}: not DCP metadata megaloom can read: {e}") from None
    if not isinstance(md, metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{f}: not DCP metadata (got {type(md).__name__})")
    return md


def load_torch(path: str, comm: Any, params: dict, optimizer: torch.optim.Optimizer | None) -> int | None:
    """Load a torch DCP checkpoint (``get_state_dict`` layout) into ``params`` (``{name: (local tensor,
    ShardLayout or None)}``, as the trainer's ``Parallel.checkpoint_params()``) and ``optimizer`` (a
    collective; any world size and layout, as megaloom's own). Returns the step to resume after:
    the optimizer's saved ``step`` (Adam/AdamW), else the ``step_<k>`` folder name (None without an
    optimizer)."""
    md = confine(read_metadata(path), path)
    tensors = {k: {"shape": list(m.size), "dtype": dtype_name(m.properties.dtype)}
               for k, m in md.state_dict_metadata.items() if isinstance(m, metadata.TensorStorageMetadata)}
    if optimizer is not None:
        _make_optimizer_state(tensors, params, optimizer)
    state, layouts = state_of(params, optimizer)
    missing = sorted(k for k in state if k not in tensors)
    if missing:
        raise CheckpointError(f"{path}: torch checkpoint has no entry for {', '.join(missing[:5])} (expected the "
                     "get_state_dict layout saved as {'model': ..., 'optim': ...})")
    with _single_process_ok():
        _dcp_call(f"{path}: reading the torch checkpoint", lambda: dcp.load(
            state, storage_reader=ManifestReader(path, md), planner=_LoadPlanner(layouts),
            process_group=getattr(comm, "group", None) if dist.is_initialized() else None))
    if optimizer is None:
        return None
    steps = {v.item() for k, v in state.items() if k.startswith("optim.state.") and k.endswith(".step")}
    bad = [s for s in steps if not (math.isfinite(s) and s >= 0 and s == int(s))]
    if bad:
        raise CheckpointError(f"{path}: the optimizer's step is {bad[0]}, not a whole number >= 0")
    if len(steps) == 1:
        return int(steps.pop())
    m = re.fullmatch(r"step_0*(\d+)", os.path.basename(os.path.normpath(path)))
    if m:
        return int(m.group(1))
    raise ConfigError(f"checkpoint.resume: cannot tell the step of torch checkpoint {path!r} (no single optimizer "
                      "'step' in it); name its folder step_<k>")


def load_model(cfg: dict, path: str | None) -> torch.nn.Module:
    """The plain transformers model of ``cfg`` with the weights of training checkpoint ``path`` (megaloom's
    or torch's; None: the latest in the config's checkpoint folder)."""
    from megaloom.train import checkpoint as ckpt

    root = cfg["checkpoint"]["dir"] or os.path.join(cfg["run"]["out_dir"], "checkpoints")
    path = ckpt.find(path or True, root)
    if path is None:
        raise ConfigError(f"export: no checkpoint in {root!r}; train first, or pass a step folder")
    model = build_model(cfg["model"], cfg["run"]["seed"])
    params = {name: (t, None) for name, t in model.state_dict(keep_vars=True).items()}
    (load_torch if is_torch_checkpoint(path) else load_params)(path, LocalCommunicator(), params, None)
    return model.eval()


def export_hf(model: torch.nn.Module, out_dir: str, log: Callable[[str], None] = print, tokenizer: Any = None) -> str:
    """``model.save_pretrained`` (and ``tokenizer``'s) into ``out_dir``, atomically: written beside it, then renamed
    into place. ``out_dir`` must not exist yet (or be empty). Every file gets the mode the umask gives (safetensors
    alone writes 0600)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"export: {out_dir!r} exists and is not an empty directory")
    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for entry in os.scandir(tmp):
            os.chmod(entry.path, (0o777 if entry.is_dir() else 0o666) & ~umask())
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"export: cannot write {out_dir!r}: {e}") from None
    os.replace(tmp, out_dir)  # an empty out_dir is replaced too
    log(f"exported {type(model).__name__} to {out_dir} (save_pretrained; from_pretrained loads it)")
    return out_dir
