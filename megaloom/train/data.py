"""Token streams for training: a seeded synthetic stream and a local text file (byte tokens).

Batches are a pure function of ``(seed, step, rank)``, so the data position of a run is
its step number: resuming at step k reads exactly the batches an uninterrupted run reads.
"""
from __future__ import annotations

import os

import torch

from megaloom.runtime.errors import ConfigError


class SyntheticTokens:
    """Walks a fixed random bigram chain: each token has ``branching`` possible successors.

    The chain (fixed by ``seed``) is learnable, so the loss of a model trained on it falls
    from ``log(vocab)`` towards ``log(branching)``.
    """

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int, branching: int = 2):
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.seq_len, self.batch_size, self.seed = vocab, seq_len, batch_size, seed
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=gen)

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Token ids ``[batch_size, seq_len + 1]`` (inputs are ``[:, :-1]``, labels ``[:, 1:]``)."""
        gen = torch.Generator().manual_seed(_mix(self.seed, step, rank))
        b, n = self.batch_size, self.seq_len + 1
        out = torch.empty(b, n, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (b,), generator=gen)
        choice = torch.randint(0, self.successors.shape[1], (b, n - 1), generator=gen)
        for t in range(1, n):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t - 1]]
        return out


class TextTokens:
    """Byte-level tokens of a local text file; windows drawn in a seeded order per epoch."""

    def __init__(self, path: str | os.PathLike, vocab: int, seq_len: int, batch_size: int, seed: int):
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {path}: {e.strerror}") from None
        if not raw:
            raise ConfigError(f"data.path: {path} is empty")
        if vocab < 256:
            raise ConfigError(f"data.source 'text' uses byte tokens: model vocab_size must be >= 256, got {vocab}")
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.windows = (len(self.tokens) - 1) // seq_len
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, window permutation)
        if self.windows < 1:
            raise ConfigError(f"data.path: {path} has {len(self.tokens)} bytes, fewer than data.seq_len + 1 = {seq_len + 1}")

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Rows ``(step * world + rank) * batch_size + i`` of the epoch-wise shuffled windows."""
        rows = []
        for i in range(self.batch_size):
            epoch, pos = divmod((step * world + rank) * self.batch_size + i, self.windows)
            start = int(self._epoch_order(epoch)[pos]) * self.seq_len
            rows.append(self.tokens[start:start + self.seq_len + 1])
        return torch.stack(rows)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(_mix(self.seed, epoch, 0))
            self._order = (epoch, torch.randperm(self.windows, generator=gen))
        return self._order[1]


def _mix(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed distinct for every (seed, step, rank)."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % (1 << 63)


def make_stream(data_cfg: dict, vocab: int, seed: int) -> SyntheticTokens | TextTokens:
    """The stream described by a validated ``data`` config section."""
    if data_cfg["source"] == "text":
        return TextTokens(data_cfg["path"], vocab, data_cfg["seq_len"], data_cfg["batch_size"], seed)
    return SyntheticTokens(vocab, data_cfg["seq_len"], data_cfg["batch_size"], seed, data_cfg["branching"])
