"""DCP checkpoint metadata as plain msgpack data, so that loading never unpickles a file.

``torch.distributed.checkpoint`` stores its :class:`Metadata` (per tensor: dtype, global
size, chunks; per chunk: file, byte offset and length) as a pickle, ``.metadata``.
megaloom keeps that file for standard tools (``dcp_to_torch_save``) but never opens it:
the checkpoint manifest carries the same metadata as msgpack (:func:`encode`), and
:class:`ManifestReader` hands DCP the :class:`Metadata` rebuilt from it (:func:`decode`),
every field checked and every chunk confined to a file the manifest lists and hashes.
Chunk data is then read by DCP itself with ``torch.load(weights_only=True)``. Only tensor
entries are supported (megaloom checkpoints hold nothing else). :func:`confine` holds the
metadata of a folder torch wrote (no manifest) to the same rules.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import CheckpointError, GraphError

MAX_DIMS = 64


def encode(md: Metadata) -> dict[str, Any]:
    """The tensor entries and storage table of DCP metadata as msgpack-encodable data."""
    tensors = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry {fqn!r} is not a tensor ({type(m).__name__})")
        tensors[fqn] = {"dtype": dtype_name(m.properties.dtype), "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = []
    for i, s in md.storage_data.items():
        if s.transform_descriptors:
            raise CheckpointError(f"checkpoint entry {i.fqn!r} was written with stream transforms {s.transform_descriptors}")
        storage.append([i.fqn, list(i.offset), i.index, s.relative_path, s.offset, s.length])
    return {"version": md.version, "tensors": tensors, "storage": storage}


def decode(d: Any, files: dict[str, int], where: str) -> Metadata:
    """DCP metadata from :func:`encode`'s form; ``files`` maps each readable file to its size.

    Raises CheckpointError naming the entry for anything malformed: a field of the wrong
    type, a chunk outside its tensor, a storage record outside its file.
    """
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: DCP metadata: {what}")

    if not isinstance(d, dict) or not isinstance(d.get("tensors"), dict) or not isinstance(d.get("storage"), list) \
            or not isinstance(d.get("version"), (str, type(None))):
        raise bad("missing or malformed")
    state: dict[str, TensorStorageMetadata] = {}
    for fqn, t in d["tensors"].items():
        if not isinstance(fqn, str) or not isinstance(t, dict):
            raise bad(f"entry {fqn!r} is malformed")
        size = _dims(t.get("size"), bad, f"entry {fqn!r} size")
        try:
            dtype = torch_dtype(t.get("dtype"))
        except GraphError as e:
            raise bad(f"entry {fqn!r}: {e}") from None
        chunks = t.get("chunks")
        if not isinstance(chunks, list) or not chunks:
            raise bad(f"entry {fqn!r} has no chunk list")
        out = []
        for c in chunks:
            if not isinstance(c, list) or len(c) != 2:
                raise bad(f"entry {fqn!r} has a malformed chunk")
            offsets, sizes = (_dims(x, bad, f"entry {fqn!r} chunk") for x in c)
            if len(offsets) != len(size) or len(sizes) != len(size) \
                    or any(o + n > s for o, n, s in zip(offsets, sizes, size)):
                raise bad(f"entry {fqn!r}: chunk at {offsets} of {sizes} lies outside its size {size}")
            out.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), out)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rec in d["storage"]:
        if not isinstance(rec, list) or len(rec) != 6 or rec[0] not in state \
                or not isinstance(rec[2], (int, type(None))) or isinstance(rec[2], bool):
            raise bad(f"storage record {rec!r:.80} is malformed")
        fqn, offset, index, name, start, length = rec
        offset = _dims(offset, bad, f"storage record of {fqn!r}")
        if name not in files:
            raise bad(f"storage record of {fqn!r} names {name!r}, not a checked regular file in the folder (refused)")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, length)) \
                or start + length > files[name]:
            raise bad(f"storage record of {fqn!r} reads bytes {start!r}+{length!r} of {name!r} "
                      f"({files[name]} bytes)")
        storage[MetadataIndex(fqn, torch.Size(offset), index)] = _StorageInfo(name, start, length)
    return Metadata(state, storage_data=storage, version=d["version"])


def confine(md: Any, path: str) -> Metadata:
    """The tensor entries of DCP metadata ``md`` of folder ``path`` (torch's, with no manifest),
    checked as :func:`decode` checks a manifest's: every chunk inside a regular file of the
    folder itself (no ``../``, absolute path or link) and inside that file's size."""
    try:
        files = {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False)}
        tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        storage = {i: s for i, s in md.storage_data.items() if i.fqn in tensors}
        return decode(encode(Metadata(tensors, storage_data=storage, version=md.version)), files, path)
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: DCP metadata is malformed: {type(e).__name__}: {e}") from None


def _dims(v: Any, bad, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_DIMS \
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in v):
        raise bad(f"{what} is not a list of sizes: {v!r:.80}")
    return v


class ManifestReader(dcp.FileSystemReader):
    """A DCP file reader that takes its metadata from the manifest, never from ``.metadata``."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no ``rank`` keyword: DCP must not fall back to per-rank pickles
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata
