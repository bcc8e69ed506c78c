"""Build a task graph of your own, simulate it on two chips, then execute it on the CPU.

Four row tiles of x each go through a matmul (cube), a SiLU (vector) and a copy to
another device (comm). Nobody writes down the dependencies: they follow from the tiles
each task reads and writes. With one unit per engine kind the three engines then work
on different tiles at once, like a pipeline: tile 1's matmul runs while tile 0's SiLU does.

    x[0] --[mm0: cube]--> h[0] --[act0: vector]--> a[0] --[send0: comm]--> y[0]
    x[1] --[mm1: cube]--> h[1] --[act1: vector]--> a[1] --[send1: comm]--> y[1]
    x[2] ...                                                           ... y[2]
    x[3] ...                                                           ... y[3]
            w --^ (every matmul reads all of w)

Run it: python examples/quickstart.py
"""
import torch

from megaloom import ReferenceExecutor, Simulator, TaskGraph, ThreadExecutor, summary, write_chrome

# 1. Build: buffers first (bfloat16: the dtype picks each chip's peak rate), then one task per
#    (op, tile). `buf.split(0, 128)` gives 128-row tiles.
g = TaskGraph("pipeline")
x, w = g.input("x", (512, 256), "bfloat16"), g.input("w", (256, 256), "bfloat16")
h, a = g.buffer("h", (512, 256), "bfloat16"), g.buffer("a", (512, 256), "bfloat16")
y = g.output("y", (512, 256), "bfloat16")
for i, (xt, ht, at, yt) in enumerate(zip(x.split(0, 128), h.split(0, 128), a.split(0, 128), y.split(0, 128))):
    g.task("matmul", [xt, w], [ht], name=f"mm{i}")                # the op's registry entry says: cube
    g.task("silu", [ht], [at], name=f"act{i}")                    # vector
    g.task("copy", [at], [yt], name=f"send{i}", engine="comm")    # copy may run on any engine: pick comm
g.validate()  # names the task if anything is wrong: cycles, shapes, reads of unwritten data
print(g.summary(), end="\n\n")

# 2. Simulate: the same graph against two hardware profiles, one unit of each engine kind (a
#    unit is one AI core of the 910B, 1/24 of the chip, or one SM of the H100, 1/132 of it).
units = {"cube": 1, "vector": 1, "comm": 1}
for chip in ("ascend-910b", "h100"):
    sim = Simulator(chip, units).run(g)
    print(summary(sim.trace), end="\n\n")
write_chrome(sim.trace, "pipeline-h100.json")  # open in https://ui.perfetto.dev: one track per unit

# 3. Execute on the CPU (a worker thread per unit), and check against the reference executor,
#    which runs the tasks one at a time in order.
torch.manual_seed(0)
inputs = {"x": torch.randn(512, 256).bfloat16(), "w": (torch.randn(256, 256) / 16).bfloat16()}
real = ThreadExecutor(units).run(g, inputs)
ref = ReferenceExecutor().run(g, inputs)
assert torch.equal(real["y"], ref["y"])  # the same kernels on the same tiles: bit for bit
print(f"executed on the CPU: {len(real.trace.events)} tasks in {real.trace.makespan * 1e3:.1f} ms (wall clock); "
      "the result matches the reference executor")
