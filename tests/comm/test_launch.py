"""``megaloom launch`` supervises: every rank polled, the first failure named with its exit
code, the others killed after ``--grace``, SIGINT/SIGTERM forwarded to every rank."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megaloom.cli import main

DEAD_RANK = """
import os, sys, time
import torch
from megaloom.comm import TorchCommunicator

comm = TorchCommunicator(timeout=120)
open(os.path.join(sys.argv[1], f"pid{comm.rank}"), "w").write(str(os.getpid()))
if comm.rank == 1:
    open(os.path.join(sys.argv[1], "died"), "w").write(repr(time.time()))
    os._exit(7)
try:
    comm.all_reduce(torch.ones(1))
except Exception:
    pass
time.sleep(120)  # a rank that does not stop by itself: the launcher kills it after the grace
"""

SIGNALLED = """
import os, signal, sys, time
rank = os.environ["RANK"]
if rank == "0":
    signal.signal(signal.SIGTERM, lambda s, f: (open(os.path.join(sys.argv[1], "term0"), "w").close(), sys.exit(0)))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must be killed after the grace
open(os.path.join(sys.argv[1], "pid" + rank), "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.dist
def test_a_dead_rank_of_two_gloo_ranks_is_reported_and_the_other_killed_after_the_grace(tmp_path, capsys):
    script = tmp_path / "dead.py"
    script.write_text(DEAD_RANK)
    assert main(["launch", "-n", "2", "--grace", "2", str(script), str(tmp_path)]) == 7
    returned = time.time()
    assert returned - float((tmp_path / "died").read_text()) < 2 + 5  # was: waited for rank 0 (34 s with --grace 2)
    assert "rank 1 exited with code 7" in capsys.readouterr().err
    assert not _alive(int((tmp_path / "pid0").read_text()))


def test_sigterm_is_forwarded_to_every_rank_and_stragglers_killed(tmp_path):
    script = tmp_path / "sig.py"
    script.write_text(SIGNALLED)
    sent: list[float] = []

    def signal_when_started() -> None:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    th = threading.Thread(target=signal_when_started, daemon=True)
    th.start()
    code = main(["launch", "-n", "2", "--grace", "1", str(script), str(tmp_path)])
    th.join(5)
    assert code == 128 + signal.SIGTERM and time.monotonic() - sent[0] < 1 + 3
    assert (tmp_path / "term0").exists()  # rank 0 got the forwarded signal
    assert not any(_alive(int((tmp_path / f"pid{r}").read_text())) for r in (0, 1))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_bad_port_is_a_config_error(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "-n", "2", "--port", "99999", str(script)]) == 2
    assert "--port must be a TCP port" in capsys.readouterr().err
