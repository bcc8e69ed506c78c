"""Helpers shared by MegaGate and MegaMHC: token tiles, specs from options, graph runners."""
from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import Any, Callable, Mapping, TypeVar

import torch

from megaloom.runtime.dtypes import dtype_name
from megaloom.runtime.errors import ConfigError, ExecutionError, GraphError
from megaloom.runtime.executors import ExecContext, Executor, ThreadExecutor
from megaloom.runtime.graph import Buffer, TaskGraph

S = TypeVar("S")


def token_tiles(tokens: int, tile: int) -> list[tuple[int, int]]:
    """(start, stop) row ranges of at most ``tile`` tokens covering ``tokens``."""
    return [(a, min(a + tile, tokens)) for a in range(0, tokens, tile)]


def weight_grad_chains(g: TaskGraph, grad: Buffer, act: Buffer, out: Buffer, tiles: list[tuple[int, int]],
                       cols: int, rows: int, acc: str, stage: str) -> None:
    """``out = sum_i grad[i]^T flat(act[i])`` as cube chains over the token tiles.

    The columns of ``out`` are split in blocks of at most ``cols`` (a block never spans two
    rows of act's trailing dims), one chain per block, so the chains run on different cube
    units. Each link of a chain covers ``rows`` tokens (rounded up to whole tiles), so a link
    waits for the vector work of its tiles only. Each chain accumulates in its own ``acc``
    buffer; its last link writes ``out`` in out's dtype.
    """
    per = -(-rows // (tiles[0][1] - tiles[0][0]))
    tiles = [(tiles[i][0], tiles[min(i + per, len(tiles)) - 1][1]) for i in range(0, len(tiles), per)]
    last, lead = act.shape[-1], act.shape[1:-1]
    blocks = [(idx, c0, min(c0 + cols, last)) for idx in itertools.product(*map(range, lead))
              for c0 in range(0, last, cols)]
    for j, (idx, c0, c1) in enumerate(blocks):
        row = 0
        for k, d in zip(idx, lead):  # row-major index of the trailing-dims row
            row = row * d + k
        dst = out[:, row * last + c0:row * last + c1]
        # one accumulator per chain keeps each buffer's writer list short
        acc_buf = g.buffer(f"{out.name}.acc{j}", dst.shape, acc) if len(tiles) > 1 else None
        for i, (a, b) in enumerate(tiles):
            final = i == len(tiles) - 1
            src = act[(slice(a, b), *(slice(k, k + 1) for k in idx), slice(c0, c1))]
            g.task("proj_grad_weight", [grad[a:b], src] + ([acc_buf] if i else []), [dst if final else acc_buf],
                   name=f"{stage}.{i}.{j}", attrs={"out_dtype": out.dtype if final else acc},
                   tags={"stage": stage, "direction": "bwd", "tile": i})


def require(ok: bool, what: str, message: str) -> None:
    """Raise ConfigError ``"<what>: <message>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{what}: {message}")


def check_dtype(what: str, dtype: str) -> None:
    try:
        name = dtype_name(dtype)
    except GraphError as e:
        raise ConfigError(f"{what}: {e}") from None
    require(name in ("float32", "bfloat16", "float16", "float64"), what,
            f"dtype must be float32, bfloat16, float16 or float64, got {dtype!r}")


def spec_from_mapping(cls: type[S], data: Mapping[str, Any]) -> S:
    """Build the spec dataclass ``cls`` from a mapping (CLI options or a YAML section).

    Unknown keys and values of the wrong type raise ConfigError naming them.
    """
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    require(not unknown, cls.__name__, f"unknown option(s) {', '.join(unknown)}; known: {', '.join(names)}")
    kwargs = {}
    for key, value in data.items():
        kind = type(names[key].default) if names[key].default is not dataclasses.MISSING else int
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        require(isinstance(value, kind) and not (kind is int and isinstance(value, bool)), cls.__name__,
                f"option {key!r} must be {kind.__name__}, got {value!r}")
        kwargs[key] = value
    missing = [n for n, f in names.items() if f.default is dataclasses.MISSING and n not in kwargs]
    require(not missing, cls.__name__, f"missing option(s) {', '.join(missing)}")
    return cls(**kwargs)


class GraphRunner:
    """Builds each (builder, spec) graph once and runs it on an executor.

    ``executor=None`` runs on a one-unit-per-engine :class:`ThreadExecutor` on the inputs' device;
    a given executor must run on the inputs' device (ExecutionError otherwise).
    """

    def __init__(self, executor: Executor | None = None, cache_size: int = 16):
        self.executor = executor
        self.cache_size = cache_size
        self._graphs: OrderedDict[tuple, TaskGraph] = OrderedDict()

    def graph(self, builder: Callable[[Any], TaskGraph], spec: Any) -> TaskGraph:
        key = (builder, spec)
        g = self._graphs.get(key)
        if g is None:
            g = builder(spec).validate()
            self._graphs[key] = g
            while len(self._graphs) > self.cache_size:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return g

    def run(self, builder: Callable[[Any], TaskGraph], spec: Any,
            inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The output buffers of the graph ``builder(spec)`` run on ``inputs`` (detached, contiguous)."""
        graph = self.graph(builder, spec)
        inputs = {k: v.detach().contiguous() for k, v in inputs.items()}
        device = next(iter(inputs.values())).device
        ex = self.executor or ThreadExecutor(ctx=ExecContext(device=device))
        ctx = getattr(ex, "ctx", None)
        if ctx is not None and torch.device(ctx.device).type != device.type:
            raise ExecutionError(f"graph {graph.name!r}: inputs are on {device}, but executor {ex.name!r} runs on "
                                 f"{ctx.device}; give it ExecContext(device=...) of the inputs' device")
        return ex.run(graph, inputs).outputs


