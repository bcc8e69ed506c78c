"""``megaloom launch``: start N local ranks of a Python script with torchrun's environment.

Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
(so ``TorchCommunicator()`` joins the world) and, with ``--trace``, ``MEGALOOM_TRACE``
(the collector endpoint for :class:`megaloom.comm.stream.TraceStreamer`) and, with
``--trace-key FILE``, ``MEGALOOM_TRACE_TOKEN`` (the rank's token for a collector started
with ``megaloom collect --key FILE``). Every rank is
watched: when one fails, the launcher names it and its exit code, lets the others stop
for ``--grace`` seconds, then kills them; SIGINT or SIGTERM to the launcher is forwarded
to every rank, which are killed if still running after the grace. The exit code is the
first failure's (128 + N for a rank killed by signal N, as a shell reports it), or
128 + N when the launcher itself was stopped by signal N. Each rank runs in its own
process group, so killing it also stops processes it started, and dies with the launcher
(Linux's parent-death signal), even when the launcher is killed by SIGKILL.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

from megaloom.commands import require_positive, stop_signals
from megaloom.runtime.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a script on N local ranks (torch.distributed env, like torchrun)")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--trace", default=None, help="collector endpoint passed to ranks as MEGALOOM_TRACE")
    p.add_argument("--trace-key", metavar="FILE", help="give each rank its token for `megaloom collect --key FILE`")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to let ranks stop after one fails or the launcher gets SIGINT/SIGTERM, "
                        "before they are killed (default 10)")
    p.add_argument("script", help="Python script each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "nproc")
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port must be a TCP port in 1..65535, got {args.port}")
    if not args.grace >= 0:
        raise ConfigError(f"--grace must be >= 0 seconds, got {args.grace}")
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} does not exist")
    from megaloom.comm.spawn import die_with, free_port
    from megaloom.comm.stream import rank_env, read_key

    port, key = args.port or free_port(), read_key(args.trace_key) if args.trace_key else None
    procs: list[subprocess.Popen] = []
    with stop_signals(lambda signum: _signal(procs, signum)) as stopped_by:
        try:
            for rank in range(args.nproc):
                if stopped_by:
                    break
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                           LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           **rank_env(rank, args.trace, key))
                procs.append(subprocess.Popen([sys.executable, args.script, *args.args], env=env,
                                              start_new_session=True, preexec_fn=die_with(os.getpid())))
            return _supervise(procs, args.grace, stopped_by)
        finally:
            _signal(procs, signal.SIGKILL)  # nothing outlives the launcher
            for p in procs:
                p.wait()


def _supervise(procs: list[subprocess.Popen], grace: float, stopped_by: list[int]) -> int:
    """Poll every rank until all have exited; after the first failure (or a forwarded
    signal) kill what still runs once ``grace`` seconds have passed. Returns the exit code."""
    code, since = 0, None
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for rank, rc in enumerate(codes):
            if rc and since is None and not stopped_by:
                code, since = _exit_code(rc), now
                print(f"megaloom launch: rank {rank} {_how(rc)}; stopping the other ranks "
                      f"(killed after {grace:g} s)", file=sys.stderr, flush=True)
        if stopped_by and not code:
            code, since = 128 + stopped_by[0], now
        if all(rc is not None for rc in codes):
            return code
        if since is not None and now - since > grace:
            _signal(procs, signal.SIGKILL)
        time.sleep(0.05)


def _signal(procs: list[subprocess.Popen], signum: int) -> None:
    """Send ``signum`` to the process group (the rank and what it started) of every rank still running."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signum)


def _exit_code(returncode: int) -> int:
    """A rank's exit status as a shell reports it: 128 + N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _how(returncode: int) -> str:
    with contextlib.suppress(ValueError):  # a negative code that is no signal's
        if returncode < 0:
            return f"was killed by {signal.Signals(-returncode).name} (exit code {_exit_code(returncode)})"
    return f"exited with code {_exit_code(returncode)}"
