"""``megaloom launch``: start N local ranks of a Python script with torchrun's environment.

Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
(so ``TorchCommunicator()`` joins the world) and, with ``--trace``, ``MEGALOOM_TRACE``
(the collector endpoint for :class:`megaloom.comm.stream.TraceStreamer`). When a rank
fails, the others are stopped after ``--grace`` seconds; the exit code is the first
failure's
(128 + N for a rank killed by signal N, as a shell reports it).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from megaloom.comm.spawn import free_port
from megaloom.runtime.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a script on N local ranks (torch.distributed env, like torchrun)")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--trace", default=None, help="collector endpoint passed to ranks as MEGALOOM_TRACE")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to let other ranks stop after one fails (default 10)")
    p.add_argument("script", help="Python script each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} does not exist")
    port = args.port or free_port()
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if args.trace:
            env["MEGALOOM_TRACE"] = args.trace
        procs.append(subprocess.Popen([sys.executable, args.script, *args.args], env=env))
    code, failed_at = 0, None
    while True:
        running = any(p.poll() is None for p in procs)
        for rank, p in enumerate(procs):
            if p.returncode and not code:
                code, failed_at = _exit_code(p.returncode), time.monotonic()
                print(f"megaloom launch: rank {rank} {_how(p.returncode)}", file=sys.stderr)
        if not running:
            return code
        if failed_at is not None and time.monotonic() - failed_at > args.grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)


def _exit_code(returncode: int) -> int:
    """A rank's exit status as a shell reports it: 128 + N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name} (exit code {_exit_code(returncode)})"
        except ValueError:
            pass
    return f"exited with code {_exit_code(returncode)}"
