"""The optional torch.compile backend (seconds to compile: opt in with MEGALOOM_DVM_INDUCTOR=1)."""
from __future__ import annotations

import os

import pytest
import torch

from megaloom.ops import dvm
from megaloom.ops.dvm.program import Program, instr

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("MEGALOOM_DVM_INDUCTOR") != "1",
                                                   reason="torch.compile takes seconds; set MEGALOOM_DVM_INDUCTOR=1")]


def test_inductor_backend_matches_reference_and_reports_compile_time():
    prog = Program((((16, 8), "float32"), ((1, 8), "float32")),
                   (instr("add", [0, 1]), instr("tanh", [2]), instr("mul", [3], scalar=0.5)), (4, 2))
    x, b = torch.randn(16, 8), torch.randn(1, 8)
    k = dvm.compile_program(prog, dvm.Options(backend="inductor"))
    outs = [torch.empty(16, 8), torch.empty(16, 8)]
    k([x, b], outs)
    assert k.compile_seconds is not None and k.compile_seconds > 0
    for got, want in zip(outs, prog.run_reference([x, b])):
        torch.testing.assert_close(got, want)
