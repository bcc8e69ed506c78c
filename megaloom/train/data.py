"""Token streams for training: rows of ``seq_len + 1`` tokens with each token's position in its document.

A stream hands out global rows in order (:meth:`read`); every data rank reads the same rows and
keeps its own, so 2 micro-batches of 4 rows see exactly the rows one batch of 8 sees, and one
process accumulating D micro-batches reads what D data ranks read. Its :meth:`state` rides in
checkpoints, so a resume continues the same stream, at any world size.

- ``synthetic``: a seeded random bigram chain; row ``i`` is a pure function of ``(seed, i)``.
- ``files``: jsonl / json, parquet or text files (text: one document per paragraph) streamed by
  ``datasets`` (``streaming=True``), shuffled in a buffer if asked (seeded by the seed and the
  epoch), tokenized by a transformers tokenizer (a directory, or a ``tokenizers`` ``tokenizer.json``;
  none: UTF-8 bytes, vocab >= 256) with its EOS token closing each document, and **packed**:
  documents follow each other in the rows. Positions restart at 0 where a document (or a row)
  starts; given as ``position_ids``, they confine attention to the document (transformers masks
  packed sequences by them), and the label of a document's first token is masked (-100).
"""
from __future__ import annotations

import glob
import os
from typing import Any

import torch

from megaloom.runtime.errors import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}


class SyntheticTokens:
    """Walks a fixed random bigram chain: each token has ``branching`` possible successors.

    The chain (fixed by ``seed``) is learnable, so the loss of a model trained on it falls
    from ``log(vocab)`` towards ``log(branching)``.
    """

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int, branching: int = 2):
        self.vocab, self.seq_len, self.batch_size, self.seed, self.row = vocab, seq_len, batch_size, seed, 0
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=torch.Generator().manual_seed(seed))

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Token ids of rows ``start .. start + count - 1``: ``[count, seq_len + 1]``."""
        # a 63-bit seed distinct for every (seed, row)
        seeds = [(self.seed * 0x9E3779B97F4A7C15 + (start + i) * 0xBF58476D1CE4E5B9) % (1 << 63) for i in range(count)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = torch.empty(count, self.seq_len + 1, dtype=torch.long)
        out[:, 0] = torch.cat([torch.randint(0, self.vocab, (1,), generator=g) for g in gens])
        choice = torch.stack([torch.randint(0, self.successors.shape[1], (self.seq_len,), generator=g) for g in gens])
        for t in range(1, self.seq_len + 1):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t - 1]]
        return out

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Rank ``rank``'s ``batch_size`` rows of 0-based ``step`` when ``world`` ranks read a batch each."""
        return self.rows((step * world + rank) * self.batch_size, self.batch_size)

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``count`` rows: (tokens, positions), each ``[count, seq_len + 1]``."""
        tokens = self.rows(self.row, count)
        self.row += count
        return tokens, torch.arange(self.seq_len + 1).expand(count, -1)

    def state(self) -> dict[str, int]:
        return {"row": self.row}

    def load(self, state: dict[str, int]) -> None:
        self.row = int(state["row"])


class DocumentStream:
    """Documents of local files, tokenized and packed into rows (see the module doc).

    ``skip`` / ``take``: leave out the first ``skip`` documents, or keep only the first ``take``
    (a held-out eval split). The state is ``(epoch, document, offset)`` of the next token.
    """

    def __init__(self, path: str, tokenizer: str | None, seq_len: int, seed: int, field: str = "text",
                 shuffle_buffer: int = 0, skip: int = 0, take: int | None = None, vocab: int | None = None):
        self.files, self.builder = _files(path)
        self.path, self.field, self.seq_len, self.seed, self.shuffle = path, field, seq_len, seed, shuffle_buffer
        self.tokenizer = load_tokenizer(tokenizer, vocab)
        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source: files are read with 'datasets' (pip install 'megaloom[train]')") from None
        options = {"sample_by": "paragraph"} if self.builder == "text" else {}
        ds = datasets.load_dataset(self.builder, data_files=self.files, split="train", streaming=True, **options)
        ds = ds.skip(skip) if skip else ds  # before shuffling: the held-out documents stay out of every epoch
        self.dataset = ds.take(take) if take is not None else ds
        self.load({"epoch": 0, "doc": 0, "offset": 0})
        self._current = self._next_document()  # the files are read (and checked) now, not at the first step

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.doc, self.offset = (int(state[k]) for k in ("epoch", "doc", "offset"))
        self._docs = self._current = None

    def _next_document(self) -> torch.Tensor:
        """Tokens of the next non-empty document (the next epoch's first after the last)."""
        restarted = False
        while True:
            if self._docs is None:  # this epoch's documents from the current one on
                ds = self.dataset
                if self.shuffle:
                    ds = ds.shuffle(seed=self.seed, buffer_size=self.shuffle)
                    ds.set_epoch(self.epoch)
                self._docs = iter(ds.skip(self.doc))
            record = next(self._docs, None)
            if record is None:
                if restarted:
                    raise ConfigError(f"data.path: {self.path} has no documents with tokens in it")
                self.epoch, self.doc, self._docs, restarted = self.epoch + 1, 0, None, True
                continue
            ids = self._encode(record)
            if len(ids):
                return ids
            self.doc += 1

    def _encode(self, record: dict[str, Any]) -> torch.Tensor:
        text = record.get(self.field)
        if not isinstance(text, str):
            raise ConfigError(f"data.text_field: a record of {self.path} has no text field {self.field!r} "
                              f"(fields: {', '.join(record)})")
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()
        ids = self.tokenizer.encode(text)
        eos = self.tokenizer.eos_token_id
        return torch.tensor(ids + [eos] if eos is not None and ids[-1:] != [eos] else ids, dtype=torch.long)

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``count`` packed rows: (tokens, positions in the document), each ``[count, seq_len + 1]``."""
        n = self.seq_len + 1
        tokens, positions = torch.empty(count, n, dtype=torch.long), torch.empty(count, n, dtype=torch.long)
        for r in range(count):
            filled = 0
            while filled < n:
                if self._current is None:
                    self._current = self._next_document()
                piece = self._current[self.offset:self.offset + n - filled]
                tokens[r, filled:filled + len(piece)] = piece
                positions[r, filled:filled + len(piece)] = torch.arange(len(piece))
                filled, self.offset = filled + len(piece), self.offset + len(piece)
                if self.offset == len(self._current):
                    self.doc, self.offset, self._current = self.doc + 1, 0, None
        return tokens, positions


def load_tokenizer(path: str | None, vocab: int | None = None) -> Any:
    """A transformers tokenizer from a directory or a ``tokenizer.json`` (None: byte tokens), checked against
    ``vocab``."""
    tok, size = None, 256
    if path is not None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            tok = (PreTrainedTokenizerFast(tokenizer_file=path) if os.path.isfile(path)
                   else AutoTokenizer.from_pretrained(path, local_files_only=True))
        except Exception as e:  # transformers and tokenizers raise their own types
            raise ConfigError(f"data.tokenizer: cannot load a tokenizer from {path!r}: {e}") from None
        size = len(tok)
    if vocab is not None and size > vocab:
        raise ConfigError(f"data.tokenizer: {path or 'byte tokens'} has {size} tokens, more than the model's "
                          f"vocab_size {vocab}")
    return tok


def _files(path: str) -> tuple[list[str], str]:
    """The data files of ``path`` (a file, a directory or a glob) and their ``datasets`` builder."""
    files = sorted(glob.glob(os.path.join(path, "*")) if os.path.isdir(path) else glob.glob(path))
    files = [f for f in files if os.path.isfile(f) and (os.path.splitext(f)[1] in BUILDERS or not os.path.isdir(path))]
    builders = {BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if not files or None in builders or len(builders) > 1:
        raise ConfigError(f"data.path: {path!r} names no files of one kind ({', '.join(BUILDERS)})")
    return files, builders.pop()


def make_stream(cfg: dict, vocab: int, seed: int, split: str = "train") -> SyntheticTokens | DocumentStream:
    """The ``train`` or ``eval`` stream of a validated config (``data`` and ``eval`` sections)."""
    d, ev = cfg["data"], cfg["eval"]
    if d["source"] == "synthetic":
        stream = SyntheticTokens(vocab, d["seq_len"], d["batch_size"], seed, d["branching"])
        stream.row = 1 << 48 if split == "eval" else 0  # eval rows: far from any training row
        return stream
    held = 0 if ev["path"] else ev["holdout_docs"]
    if split == "eval":
        return DocumentStream(ev["path"] or d["path"], d["tokenizer"], d["seq_len"], seed, d["text_field"],
                              take=held or None, vocab=vocab)
    return DocumentStream(d["path"], d["tokenizer"], d["seq_len"], seed, d["text_field"], d["shuffle_buffer"],
                          skip=held, vocab=vocab)
