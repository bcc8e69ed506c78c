"""Record a training step with torch.profiler, replay it in megaloom's simulator, ask what-ifs.

The profiled program is a small MLP's training step on the CPU. The importer turns the
profiler's trace into a megaloom trace: its ops become tasks (GEMMs on cube, element-wise
ops and reductions on vector) with the dependencies they had, each with its measured
duration. Replaying it on the recorded device should give the recording back (the identity
replay, the check of the import); replaying it on another device scales each task by the
cost model's ratio between the two chips, or with a class of work made faster (what-ifs).

    forward:   x --linear (cube)--> --gelu (vector)--> --linear (cube)--> y --square, mean (vector)--> loss
    backward:  loss --grads (vector)--> --linear grads (cube)--> --gelu grad (vector)--> --linear grads (cube)
    optimiser: --SGD step, zero_grad (vector)

Measured times differ from run to run (the expected output shows them as ``...``).

Run it: python examples/replay_profiler.py   (writes mlp-step.json, a Perfetto / chrome://tracing file)
"""
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from megaloom.scheduler.importers import import_torch_profiler
from megaloom.scheduler.replay import WhatIf, replay

# 1. Record: one warm-up step, then one profiled step (record_shapes gives the GEMMs' flops).
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 256)


def step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    step()
prof.export_chrome_trace("mlp-step.json")

# 2. Import: a megaloom trace, and a report of what became what (nothing is dropped silently).
recorded, report = import_torch_profiler("mlp-step.json")
engines = sorted({e.engine for e in recorded.events})
print(f"recorded one training step with torch.profiler: {len(recorded.events)} tasks on {', '.join(engines)}")

# 3. Identity replay: the recording on its own device (the `cpu` profile) should come back; how far
#    apart the two are is how far to trust a what-if.
same = replay(recorded).trace
error = abs(same.makespan - recorded.makespan) / recorded.makespan
print(f"identity replay: {same.makespan * 1e3:.2f} ms, recorded {recorded.makespan * 1e3:.2f} ms "
      f"({error * 100:.1f}% apart)")

# 4. What-ifs. Each task keeps its dependencies and the host time before it; only durations change.
#    GEMMs (the cube tasks) twice as fast:
faster = replay(recorded, whatif=WhatIf(speedup={"cube": 2.0})).trace
assert faster.makespan < recorded.makespan
print(f"what-if, GEMMs twice as fast: {faster.makespan * 1e3:.2f} ms")
#    the same step on an H100, each task scaled by the cost model's ratio between the chips:
h100 = replay(recorded, profile="h100").trace
assert h100.makespan < recorded.makespan
print(f"what-if, the same step on an h100: {h100.makespan * 1e3:.3f} ms, "
      f"{recorded.makespan / h100.makespan:.0f}x faster than on this CPU")
