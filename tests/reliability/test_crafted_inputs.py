"""Crafted files end in clear errors, quickly: a gzip bomb stops at the size cap, YAML alias
bombs, recursive aliases and deep nesting are refused, absurd sizes fail validation, and
profiler traces with numbers no float holds, a list for a stream or a grid past 2**63
blocks never surface as raw tracebacks."""
from __future__ import annotations

import importlib
import json
import zlib

import pytest

from megaloom.cli import main
from megaloom.runtime.errors import ConfigError, TraceFormatError
from megaloom.scheduler.importers import import_torch_profiler
from megaloom.train.config import load_config

from .util import launch_and_kernel, profiler_doc, within, write_profile_trace

read = importlib.import_module("megaloom.scheduler.importers.kineto.read")


def _bomb(path, mib: int):
    """A tiny gzip file whose JSON expands to ``mib`` MiB (spaces before the events)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = json.dumps(profiler_doc(launch_and_kernel())).encode()
    chunks = [z.compress(body[:1])] + [z.compress(b" " * (1 << 20)) for _ in range(mib)]
    path.write_bytes(b"".join(chunks) + z.compress(body[1:]) + z.flush())
    return path


def test_a_gzip_bomb_stops_at_the_cap(tmp_path, monkeypatch):
    bomb = _bomb(tmp_path / "bomb.json.gz", 8)
    assert bomb.stat().st_size < 64 << 10 and read.MAX_JSON_BYTES <= 512 << 20
    monkeypatch.setattr(read, "MAX_JSON_BYTES", 4 << 20)
    with pytest.raises(TraceFormatError, match="expands past 4 MiB"):
        read.read_bytes(bomb)


def test_replay_names_the_flag_that_raises_the_cap(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(read, "MAX_JSON_BYTES", read.MAX_JSON_BYTES)  # the command sets it: put it back after
    bomb = _bomb(tmp_path / "bomb.json.gz", 3)
    assert main(["replay", str(bomb), "--max-json-mib", "2"]) == 2
    assert "--max-json-mib" in capsys.readouterr().err
    assert main(["replay", str(bomb), "--max-json-mib", "4"]) == 0


def _config(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with within(20):
        return load_config(p)


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path):
    levels = ["    a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 9):
        prev, name = chr(96 + i), chr(97 + i)
        levels.append(f"    {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    text = "model:\n  config:\n" + "\n".join(levels) + "\n"
    assert len(text) < 500  # 9**9 numbers once expanded
    with pytest.raises(ConfigError, match="alias bomb"):
        _config(tmp_path, text)


@pytest.mark.parametrize("text, needle", [
    ("model:\n  config: &c {self: *c}\n", "recursive alias"),
    ("model:\n  config: {x: " + "[" * 5000 + "]" * 5000 + "}\n", "nested too deeply, or a recursive alias"),
], ids=["recursive alias", "deep nesting"])
def test_recursive_and_deep_yaml_is_a_config_error(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        _config(tmp_path, text)


@pytest.mark.parametrize("override, needle", [
    ("--model.config.hidden_size=-64", "hidden_size is -64"),
    ("--model.config.num_hidden_layers=100000000", "num_hidden_layers"),
    ("--data.seq_len=1000000000000", "data.seq_len"),
    ("--data.batch_size=100000000", "data.batch_size"),
])
def test_absurd_sizes_fail_validation(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_timestamps_no_float_holds_are_a_trace_format_error(tmp_path):
    events = launch_and_kernel()
    events[1]["ts"] = 10 ** 400
    with pytest.raises(TraceFormatError, match="event 1: field 'ts'"):
        import_torch_profiler(write_profile_trace(tmp_path / "t.json", events))


def test_a_stream_wait_on_a_list_is_counted_not_a_traceback(tmp_path):
    wait = {"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": 0, "tid": 8, "ts": 10, "dur": 0,
            "args": {"cuda_sync_kind": "Stream Wait Event", "stream": 8, "correlation": 3, "device": 0,
                     "wait_on_stream": [7], "wait_on_cuda_event_record_corr_id": 1}}
    events = launch_and_kernel(1) + [wait] + launch_and_kernel(2, ts=12)
    trace, report = import_torch_profiler(write_profile_trace(tmp_path / "t.json", events))
    assert len(trace.events) == 4 and "sync on a stream that is a list" in report.text()


def test_a_grid_past_2_63_blocks_is_a_trace_format_error(tmp_path):
    events = launch_and_kernel(grid=[1 << 40, 1 << 40, 1])
    with pytest.raises(TraceFormatError, match="event 1: grid"):
        import_torch_profiler(write_profile_trace(tmp_path / "t.json", events))
