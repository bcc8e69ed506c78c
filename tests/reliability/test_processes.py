"""``megaloom launch`` never leaves ranks behind, even killed by SIGKILL, and a rank that caught
a collective's timeout exits with its own code, not an abort in the backend's teardown."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has already exited
    except FileNotFoundError:
        return False


def _wait_for(paths, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() and p.read_text() for p in paths):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)


def test_sigkill_to_launch_takes_its_ranks_along(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, time\nopen(f\"pid{os.environ['RANK']}\", 'w').write(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "megaloom.cli", "launch", "-n", "2", str(script)], cwd=tmp_path)
    pids: list[int] = []
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 240)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids)), "ranks outlived their launcher"
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_that_timed_out_exits_with_its_code_not_sigabrt(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys, time, torch\n"
        "from megaloom.comm.torch_comm import TorchCommunicator\n"
        "from megaloom.runtime.errors import CommError\n"
        "comm = TorchCommunicator(backend='gloo', timeout=3)\n"
        "if comm.rank == 1:\n"
        "    time.sleep(12)\n"
        "    sys.exit(0)\n"
        "try:\n"
        "    comm.all_reduce(torch.ones(4))\n"
        "except CommError as e:\n"
        "    print(e, file=sys.stderr)\n"
        "    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-m", "megaloom.cli", "launch", "-n", "2", "--grace", "30", str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert "SIGABRT" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    assert proc.returncode == 2 and "rank 0 exited with code 2" in proc.stderr
