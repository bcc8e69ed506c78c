"""A checked recv of another size or dtype than the send is a CommError, never stale values."""
from __future__ import annotations

import pytest
import torch

from megaloom.comm.spawn import run_world

pytestmark = pytest.mark.dist


def world_p2p(comm):
    out = {}
    for case, (sent, recv) in {"same": (torch.arange(4.0), torch.zeros(4)),
                               "smaller": (torch.arange(4.0), torch.full((8,), -1.0)),
                               "dtype": (torch.arange(4.0), torch.zeros(4, dtype=torch.float64))}.items():
        if comm.rank == 0:
            comm.send(sent, 1)
            continue
        try:
            comm.recv(recv, 0)
            out[case] = recv.tolist()
        except Exception as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


def test_recv_checks_what_the_send_announced():
    _, got = run_world(world_p2p, 2, timeout=60, comm_timeout=10)
    assert got["same"] == [0.0, 1.0, 2.0, 3.0]
    assert got["smaller"].startswith("CommError") and "it sent 4 elements of torch.float32" in got["smaller"] \
        and "holds 8" in got["smaller"]
    assert got["dtype"].startswith("CommError") and "torch.float64" in got["dtype"]
