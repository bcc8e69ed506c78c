"""Dtype names used in graphs and files, and their torch counterparts."""
from __future__ import annotations

import torch

from megaloom.runtime.errors import GraphError

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of ``dtype`` ('float32', 'bfloat16', ...); raises GraphError if unknown."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES:
            raise GraphError(f"unsupported dtype {dtype}")
        return _NAMES[dtype]
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise GraphError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}")
    return name


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a dtype name."""
    return _DTYPES[dtype_name(name)]


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return _DTYPES[name].itemsize
