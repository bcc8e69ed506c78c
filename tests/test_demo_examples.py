"""The main job (`megaloom demo`) and the examples run end to end."""
import json
import os
import subprocess
import sys

from megaloom.cli import main
from megaloom.runtime import Trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_simulates_executes_checks_and_writes_traces(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--tokens", "512", "--tile", "64"]) == 0
    out = capsys.readouterr().out
    assert "simulate, virtual clock, profile ascend-910b" in out and "matches the reference executor" in out
    sim = json.loads((tmp_path / "simulated-ascend-910b.json").read_text())
    assert {e["ph"] for e in sim["traceEvents"]} >= {"X", "M"}
    assert len(Trace.load(tmp_path / "executed.mlt").events) == 32


def test_demo_rejects_an_unknown_profile(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--profile", "no-such-chip"]) == 2
    assert "unknown hardware profile 'no-such-chip'" in capsys.readouterr().err


def test_quickstart_example_runs():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "profile ascend-910b" in r.stdout and "profile h100" in r.stdout
    assert r.stdout.rstrip().endswith("executed result matches the reference executor")


def test_readme_quick_start_runs(capsys):
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        code = re.search(r"## Quick start.*?```python\n(.*?)```", f.read(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert float(printed[0]) > 0 and printed[1:] == ["torch.Size([256,", "64])"]
