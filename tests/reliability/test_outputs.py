"""Outputs never replace what stands at the path unasked: special files are written through,
``-`` is standard output, inputs and files megaloom did not write are refused (``--force``
overwrites the latter), a kill leaves no temporary file, long names work, modes follow the umask."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from megaloom.cli import main
from megaloom.runtime.files import atomic_write
from megaloom.runtime.trace import Trace

from .util import launch_and_kernel, small_trace, within, write_profile_trace


def _chrome_events(data: bytes) -> list:
    return [e for e in json.loads(data)["traceEvents"] if e["ph"] == "X"]


def test_a_fifo_is_written_through_not_replaced(tmp_path):
    mlt, fifo = small_trace(tmp_path / "run.mlt"), tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there: the write does not wait
    try:
        with within(60):
            assert main(["trace", "convert", str(mlt), "-o", str(fifo)]) == 0
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert len(_chrome_events(os.read(reader, 1 << 20))) == 2
    finally:
        os.close(reader)


def test_a_link_to_proc_self_fd_stays_a_link_and_feeds_its_pipe(tmp_path):
    mlt, link = small_trace(tmp_path / "run.mlt"), tmp_path / "out.json"
    r, w = os.pipe()
    try:
        os.symlink(f"/proc/self/fd/{w}", link)
        with within(60):
            assert main(["trace", "convert", str(mlt), "-o", str(link)]) == 0
        assert os.path.islink(link) and os.readlink(link) == f"/proc/self/fd/{w}"
        os.set_blocking(r, False)
        assert len(_chrome_events(os.read(r, 1 << 20))) == 2
    finally:
        os.close(r)
        os.close(w)


def test_a_character_device_is_written_not_replaced(tmp_path):
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    except PermissionError:
        pytest.skip("making a device node needs root")
    assert main(["trace", "convert", str(small_trace(tmp_path / "run.mlt")), "-o", str(null)]) == 0
    assert stat.S_ISCHR(os.lstat(null).st_mode)


def test_dash_is_standard_output_and_messages_go_to_stderr(tmp_path, monkeypatch, capfd):
    mlt = small_trace(tmp_path / "run.mlt")
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "convert", str(mlt), "-o", "-"]) == 0
    out, err = capfd.readouterr()
    assert len(_chrome_events(out.encode())) == 2 and "wrote" in err
    assert not (tmp_path / "-").exists()


def _inputs(tmp_path):
    mlt = small_trace(tmp_path / "run.mlt")
    gz = write_profile_trace(tmp_path / "in.json.gz", launch_and_kernel(), gz=True)
    from megaloom.runtime.graph import TaskGraph

    g = TaskGraph("g")
    g.task("noop", name="t", engine="vector")
    g.save(tmp_path / "g.mlg")
    return {"mlt": mlt, "gz": gz, "mlg": tmp_path / "g.mlg"}


@pytest.mark.parametrize("argv", [
    ["trace", "convert", "{mlt}", "-o", "{mlt}"],
    ["trace", "convert", "{mlt}", "-o", "{mlt}", "--force"],
    ["replay", "{gz}", "--perfetto", "{gz}"],
    ["replay", "{mlt}", "--trace", "{mlt}", "--force"],
    ["graph", "dot", "{mlg}", "-o", "{mlg}"],
    ["simulate", "{mlg}", "--trace", "{mlg}", "--force"],
], ids=["convert", "convert --force", "replay --perfetto", "replay --trace", "graph dot", "simulate"])
def test_an_input_is_never_overwritten(tmp_path, capsys, argv):
    paths = _inputs(tmp_path)
    before = {k: p.read_bytes() for k, p in paths.items()}
    assert main([a.format(**paths) for a in argv]) == 2
    assert "is the input" in capsys.readouterr().err
    assert {k: p.read_bytes() for k, p in paths.items()} == before


@pytest.mark.parametrize("argv, out", [
    (["trace", "convert", "{mlt}"], "run.json"),  # the default output beside the trace
    (["trace", "convert", "{mlt}", "-o", "{out}"], "notes.json"),
    (["simulate", "{mlg}", "--perfetto", "{out}"], "profile.json"),
    (["graph", "dot", "{mlg}", "-o", "{out}"], "g.dot"),
], ids=["convert default", "convert -o", "simulate --perfetto", "graph dot"])
def test_a_file_megaloom_did_not_write_is_kept_unless_forced(tmp_path, capsys, argv, out):
    paths = _inputs(tmp_path)
    target = tmp_path / out
    target.write_text('{"schemaVersion": 1, "traceEvents": []}  a profiler trace of a week-long job')
    argv = [a.format(**paths, out=target) for a in argv]
    assert main(argv) == 2
    assert "megaloom did not write it" in capsys.readouterr().err and "profiler trace" in target.read_text()
    assert main(argv + ["--force"]) == 0
    assert b"megaloom" in target.read_bytes()[:64]
    assert main(argv) == 0  # its own earlier output is overwritten without asking


def test_a_kill_mid_write_leaves_no_temporary_file(tmp_path):
    keep = tmp_path / "keep.mlt"
    keep.write_bytes(b"the good file")
    code = ("import os, signal\nfrom megaloom.runtime import files\n"
            "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed once the data is written\n"
            f"files.atomic_write({str(keep)!r}, b'x' * 100000)\n")
    proc = subprocess.run([sys.executable, "-c", code], timeout=300)
    assert proc.returncode == -9
    assert os.listdir(tmp_path) == ["keep.mlt"] and keep.read_bytes() == b"the good file"


def test_a_name_of_255_characters_is_written(tmp_path):
    path = tmp_path / ("t" * 251 + ".mlt")
    small_trace(path)
    assert len(Trace.load(path).events) == 2
    atomic_write(path, b"again")
    assert os.listdir(tmp_path) == [path.name] and path.read_bytes() == b"again"


def test_hf_export_files_follow_the_umask(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaloom.train.interop import export_hf

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    old = os.umask(0o022)
    try:
        export_hf(model, str(tmp_path / "hf"), log=lambda m: None)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
