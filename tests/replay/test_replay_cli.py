"""``megaloom replay`` on profiler traces: import report, identity error beside every what-if,
several ranks, directories, notices for knobs that cannot change an imported trace."""
import pytest

from megaloom.cli import main

from .kineto import call, kernel, sync, write
from .test_dependency_model import _rank

NCCL = "ncclKernel_AllReduce_RING_LL_Sum_float"


def test_single_trace_prints_report_identity_error_and_what_if(tmp_path, capsys):
    p = write(tmp_path / "t.json.gz", [call("cudaLaunchKernel", 0, 2, 1), kernel("flash_fwd_kernel", 3, 40, 1),
                                       call("cudaLaunchKernel", 4, 2, 2), kernel(NCCL, 44, 20, 2, stream=14)], gz=True)
    out_json = tmp_path / "pred.json"
    assert main(["replay", str(p), "--speedup", "flash=2", "--comm-speedup", "4", "--perfetto", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "import of" in text and "device NVIDIA A100-SXM4-40GB -> a100" in text
    assert "identity replay" in text and "what-if" in text and "+0.00%" in text
    busy = next(line for line in text.splitlines() if line.strip().startswith("busy cube"))
    assert busy.split()[-1] == "0.500x"  # flash twice as fast, beside its recording
    assert out_json.is_file()


def test_units_and_policy_on_an_imported_trace_give_a_notice(tmp_path, capsys):
    p = write(tmp_path / "t.json", [call("cudaLaunchKernel", 0, 2, 1), kernel("k", 3, 4, 1)])
    assert main(["replay", str(p), "--units", "vector=1", "--policy", "critical_path"]) == 0
    assert "cannot change an imported trace" in capsys.readouterr().out
    assert main(["replay", str(p), "--link-bandwidth", "100"]) == 0
    assert "--link-bandwidth changes nothing" in capsys.readouterr().out


def test_several_ranks_and_a_directory(tmp_path, capsys):
    d = tmp_path / "ranks"
    d.mkdir()
    for r, step in ((0, 10), (1, 40)):
        write(d / f"rank{r}.json", _rank(step, r), rank=r, world=2)
    assert main(["replay", str(d / "rank0.json"), str(d / "rank1.json")]) == 0
    text = capsys.readouterr().out
    assert text.count("import of") == 2 and "rank 1 of 2" in text
    assert main(["replay", str(d), "--comm-speedup", "2"]) == 0
    text = capsys.readouterr().out
    exposed = next(line for line in text.splitlines() if line.strip().startswith("exposed comm"))
    assert "+0.00%" in exposed or "-0.00%" in exposed


@pytest.mark.parametrize("argv, says", [
    (["replay", "nowhere.json"], "nowhere.json"),
    (["replay", "EMPTY_DIR"], "no .json or .json.gz trace files"),
    (["replay", "T", "--speedup", "flash"], "bad --speedup 'flash'"),
    (["replay", "T", "--speedup", "flash=-1"], "speedup of 'flash' must be a positive"),
    (["replay", "T", "--speedup", "flsh=2"], "'flsh' match(es) no task of this trace"),
    (["replay", "T", "--scope", "experts"], "'experts' match(es) no task"),
    (["replay", "T", "--layers", "layer.*=2"], "no annotation of this trace matches 'layer.*'"),
    (["replay", "T", "--comm-speedup", "0"], "comm speedup must be a positive"),
    (["replay", "nowhere.json", "--dim", "8=x"], "bad --dim '8=x'"),  # what-ifs checked before the file is read
    (["replay", "nowhere.json", "--dp", "0"], "dp must be a positive whole number"),
    (["replay", "T", "--profile", "tpu9"], "unknown hardware profile 'tpu9'"),
])
def test_bad_input_exits_2_naming_it(tmp_path, capsys, argv, says):
    (tmp_path / "EMPTY_DIR").mkdir()
    t = write(tmp_path / "t.json", [call("cudaLaunchKernel", 0, 2, 1), kernel("k", 3, 4, 1)])
    argv = [str(tmp_path / a) if a in ("EMPTY_DIR",) else str(t) if a == "T" else a for a in argv]
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_mismatched_ranks_name_the_collective(tmp_path, capsys):
    write(tmp_path / "r0.json", _rank(10, 0), rank=0, world=2)
    write(tmp_path / "r1.json", [call("cudaLaunchKernel", 0, 2, 1), kernel("k", 3, 4, 1),
                                 sync("Context Sync", 8, 1, 9)], rank=1, world=2)
    assert main(["replay", str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]) == 2
    assert "collective #0 does not match across ranks" in capsys.readouterr().err


def test_frozen_share_and_error_bars_are_printed(tmp_path, capsys):
    p = write(tmp_path / "t.json", [call("cudaLaunchKernel", 0, 2, 1), kernel("k", 3, 4, 1),
                                    call("cudaLaunchKernel", 30, 2, 2), kernel("k2", 33, 4, 2)])
    assert main(["replay", str(p), "--speedup", "k*=2", "--dim", "4=8"]) == 0
    text = capsys.readouterr().out
    frozen = next(line for line in text.splitlines() if "frozen (no what-if moves it)" in line)
    assert "host between calls: untraced (Python, idle)" in frozen  # the 28 us between the two launches
    assert "error bar of op speed what-ifs:" in text and "error bar of shape what-ifs:" in text


def test_wrong_files_say_what_to_do(tmp_path, capsys):
    from megaloom.runtime import Trace, TraceEvent
    from megaloom.runtime.perfetto import write_chrome

    run = Trace([TraceEvent(0, "a", "matmul", "cube", 0, 0, 0.0, 1e-6)], {"graph": "g", "mode": "execute"})
    write_chrome(run, tmp_path / "run.json")
    assert main(["replay", str(tmp_path / "run.json")]) == 2
    assert "megaloom's own Perfetto export" in capsys.readouterr().err
    Trace(run.events, {"graph": "train-step-3", "mode": "execute"}).save(tmp_path / "step3.rank0.trace")
    assert main(["replay", str(tmp_path / "step3.rank0.trace")]) == 2
    assert "trainer step trace" in capsys.readouterr().err
    p = write(tmp_path / "t.json", [call("cudaLaunchKernel", 0, 2, 1), kernel("k", 3, 4, 1)])
    assert main(["trace", "summary", str(p)]) == 2
    assert f"`megaloom replay {p}`" in capsys.readouterr().err


def test_a_second_format_plugs_in_through_the_registry(tmp_path):
    from megaloom.runtime import Trace, TraceEvent
    from megaloom.scheduler import importers

    def load(paths):
        return Trace([TraceEvent(0, "k", "k", "vector", 0, 0, 0.0, 2e-6)], {"mode": "import", "source": "toy"}), []

    importers.register(importers.Format("toy", lambda head: head.startswith(b"TOY"), load, ("toy_kernel",)))
    try:
        (tmp_path / "x.toy").write_bytes(b"TOY trace")
        assert importers.load_trace(tmp_path / "x.toy").meta["source"] == "toy"
        assert "toy_kernel" in importers.labels()
    finally:
        importers.FORMATS[:] = [f for f in importers.FORMATS if f.name != "toy"]
