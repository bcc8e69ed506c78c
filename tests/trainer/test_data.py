"""Token streams: batches are a pure function of (seed, step, rank)."""
import pytest
import torch

from megaloom.train.data import SyntheticTokens, TextTokens
from megaloom.runtime.errors import ConfigError


def test_synthetic_is_deterministic_and_follows_the_chain():
    a, b = SyntheticTokens(50, 8, 3, seed=1), SyntheticTokens(50, 8, 3, seed=1)
    x = a.batch(4, rank=1)
    assert x.shape == (3, 9) and torch.equal(x, b.batch(4, rank=1))
    assert not torch.equal(x, a.batch(5, rank=1)) and not torch.equal(x, a.batch(4, rank=0))
    for t in range(1, 9):  # every token is one of its predecessor's successors
        assert (a.successors[x[:, t - 1]] == x[:, t, None]).any(dim=1).all()


def test_text_windows_cover_the_file_without_repeats_within_an_epoch(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) + bytes(range(255, -1, -1)))  # window starts differ
    s = TextTokens(f, vocab=256, seq_len=16, batch_size=4, seed=0)
    windows = (512 - 1) // 16
    starts = []
    for step in range(windows // 8):
        for rank in range(2):
            starts += [int(r[0]) for r in s.batch(step, rank, world=2)]
    assert len(set(starts)) == len(starts)
    for row in s.batch(3):  # each row is a window of the file
        assert any(torch.equal(row, s.tokens[i:i + 17]) for i in range(0, 512 - 16, 16))


def test_text_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        TextTokens(tmp_path / "nope", 256, 4, 1, 0)
    (tmp_path / "small").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="fewer than data.seq_len"):
        TextTokens(tmp_path / "small", 256, 4, 1, 0)
    with pytest.raises(ConfigError, match="vocab_size must be >= 256"):
        TextTokens(tmp_path / "small", 100, 1, 1, 0)
