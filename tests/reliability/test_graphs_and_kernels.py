"""A graph file megaloom writes is one it reads back; costs no simulator can use are refused when
the task is made; a kernel that rebinds an argument instead of writing into it is an error, never
uninitialised memory returned as a result."""
from __future__ import annotations

import math

import pytest
import torch

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.ops.basic import same_shape
from megaloom.runtime import ExecutionError, TaskGraph, ThreadExecutor
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, register
from megaloom.scheduler import Simulator


def _int_buffer_name():
    g = TaskGraph("g")
    g.task("noop", [g.input(5, (4,))], [], name="t")
    return g


def _cost(**kw):
    def build():
        g = TaskGraph("g")
        g.task("noop", name="t", engine="vector", cost=Cost(**kw))
        return g
    return build


@pytest.mark.parametrize("build", [_int_buffer_name, _cost(flops=math.nan), _cost(bytes=-1.0),
                                   _cost(comm_bytes=math.inf), _cost(precision=8)],
                         ids=["int buffer name", "nan flops", "negative bytes", "inf comm bytes", "int precision"])
def test_what_save_writes_load_reads(tmp_path, build):
    try:
        g = build()
    except GraphError:
        return  # refused where it was made: nothing to save
    g.save(tmp_path / "g.mlg")
    TaskGraph.load(tmp_path / "g.mlg")


@pytest.mark.parametrize("cost", [Cost(flops=math.nan), Cost(flops=-1e12), Cost(bytes=-5.0)],
                         ids=["nan flops", "negative flops", "negative bytes"])
def test_costs_no_simulation_can_use_are_refused(cost):
    with pytest.raises(GraphError, match="finite flops, bytes and comm bytes >= 0"):
        g = TaskGraph("g")
        g.task("noop", name="t", engine="vector", cost=cost)
        Simulator("ascend-910b").run(g)
    with pytest.raises(GraphError, match="finite figures"):
        TaskGraph.from_arrays(["noop"], [[]], engines=["vector"], costs=[cost])


def _rebinding_kernel(ins, outs):
    outs[0] = ins[0] * 2  # a new tensor: the output buffer itself stays unwritten


register(OpDef("test_rebind", ("vector",), lambda x: x * 2, same_shape, lambda i, o, a: Cost(), _rebinding_kernel),
         replace=True)


def test_a_kernel_that_rebinds_its_output_is_an_execution_error():
    g = TaskGraph("g")
    x, h, y = g.input("x", (64,)), g.buffer("h", (64,)), g.output("y", (64,))
    g.task("test_rebind", [x], [h], name="double")
    g.task("test_rebind", [h], [y], name="again")
    with pytest.raises(ExecutionError, match="'double'.*not rebind them"):
        ThreadExecutor({"vector": 1}).run(g, {"x": torch.ones(64)})
