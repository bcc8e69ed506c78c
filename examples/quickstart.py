"""Build a small graph by hand, simulate it on two chips, then execute it on the CPU.

Two expert groups, each: matmul on the cube units, SiLU on the vector units, then a
copy over a comm channel. Dependencies follow from the buffers each task reads and
writes, so group 1's matmul can run while group 0's SiLU and copy do:

    x0 --[mm0: cube]--> h0 --[act0: vector]--> a0 --[send0: comm]--> y0
    x1 --[mm1: cube]--> h1 --[act1: vector]--> a1 --[send1: comm]--> y1
              w ------^ (both matmuls read w)
"""
import torch

from megaloom import ReferenceExecutor, Simulator, TaskGraph, ThreadExecutor, load_profile, summary

g = TaskGraph("two-groups")
w = g.input("w", (256, 256))
for i in range(2):
    x = g.input(f"x{i}", (512, 256))
    h, a = g.buffer(f"h{i}", (512, 256)), g.buffer(f"a{i}", (512, 256))
    y = g.output(f"y{i}", (512, 256))
    g.task("matmul", [x, w], [h], name=f"mm{i}", tags={"group": i})
    g.task("silu", [h], [a], name=f"act{i}", tags={"group": i})
    g.task("copy", [a], [y], name=f"send{i}", engine="comm", tags={"group": i})
g.validate()
print(g.summary(), "\n")

for chip in ("ascend-910b", "h100"):
    result = Simulator(load_profile(chip)).run(g)
    print(summary(result.trace), "\n")

torch.manual_seed(0)
inputs = {b.name: torch.randn(b.shape) for b in g.inputs}
real = ThreadExecutor({"cube": 1, "vector": 1, "comm": 1}).run(g, inputs)
ref = ReferenceExecutor().run(g, inputs)
assert all(torch.allclose(real[k], ref[k]) for k in ref.outputs)
print(summary(real.trace))
print("\nexecuted result matches the reference executor")
