"""The docs' examples work: every fenced python block in docs/*.md runs and prints what the
document says it prints, and the documented command lines run (small shapes) and exit as
documented.

A python block preceded by ``<!-- test_docs: skip (why) -->`` is a fragment or needs
several ranks. A block that prints is followed by its output: a line ``prints:`` (or
``prints (...):``) and a fenced ``text`` block, where ``...`` stands for text left out. The README quick start is run
by ``test_demo_examples.py``.
"""
import contextlib
import io
import pathlib
import re

import pytest

from megaloom.cli import main

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!-- test_docs: skip[^\n]*-->\n)?```python\n(.*?)^```\n(?:\s*^prints[^\n]*:\n\s*^```text\n(.*?)^```)?",
                   re.S | re.M)


def _blocks() -> list:
    out = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1
            marks = [pytest.mark.skip(reason=m.group(1).strip())] if m.group(1) else []
            out.append(pytest.param(path.name, line, m.group(2), m.group(3), id=f"{path.name}:{line}", marks=marks))
    return out


def test_docs_have_runnable_python_blocks():
    runnable = [p for p in _blocks() if not p.marks]
    assert len(runnable) >= 6, [p.id for p in runnable]


@pytest.mark.parametrize("doc,line,code,want", _blocks())
def test_python_block_runs_and_prints_its_documented_output(doc, line, code, want, tmp_path, monkeypatch,
                                                             check_output):
    monkeypatch.chdir(tmp_path)                 # blocks may write files (sim.json, ...)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, str(DOCS / doc), "exec"), {"__name__": "__doc_example__"})
    if want is None:
        assert not out.getvalue(), (f"{doc}:{line} prints, but no expected output follows the block "
                                    f"(a line 'prints:' and a ```text block):\n{out.getvalue()}")
    else:
        check_output(out.getvalue(), want, f"{doc}:{line}")


def test_expected_outputs_follow_runnable_blocks():
    """An output block is never left behind a skipped block, where nothing would check it."""
    for p in _blocks():
        assert not (p.marks and p.values[3] is not None), f"{p.id}: a skipped block has an expected output"


MOE = "megamoe:tokens=256,hidden=256,intermediate=128,experts=8,top_k=2"


def test_documented_command_lines_run(tmp_path, monkeypatch, capsys):
    """docs/scheduler.md, replay.md, runtime.md: simulate -> trace -> replay -> calibrate --from."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGALOOM_PROFILE_DIR", str(tmp_path / "profiles"))   # calibrate writes there
    lines = [
        ["simulate", "--graph", MOE, "--profile", "ascend-910b", "--policy", "expert_interleave:group_size=2",
         "--units", "cube=24,vector=48,comm=4", "--trace", "run.mlt", "--perfetto", "out.json"],
        ["simulate", "--graph", f"{MOE},ep=2,routing=skewed", "--world", "--slowdown", "1=1.2", "--profile", "atlas-a3"],
        ["trace", "summary", "run.mlt"],
        ["trace", "convert", "run.mlt", "-o", "run.json"],
        ["replay", "run.mlt"],
        ["replay", "run.mlt", "--units", "cube=2,vector=4", "--policy", "critical_path"],
        ["replay", "run.mlt", "--profile", "h100", "--perfetto", "predicted.json"],
        ["calibrate", "--from", "run.mlt"],
        ["profiles"],
        ["profiles", "h100"],
    ]
    for argv in lines:
        assert main(argv) == 0, argv
    out = capsys.readouterr().out
    assert "world makespan" in out and "recorded identity replay" in out
    assert (tmp_path / "predicted.json").is_file() and (tmp_path / "profiles" / "cpu.yaml").is_file()


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--graph", MOE, "--profile", "no-such-chip"], "no-such-chip"),
    (["simulate", "--graph", "megamoe:ep=8"], "megamoe"),
    (["replay", "missing.mlt"], "missing.mlt"),
    (["trace", "summary", "missing.mlt"], "missing.mlt"),
    (["calibrate", "--matmul-size", "0"], "--matmul-size"),
    (["launch", "-n", "2", "missing.py"], "missing.py"),
    (["demo", "--tile", "0"], "--tile must be > 0"),
    (["collect", "--ranks", "0"], "--ranks must be > 0"),
    (["simulate", "--graph", MOE, "--trace", "no-such-dir/run.mlt"], "cannot write no-such-dir/run.mlt"),
    (["replay", "missing.mlt", "--perfetto", "no-such-dir/x.json"], "missing.mlt"),
    (["simulate", "--graph", MOE, "--units", "cueb=2"], "unknown engine(s) cueb; known: cube, vector, comm"),
])
def test_bad_input_exits_2_naming_the_problem(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["simulate", "--units"], ["replay"], ["no-such-command"], ["train"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "usage: megaloom" in capsys.readouterr().err


def test_documented_train_overrides_parse():
    """docs/trainer.md: `megaloom train examples/train_tiny_qwen3_moe.yaml --optimizer.lr=1e-3 --schedule.steps=100`."""
    from megaloom.train.config import load_config

    cfg = load_config(DOCS.parent / "examples" / "train_tiny_qwen3_moe.yaml", ["--optimizer.lr=1e-3", "--schedule.steps=100"])
    assert cfg["optimizer"]["lr"] == 1e-3 and cfg["schedule"]["steps"] == 100
