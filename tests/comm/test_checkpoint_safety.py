"""Checkpoints from a bad folder: nothing unpickled, nothing read outside the folder, every
failure a CheckpointError; a save killed at any step (twice in a row) leaves one loadable."""
from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import time

import msgpack
import pytest
import torch

from megaloom.comm import LocalCommunicator
from megaloom.comm.checkpoint import MANIFEST, load_params, save_params, verify
from megaloom.comm.spawn import run_world
from megaloom.runtime.errors import CheckpointError, CommError, MegaloomError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _params(value: float) -> dict:
    return {"w": (torch.full((3, 4), value), None), "b": (torch.full((4,), value), None)}


def _loaded(path) -> float:
    params = _params(-1.0)
    load_params(path, LocalCommunicator(), params)
    w = params["w"][0]
    assert torch.equal(params["b"][0], torch.full((4,), w[0, 0].item()))
    return w[0, 0].item()


def _rewrite_manifest(path, change) -> None:
    f = os.path.join(path, MANIFEST)
    man = msgpack.unpackb(open(f, "rb").read(), raw=False)
    change(man)
    open(f, "wb").write(msgpack.packb(man, use_bin_type=True))


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_in_the_folder_never_runs(tmp_path):
    ck, marker = str(tmp_path / "ck"), str(tmp_path / "pwned")
    save_params(ck, LocalCommunicator(), _params(1.0))
    evil = pickle.dumps(_Payload(marker))
    # 1. .metadata replaced and dropped from the manifest: an unlisted file is refused
    open(os.path.join(ck, ".metadata"), "wb").write(evil)
    _rewrite_manifest(ck, lambda m: m["files"].pop(".metadata"))
    with pytest.raises(CheckpointError, match="'.metadata' is not listed in the manifest"):
        _loaded(ck)
    # 2. an empty file table does not turn verification off
    _rewrite_manifest(ck, lambda m: m.update(files={}))
    with pytest.raises(CheckpointError, match="lacks its file"):
        _loaded(ck)
    # 3. a manifest rewritten to match the payload: .metadata is never opened, the load works
    import hashlib

    def relist(m):
        m["files"] = {n: [os.path.getsize(os.path.join(ck, n)), hashlib.sha256(open(os.path.join(ck, n), "rb").read()).hexdigest()]
                      for n in os.listdir(ck) if n != MANIFEST}
    _rewrite_manifest(ck, relist)
    assert _loaded(ck) == 1.0
    assert not os.path.exists(marker)


@pytest.mark.parametrize("name", ["../../etc/hostname", "/etc/passwd", "sub/x", "..", ""])
def test_manifest_paths_stay_in_the_folder(tmp_path, name):
    ck = str(tmp_path / "ck")
    save_params(ck, LocalCommunicator(), _params(1.0))
    _rewrite_manifest(ck, lambda m: m["files"].update({name: [1, "0" * 64]}))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        verify(ck)


@pytest.fixture
def saved(tmp_path) -> tuple[str, str]:
    """A checkpoint of ``_params(1.0)`` and the name of its data file."""
    ck = str(tmp_path / "ck")
    save_params(ck, LocalCommunicator(), _params(1.0))
    return ck, next(n for n in os.listdir(ck) if n.endswith(".distcp"))


def test_links_and_folders_in_the_checkpoint_are_refused(tmp_path, saved):
    ck, data = saved
    target = tmp_path / "elsewhere"
    shutil.copy(os.path.join(ck, data), target)
    os.unlink(os.path.join(ck, data))
    os.symlink(target, os.path.join(ck, data))
    with pytest.raises(CheckpointError, match="not a regular file"):
        verify(ck)
    os.unlink(os.path.join(ck, data))
    os.mkdir(os.path.join(ck, data))
    with pytest.raises(CheckpointError, match="not a regular file"):
        verify(ck)


def test_consistently_rewritten_chunks_fail_as_checkpoint_error(saved):
    """Data that hashes right but is no tensor: DCP's CheckpointException (a BaseException) is wrapped."""
    import hashlib

    ck, data = saved
    junk = os.urandom(os.path.getsize(os.path.join(ck, data)))
    open(os.path.join(ck, data), "wb").write(junk)
    _rewrite_manifest(ck, lambda m: m["files"].update({data: [len(junk), hashlib.sha256(junk).hexdigest()]}))
    with pytest.raises(CheckpointError, match="loading failed"):
        _loaded(ck)
    # metadata pointing past the end of a file is refused before DCP reads anything
    def stretch(m):
        m["dcp"]["storage"][0][5] = 10**9
    _rewrite_manifest(ck, stretch)
    with pytest.raises(CheckpointError, match="reads bytes"):
        verify(ck)


def test_optimizer_state_larger_than_its_parameter_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    params = _params(1.0)
    opt = torch.optim.SGD([t for t, _ in params.values()], lr=0.1, momentum=0.9)
    for t, _ in params.values():
        t.requires_grad_(True).grad = torch.ones_like(t)
    opt.step()
    save_params(ck, LocalCommunicator(), params, opt)
    _rewrite_manifest(ck, lambda m: m["tensors"]["optim.state.w.momentum_buffer"].update(shape=[10**6, 10**6]))
    fresh = _params(0.0)
    with pytest.raises(CheckpointError):
        load_params(ck, LocalCommunicator(), fresh, torch.optim.SGD([t for t, _ in fresh.values()], lr=0.1))


def test_disk_full_during_save_is_a_checkpoint_error(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    ck = str(tmp_path / "ck")
    save_params(ck, LocalCommunicator(), _params(1.0))
    real = filesystem.FileSystem.create_stream

    def full(self, path, mode):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
    with pytest.raises(CheckpointError, match="disk full|No space left"):
        save_params(ck, LocalCommunicator(), _params(2.0))
    monkeypatch.undo()
    assert _loaded(ck) == 1.0 and not os.path.exists(ck + ".partial")


# -- killed saves ---------------------------------------------------------------------

def _save_killed_at(path: str, value: float, kill_at: int) -> bool:
    """Save ``value`` in a forked child that dies (SIGKILL-like, no cleanup) at its
    ``kill_at``-th file-system step; True when the save finished before that step."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        try:
            import torch.distributed.checkpoint.filesystem as fs
            from megaloom.runtime import trace

            torch.set_num_threads(1)
            count = [0]

            def step(fn):
                def wrapped(*a, **kw):
                    count[0] += 1
                    if count[0] == kill_at:
                        os._exit(9)
                    return fn(*a, **kw)
                return wrapped

            os.replace, os.makedirs, os.fsync = step(os.replace), step(os.makedirs), step(os.fsync)
            shutil.rmtree = step(shutil.rmtree)
            fs._write_files_from_queue = step(fs._write_files_from_queue)
            trace.atomic_write = step(trace.atomic_write)
            save_params(path, LocalCommunicator(), _params(value))
            os._exit(0)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("a checkpoint save hung")
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 9), f"save failed with exit code {code}"
    return code == 0


def _steps(path: str) -> int:
    n = 1
    while not _save_killed_at(path, 0.0, n):
        n += 1
    return n - 1


_LEFT = ("", ".old", ".partial")  # what a save may leave: the checkpoint, the previous one, the new one


def _copy_state(src: str, dst: str) -> None:
    for s in _LEFT:
        shutil.rmtree(dst + s, ignore_errors=True)
        if os.path.exists(src + s):
            shutil.copytree(src + s, dst + s)


def test_a_save_killed_at_any_step_twice_leaves_a_checkpoint(tmp_path):
    base = str(tmp_path / "base")
    save_params(base, LocalCommunicator(), _params(1.0))
    n = _steps(str(tmp_path / "count"))
    assert n >= 8  # prepare (3), DCP write, manifest (2), two renames, cleanup
    ck, snap = str(tmp_path / "ck"), str(tmp_path / "snap")
    seen = set()  # folder states a first kill left; each distinct one is killed again at every step
    for first in range(1, n + 1):
        _copy_state(base, ck)
        assert not _save_killed_at(ck, 2.0, first)
        state = (_loaded(ck),) + tuple(os.path.exists(ck + s) for s in _LEFT)
        assert state[0] in (1.0, 2.0), first
        _copy_state(ck, snap)
        for second in [None] + (list(range(1, n + 1)) if state not in seen else []):
            _copy_state(snap, ck)
            if second is not None:
                assert not _save_killed_at(ck, 3.0, second)
                assert _loaded(ck) in (1.0, 2.0, 3.0), (first, second)
            save_params(ck, LocalCommunicator(), _params(4.0))  # the next save cleans up
            assert _loaded(ck) == 4.0
            assert not os.path.exists(ck + ".partial") and not os.path.exists(ck + ".old")
        seen.add(state)
    # untouched; a partial beside it; the old moved aside (only .old loadable); the new installed
    assert {(v, c, o) for v, c, o, _ in seen} >= {(1.0, True, False), (1.0, False, True), (2.0, True, True)}


# -- two gloo ranks -------------------------------------------------------------------

def world_killed_save(comm, path: str, kill_rank: int, kill_at: str):
    """Save 1.0, then save 2.0 with ``kill_rank`` dying at ``kill_at``; survivors report their error."""
    import torch.distributed.checkpoint as dcp
    from megaloom.comm import checkpoint

    save_params(path, comm, _params(1.0))
    if comm.rank == kill_rank:
        if kill_at == "dcp":
            dcp.save = lambda *a, **kw: os._exit(9)
        else:
            checkpoint._install = lambda *a: os._exit(9)
    try:
        save_params(path, comm, _params(2.0))
    except MegaloomError as e:
        return {"type": type(e).__name__, "error": str(e)}
    return {"type": None}


@pytest.mark.dist
@pytest.mark.parametrize("kill_rank,kill_at", [(1, "dcp"), (0, "install")])
def test_peer_dying_during_save_gives_comm_error(tmp_path, kill_rank, kill_at):
    ck = str(tmp_path / "ck")
    out = run_world(world_killed_save, 2, ck, kill_rank, kill_at, timeout=60, comm_timeout=3, allow_fail=True)
    assert out[kill_rank] is None
    survivor = out[1 - kill_rank]
    assert survivor["type"] == CommError.__name__, survivor
    assert _loaded(ck) in (1.0, 2.0)
    save_params(ck, LocalCommunicator(), _params(4.0))
    assert _loaded(ck) == 4.0 and not os.path.exists(ck + ".partial") and not os.path.exists(ck + ".old")


def test_checkpoint_files_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        ck = str(tmp_path / "ck")
        save_params(ck, LocalCommunicator(), _params(1.0), extra={"step": 1})
        save_params(ck, LocalCommunicator(), _params(2.0), extra={"step": 2})  # through the .old swap
    finally:
        os.umask(old)
    modes = {n: os.stat(os.path.join(ck, n)).st_mode & 0o777 for n in os.listdir(ck)}
    assert set(modes) >= {MANIFEST, "megaloom.extra", ".metadata"}
    assert set(modes.values()) == {0o640}, modes  # one mode for shards, DCP metadata and megaloom's files
    assert os.stat(ck).st_mode & 0o777 == 0o750
