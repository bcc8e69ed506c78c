"""``megaloom demo``: what megaloom is for, on one small expert-parallel MegaMoE step.

The graph is the MegaMoE forward pass of each EP rank (``megaloom.graphs.moe``), tile by tile;
dependencies are per expert, so one expert's GEMM can run while another's tokens travel::

    x --gather--> xs --all_to_all--> xr[e] --GMM1--> gu[e] --SwiGLU--> a[e] --GMM2--> y[e]
       vector        comm: dispatch          cube          vector           cube      |
    out <--weighted sum-- yc <--all_to_all: combine (comm)----------------------------+
          vector

1. Simulate every rank at once (``simulate_world``) on one hardware profile under both
   schedules: ``sequential`` (a barrier between stages, the no-overlap baseline) and
   ``interleaved`` (per-expert dependencies, expert groups in priority order); print the
   gain and how much of the comm time hides under compute.
2. Execute the interleaved graph on the CPU, one process per rank (torch.distributed gloo),
   and check each rank's result against the reference executor (the same graph, one task
   at a time) and the eager MoE block.
3. Write Perfetto traces (cube, vector and comm tracks of every rank) and a Gantt chart of
   both schedules (PNG; needs matplotlib: ``pip install 'megaloom[plot]'``, or ``matplotlib`` itself).
"""
from __future__ import annotations

import argparse
import os

from megaloom.commands import require_positive, write_file
from megaloom.runtime.errors import ConfigError, ExecutionError
from megaloom.runtime.metrics import metrics
from megaloom.runtime.perfetto import write_chrome
from megaloom.runtime.registry import CUBE
from megaloom.runtime.trace import Trace, merge

SHAPE = {"hidden": 1024, "intermediate": 512, "top_k": 2}
EXPERTS_PER_RANK, GROUP_SIZE, CUBE_SPLIT = 4, 2, 2
POLICY = "priority"  # expert group g has priority -g under `interleaved`; `sequential` has none
SCHEDULES = ("sequential", "interleaved")


def problem(options: dict) -> dict:
    """The seeded global problem (every rank's tokens, top-k ids and weights; every expert's weights)."""
    from megaloom.graphs.moe.ep import problem as moe_problem

    shape = {k: options[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k")}
    return moe_problem(options["ep"], **shape, seed=0)


def rank_graphs(options: dict) -> dict[str, list]:
    """Per schedule, every rank's forward graph, simulated at the routing of the seeded problem: the
    very graphs the ranks execute (MegaMoE's dynamic graphs: built once, the routing a run-time input)."""
    from megaloom.graphs.moe import MEGAMOE, Counts, MegaMoESpec, local_counts

    ids = problem(options)["ids"].split(options["tokens"])
    counts = tuple(tuple(local_counts(i, options["experts"])) for i in ids)
    specs = {schedule: MegaMoESpec(**options, schedule=schedule) for schedule in SCHEDULES}
    return {schedule: [MEGAMOE.build(spec, "fwd", Counts(r, spec.ep, spec.experts_local, counts), save=False,
                                     dynamic=True) for r in range(spec.ep)]
            for schedule, spec in specs.items()}


def execute_rank(comm, options: dict, out_dir: str) -> dict:
    """On one rank (:func:`megaloom.comm.spawn.run_world`): run the interleaved forward graph on the
    thread executor and on the reference executor, compare, compare with the eager MoE block, and
    save the executed trace as ``executed.r<rank>.mlt`` in ``out_dir``."""
    from megaloom.graphs.moe import MegaMoERunner, MegaMoESpec, moe_reference
    from megaloom.runtime.testing import rel_l2

    spec = MegaMoESpec(**options, schedule="interleaved")
    p = problem(options)  # the same on every rank
    el, r = spec.experts_local, comm.rank
    mine, experts = slice(r * spec.tokens, (r + 1) * spec.tokens), slice(r * el, (r + 1) * el)
    out = {}
    for executor in ("thread", "reference"):
        runner = MegaMoERunner(spec, comm, executor=executor, policy=POLICY)
        run_spec, routing = runner.route(p["ids"][mine])
        out[executor] = runner.forward(run_spec, routing, p["x"][mine], p["w"][mine], p["gate_up"][experts],
                                       p["down"][experts], save=False)
    out["thread"].trace.save(os.path.join(out_dir, f"executed.r{r}.mlt"))
    eager = moe_reference(p["x"][mine], p["ids"][mine], p["w"][mine], p["gate_up"], p["down"])
    y = out["thread"]["out"]
    return {"rank": r, "tasks": len(out["thread"].trace.events), "seconds": out["thread"].trace.makespan,
            "vs_reference": rel_l2(y, out["reference"]["out"]), "vs_eager": rel_l2(y, eager)}


def report_simulation(traces: dict[str, Trace], profile) -> None:
    units = ", ".join(f"{n} {k}" for k, n in profile.units.items())
    print(f"simulated on {profile.name}: every rank at once, per rank {units} units, policy {POLICY}")
    print(f"  {'schedule':<13}{'makespan':>11}{'cube util':>11}{'comm time':>11}   comm hidden under compute")
    m = {s: metrics(t) for s, t in traces.items()}
    for s in SCHEDULES:
        print(f"  {s:<13}{m[s].makespan * 1e6:>8.1f} us{m[s].utilisation.get(CUBE, 0) * 100:>10.1f}%"
              f"{m[s].comm_time * 1e6:>8.1f} us   {m[s].comm_hidden * 100:.1f}%")
    seq, inter = m["sequential"], m["interleaved"]
    print(f"  interleaved is {seq.makespan / inter.makespan:.2f}x as fast as sequential "
          f"({(1 - inter.makespan / seq.makespan) * 100:.0f}% less time); comm hidden under compute "
          f"{seq.comm_hidden * 100:.0f}% -> {inter.comm_hidden * 100:.0f}%\n")


def execute(options: dict, out_dir: str) -> Trace:
    """Run :func:`execute_rank` on ``ep`` local ranks; print and check each; the merged trace."""
    from megaloom.comm.spawn import run_world

    ep = options["ep"]
    print(f"executed on the CPU: {ep} processes (gloo), one cube, vector and comm worker each, interleaved")
    ranks = run_world(execute_rank, ep, options, out_dir, timeout=300, comm_timeout=60, preload=())
    for r in ranks:
        print(f"  rank {r['rank']}: {r['tasks']} tasks in {r['seconds'] * 1e3:.0f} ms; relative L2 error "
              f"vs the reference executor {r['vs_reference']:.1e}, vs the eager MoE block {r['vs_eager']:.1e}")
    bad = [r["rank"] for r in ranks if r["vs_reference"] > 1e-6 or r["vs_eager"] > 1e-5]
    if bad:
        raise ExecutionError(f"ranks {bad}: the executed result differs from the reference")
    print("  check: every rank matches the reference executor and the eager MoE block\n")
    paths = [os.path.join(out_dir, f"executed.r{r}.mlt") for r in range(ep)]
    trace = merge(Trace.load(p) for p in paths)
    for p in paths:
        os.unlink(p)
    return trace


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="simulate an expert-parallel MegaMoE step under two schedules, execute it "
                                    "on the CPU, check it, write Perfetto traces and a Gantt chart")
    p.add_argument("--profile", default="ascend-910b", help="hardware profile to simulate on (default: ascend-910b)")
    p.add_argument("--out", default="megaloom-demo", help="output folder (default: ./megaloom-demo)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank (default 1024)")
    p.add_argument("--tile", type=int, default=128, help="rows per tile (default 128)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler import load_profile
    from megaloom.scheduler.world import simulate_world

    require_positive(args, "tokens", "tile", "ep")
    if args.ep < 2:
        raise ConfigError(f"--ep must be at least 2 (one rank has no dispatch or combine), got {args.ep}")
    profile = load_profile(args.profile)
    # the MegaMoE spec, one rank's view
    options = {"tokens": args.tokens, **SHAPE, "experts": EXPERTS_PER_RANK * args.ep, "ep": args.ep,
               "tile_m": args.tile, "cube_split": CUBE_SPLIT, "group_size": GROUP_SIZE}
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output folder {args.out}: {e.strerror or e}") from e
    print(f"MegaMoE forward, expert parallel over {args.ep} ranks: {args.tokens} tokens per rank, hidden "
          f"{SHAPE['hidden']}, intermediate {SHAPE['intermediate']}, {options['experts']} experts "
          f"({EXPERTS_PER_RANK} per rank, in groups of {GROUP_SIZE}), top-{SHAPE['top_k']}, float32, "
          f"{args.tile}-row tiles")
    graphs = rank_graphs(options)
    print(graphs["interleaved"][0].summary(), end="\n\n")

    simulated = {s: simulate_world(g, profile, policy=POLICY).trace for s, g in graphs.items()}
    report_simulation(simulated, profile)
    executed = execute(options, args.out)

    files = {f"{s}-{profile.name}": (t, f"simulated, {s} schedule") for s, t in simulated.items()}
    files["executed-cpu"] = (executed, "executed on the CPU")
    print(f"wrote into {args.out}/ (Perfetto: open the .json files in https://ui.perfetto.dev; "
          "the .mlt files: megaloom trace / replay)")
    for name, (trace, what) in files.items():
        write_file(write_chrome, trace, os.path.join(args.out, f"{name}.json"))
        write_file(Trace.save, trace, os.path.join(args.out, f"{name}.mlt"))
        print(f"  {name + '.json, .mlt':<36} {what}")
    gantt(simulated, args.out, profile.name)
    return 0


def gantt(simulated: dict[str, Trace], out_dir: str, profile: str) -> None:
    """Rank 0 of both schedules on one time axis, as a PNG; a note instead when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (the optional `plot` extra)
    except ImportError:
        print("  (no Gantt chart: it needs matplotlib, pip install matplotlib)")
        return
    from megaloom.runtime.plot import plot_gantt

    panels = {f"{s}: rank 0, simulated on {profile}": Trace([e for e in t.events if e.rank == 0], t.meta)
              for s, t in simulated.items()}
    write_file(plot_gantt, panels, os.path.join(out_dir, "schedules.png"))
    print(f"  {'schedules.png':<36} Gantt chart of both schedules (rank 0)")
