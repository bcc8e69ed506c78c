"""The main job (`megaloom demo`) and the examples run end to end."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from megaloom.cli import main
from megaloom.commands import demo
from megaloom.runtime import Trace, metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_simulates_both_schedules_executes_checks_and_writes_traces(tmp_path, capsys, umask_027):
    """The README's main command, as given: MegaMoE over 2 EP ranks, simulated under both schedules
    and executed on 2 gloo ranks, each checked; Perfetto traces with cube, vector and comm tracks;
    its folder and files made as the umask says."""
    root, tmp_path = tmp_path, tmp_path / "out"
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "simulated on ascend-910b: every rank at once" in out
    assert "every rank matches the reference executor and the eager MoE block" in out
    sim = {s: Trace.load(tmp_path / f"{s}-ascend-910b.mlt") for s in ("sequential", "interleaved")}
    seq, inter = metrics(sim["sequential"]), metrics(sim["interleaved"])
    assert inter.makespan < seq.makespan and inter.comm_hidden > seq.comm_hidden
    assert f"interleaved is {seq.makespan / inter.makespan:.2f}x as fast as sequential" in out
    for name in ("sequential-ascend-910b", "interleaved-ascend-910b", "executed-cpu"):
        chrome = json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]
        tracks = {(e["pid"], e["args"]["name"].split(".")[0]) for e in chrome if e["name"] == "thread_name"}
        assert tracks == {(r, k) for r in (0, 1) for k in ("cube", "vector", "comm")}, name
    executed = Trace.load(tmp_path / "executed-cpu.mlt")
    assert executed.ranks == [0, 1] and executed.meta["mode"] == "execute"
    # the executed graphs are the simulated ones: same tasks on every rank
    for r in (0, 1):
        assert sorted(e.task for e in executed.events if e.rank == r) == \
            sorted(e.task for e in sim["interleaved"].events if e.rank == r)
    assert (tmp_path / "schedules.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{n}.{x}" for n in ("sequential-ascend-910b", "interleaved-ascend-910b", "executed-cpu") for x in ("json", "mlt")]
        + ["schedules.png"])
    umask_027(root)


def test_demo_without_matplotlib_says_how_to_get_the_chart(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib now raises ImportError
    demo.gantt({"sequential": Trace([]), "interleaved": Trace([])}, str(tmp_path), "h100")
    assert "no Gantt chart: it needs matplotlib, pip install matplotlib" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,needle", [
    (["--profile", "no-such-chip"], "unknown hardware profile 'no-such-chip'"),
    (["--ep", "1"], "--ep must be at least 2"),
    (["--tokens", "0"], "--tokens must be > 0"),
])
def test_demo_rejects_bad_options(argv, needle, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err


EXAMPLES = sorted(pathlib.Path(ROOT, "examples").glob("*.py"))


def test_every_example_opens_with_a_drawing_of_its_graph_and_has_an_expected_output():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "custom_op.py", "train_megamoe.py", "replay_profiler.py"}
    for script in EXAMPLES:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        assert "-->" in doc, f"{script.name}: its docstring has no drawing of its graph"
        assert script.with_suffix(".out").is_file(), f"{script.name}: no expected output {script.stem}.out"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_prints_its_expected_output(script, tmp_path, check_output, umask_027):
    """Each example runs as a user runs it (a fresh interpreter, in a scratch folder) and prints
    what ``examples/NAME.out`` says (``...`` there stands for wall-clock figures); the files it
    writes honour the umask."""
    env = {**os.environ, "MEGALOOM_PROFILE_DIR": str(tmp_path / "profiles")}  # no user profiles
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    check_output(r.stdout, script.with_suffix(".out").read_text(encoding="utf-8"), f"examples/{script.name}")
    if any(tmp_path.iterdir()):
        umask_027(tmp_path)


def test_readme_quick_start_runs(capsys):
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        code = re.search(r"## Quick start.*?```python\n(.*?)```", f.read(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert float(printed[0]) > 0 and printed[1:] == ["torch.Size([256,", "64])"]
