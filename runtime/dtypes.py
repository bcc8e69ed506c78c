"""Dtype names used in graphs and files, and their torch counterparts (torch is imported only
when a torch dtype is asked for)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.runtime.errors import GraphError

if TYPE_CHECKING:
    import torch

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e8m0fnu": 1,
             "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of ``dtype`` ('float32', 'bfloat16', ...); raises GraphError if unknown."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise GraphError(f"unknown dtype {dtype!r}; known: {', '.join(_ITEMSIZE)}")
    return name


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a dtype name."""
    import torch

    return getattr(torch, dtype_name(name))


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return _ITEMSIZE[name]
