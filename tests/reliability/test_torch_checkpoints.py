"""Resuming from a plain torch DCP checkpoint (no megaloom manifest): corrupt tensor files, storage
paths that leave the folder and impossible steps are CheckpointErrors; nothing outside is read."""
from __future__ import annotations

import math
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megaloom.comm.communicator import LocalCommunicator
from megaloom.runtime.errors import CheckpointError
from megaloom.train.interop import load_torch, read_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


def _save(path, weight=None, step=2.0):
    """A torch user's checkpoint of a 3x4 linear layer and its AdamW state (get_state_dict layout)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = dict(opt.state[model.weight], step=torch.tensor(step))
    w = model.weight.detach() if weight is None else weight
    dcp.save({"model": {"weight": w}, "optim": {"state": {"weight": state}}}, checkpoint_id=str(path))
    return path


def _load(path):
    model = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    step = load_torch(str(path), LocalCommunicator(), {"weight": (model.weight, None)},
                      torch.optim.AdamW(model.parameters()))
    return step, model.weight.detach()


def _data(path) -> str:
    (name,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    return os.path.join(path, name)


def _truncate(f, tmp_path):
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def _random(f, tmp_path):
    n = os.path.getsize(f)
    with open(f, "wb") as fh:
        fh.write(os.urandom(n))


class _Payload:
    def __reduce__(self):
        return os.system, ("touch ran",)


def _pickle(f, tmp_path):
    n = os.path.getsize(f)
    raw = pickle.dumps(_Payload())
    with open(f, "wb") as fh:
        fh.write(raw + b"\0" * (n - len(raw)))  # the size the metadata expects


def _wrong_shape(f, tmp_path):
    other = _save(tmp_path / "other", weight=torch.ones(2, 2))
    shutil.copy(_data(other), f)


@pytest.mark.parametrize("corrupt", [_truncate, _random, _pickle, _wrong_shape],
                         ids=["truncated", "random", "pickle", "wrong shape"])
def test_a_bad_tensor_file_is_a_checkpoint_error(tmp_path, monkeypatch, corrupt):
    monkeypatch.chdir(tmp_path)
    ckpt = _save(tmp_path / "ckpt")
    corrupt(_data(ckpt), tmp_path)
    with pytest.raises(CheckpointError):
        _load(ckpt)
    assert not (tmp_path / "ran").exists()


def _relink(ckpt, where):
    md = read_metadata(str(ckpt))
    for info in md.storage_data.values():
        info.relative_path = where(info.relative_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("escape", ["../", "absolute", "symlink"])
def test_chunks_are_read_only_from_files_of_the_folder_itself(tmp_path, escape):
    outside = _save(tmp_path / "outside", weight=torch.full((3, 4), 7.0))
    ckpt = _save(tmp_path / "ckpt")
    if escape == "../":
        _relink(ckpt, lambda name: f"../outside/{name}")
    elif escape == "absolute":
        _relink(ckpt, lambda name: os.path.join(outside, name))
    else:
        os.unlink(_data(ckpt))
        os.symlink(_data(outside), os.path.join(ckpt, os.path.basename(_data(outside))))
    with pytest.raises(CheckpointError, match="not a checked regular file in the folder"):
        _load(ckpt)


@pytest.mark.parametrize("step", [math.nan, -5.0, 2.5])
def test_a_step_that_is_no_count_is_refused(tmp_path, step):
    with pytest.raises(CheckpointError, match="not a whole number >= 0"):
        _load(_save(tmp_path / "ckpt", step=step))

