"""Register an op of your own (RMSNorm), check it, and use it in a graph like any built-in op.

An op is one registry entry: the engine kinds that may run it, a torch reference (the
oracle), a kernel that computes one tile in place, a shape rule and a cost. The
simulator prices it with the cost, the thread executor runs the kernel, the reference
executor runs the reference. The graph: a projection per row tile, then the new op on its output.

    x[0] --[proj0: matmul, cube]--> h[0] --[norm0: my.rms_norm, vector]--> y[0]
    x[1] --[proj1: matmul, cube]--> h[1] --[norm1: my.rms_norm, vector]--> y[1]
    ...                                                                 (4 tiles)
           w --^                          g --^ (the norm's weight)

Run it: python examples/custom_op.py
"""
import torch
import torch.nn.functional as F

from megaloom import ReferenceExecutor, Simulator, TaskGraph, ThreadExecutor, summary
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, get_op, register
from megaloom.runtime.testing import check_op


def reference(x, weight, *, eps):
    """The oracle: plain torch."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def kernel(ins, outs, *, eps):
    """One tile, written into ``outs[0]`` (a view of the task's output region)."""
    x, weight = ins
    torch.mul(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), weight, out=outs[0])


def shape(ins, attrs):
    """Output shape and dtype from the input specs; a clear GraphError otherwise (it names the task)."""
    x, weight = ins
    if len(x.shape) != 2 or weight.shape != x.shape[1:]:
        raise GraphError(f"my.rms_norm takes x [T, H] and weight [H], got {x.shape} and {weight.shape}")
    return [TensorSpec(x.shape, x.dtype)]


def cost(ins, outs, attrs):
    """Work for the simulator: about 4 flops per element, every operand read or written once."""
    return Cost(flops=4 * outs[0].numel, bytes=sum(s.nbytes for s in ins) + outs[0].nbytes)


# Register it. A package of ops registers on import and names the module in its pyproject.toml,
#     [project.entry-points."megaloom.ops"]
#     mine = "my_package.ops"
# so that a saved graph using its ops validates and runs in any process.
register(OpDef("my.rms_norm", ("vector",), reference, shape, cost, kernel, doc="x / rms(x) * weight"))
print(f"registered {get_op('my.rms_norm').name}: {get_op('my.rms_norm').doc}, on {get_op('my.rms_norm').engine}")

# Check it the way megaloom's own ops are checked: kernel vs reference (into fresh and strided
# outputs), shape rule vs the real output, cost finite and positive.
torch.manual_seed(0)
check_op("my.rms_norm", [torch.randn(64, 256), torch.rand(256)], {"eps": 1e-6})
print("check_op: the kernel matches the reference; shape rule and cost hold\n")

# Use it in a graph.
g = TaskGraph("proj-norm")
x, w, gain = g.input("x", (512, 256)), g.input("w", (256, 256)), g.input("g", (256,))
h, y = g.buffer("h", (512, 256)), g.output("y", (512, 256))
for i, (xt, ht, yt) in enumerate(zip(x.split(0, 128), h.split(0, 128), y.split(0, 128))):
    g.task("matmul", [xt, w], [ht], name=f"proj{i}")
    g.task("my.rms_norm", [ht, gain], [yt], name=f"norm{i}", attrs={"eps": 1e-6})
g.validate()

print(summary(Simulator("ascend-910b", {"cube": 1, "vector": 1}).run(g).trace), end="\n\n")

inputs = {"x": torch.randn(512, 256), "w": torch.randn(256, 256) / 16, "g": torch.rand(256)}
real = ThreadExecutor({"cube": 1, "vector": 1}).run(g, inputs)
ref = ReferenceExecutor().run(g, inputs)  # runs every op's torch reference, one task at a time
assert torch.allclose(real["y"], ref["y"], atol=1e-6)
assert torch.allclose(real["y"], reference(inputs["x"] @ inputs["w"], inputs["g"], eps=1e-6), atol=1e-5)
print("executed on the CPU: matches the reference executor and the same maths in plain torch")
