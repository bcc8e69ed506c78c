"""Token streams: synthetic rows are a pure function of (seed, row); files are tokenized, packed with
document masks and labels masked at document starts, and continue where a checkpoint left them."""
import json

import pytest
import torch

from megaloom.models.hf_moe import build_model
from megaloom.runtime.errors import ConfigError
from megaloom.train.data import DocumentStream, SyntheticTokens, load_tokenizer
from megaloom.train.parallel.context import split
from megaloom.train.trainer import Trainer

from .tiny import tiny_config, write_corpus


def test_synthetic_rows_are_deterministic_and_follow_the_chain():
    a, b = SyntheticTokens(50, 8, 3, seed=1), SyntheticTokens(50, 8, 3, seed=1)
    x = a.batch(4, rank=1)
    assert x.shape == (3, 9) and torch.equal(x, b.batch(4, rank=1))
    assert not torch.equal(x, a.batch(5, rank=1)) and not torch.equal(x, a.batch(4, rank=0))
    for t in range(1, 9):  # every token is one of its predecessor's successors
        assert (a.successors[x[:, t - 1]] == x[:, t, None]).any(dim=1).all()
    assert torch.equal(a.rows(0, 8)[3:5], a.rows(3, 2))  # a row does not depend on the batch it is read in
    a.read(5)
    b.load(a.state())
    assert torch.equal(a.read(4)[0], b.read(4)[0]) and a.state() == {"row": 9}


def test_packing_masks_documents_and_resumes_exactly(tmp_path):
    path, tok_dir = write_corpus(tmp_path)
    tok = load_tokenizer(tok_dir)
    docs = [json.loads(line)["text"] for line in open(path)]
    stream = DocumentStream(path, tok_dir, seq_len=15, seed=0)
    tokens, positions = stream.read(6)
    flat = [tok.encode(d) + [tok.eos_token_id] for d in docs]
    want = torch.tensor([t for d in flat for t in d][:6 * 16])
    assert torch.equal(tokens.flatten(), want)  # documents in order, each closed by EOS, 16 tokens a row
    starts = torch.tensor([p == 0 for d in flat for p in range(len(d))][:6 * 16]).view(6, 16)
    starts[:, 0] = True  # positions restart at every document and every row
    index = torch.arange(16).expand(6, 16)
    assert torch.equal(positions, index - torch.where(starts, index, 0).cummax(1).values)
    _, labels, _ = split(tokens, positions, 0, 1)
    assert torch.equal(labels == -100, positions[:, 1:] == 0)  # a document's first token is never a target
    state = stream.state()
    more = stream.read(40)  # past the end: the next epoch starts again at the first document
    assert stream.state()["epoch"] == 1
    again = DocumentStream(path, tok_dir, seq_len=15, seed=0)
    again.load(state)
    assert all(torch.equal(a, b) for a, b in zip(more, again.read(40)))
    shuffled = DocumentStream(path, tok_dir, seq_len=15, seed=0, shuffle_buffer=8)
    first = shuffled.read(3)[0]
    assert not torch.equal(first, tokens[:3])
    held = DocumentStream(path, tok_dir, seq_len=15, seed=0, skip=5)
    assert torch.equal(held.read(1)[0][0, :4], torch.tensor(flat[5][:4]))


def test_document_masks_keep_packed_documents_apart(tmp_path):
    """The logits of a document packed after another equal its logits alone (transformers masks by position_ids)."""
    model = build_model(tiny_config(tmp_path)["model"], 0).eval()
    a, b = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 9))
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits
        alone = model(input_ids=b, use_cache=False).logits
        unmasked = model(input_ids=packed, use_cache=False).logits
    assert torch.allclose(together[:, 7:], alone, atol=1e-5)
    assert not torch.allclose(unmasked[:, 7:], alone, atol=1e-3)


@pytest.mark.parametrize("kind", ["parquet", "txt"])
def test_parquet_and_text_files(tmp_path, kind):
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["alpha beta", "gamma"]}), tmp_path / "d.parquet")
        stream = DocumentStream(str(tmp_path / "d.parquet"), None, seq_len=7, seed=0, field="body")
        assert bytes(stream.read(2)[0].flatten().tolist()) == b"alpha betagammaalpha b"[:16]
    else:
        (tmp_path / "d.txt").write_text("one two\nthree\n\nfour\n")  # paragraphs are the documents
        tokens, positions = DocumentStream(str(tmp_path), None, seq_len=7, seed=0).read(2)
        assert bytes(tokens.flatten().tolist()) == b"one two\nthreefou"  # paragraphs lose their last newline
        assert positions.tolist() == [list(range(8)), [0, 1, 2, 3, 4, 0, 1, 2]]


def test_file_errors(tmp_path):
    path, tok_dir = write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="data.path: .* names no files"):
        DocumentStream(str(tmp_path / "none.jsonl"), None, 8, 0)
    with pytest.raises(ConfigError, match="no text field 'body'"):
        DocumentStream(path, None, 8, 0, field="body")
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "corpus.jsonl"))
    with pytest.raises(ConfigError, match="has 98 tokens, more than the model's vocab_size 64"):
        load_tokenizer(tok_dir, vocab=64)
    with pytest.raises(ConfigError, match="byte tokens has 256 tokens"):
        Trainer(tiny_config(tmp_path / "r", data={"source": "files", "path": path}))


def test_accumulated_micro_batches_see_the_batch(tmp_path):
    """2 micro-batches of 4 train on exactly the rows one batch of 8 does: same losses, same weights."""
    whole = Trainer(tiny_config(tmp_path / "a", steps=3, data={"batch_size": 8}))
    split_ = Trainer(tiny_config(tmp_path / "b", steps=3, data={"batch_size": 4}, optimizer={"grad_accum_steps": 2}))
    for a, b in zip(whole.fit(), split_.fit()):
        assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.tokens == a.tokens == 8 * 16
    for (name, p), q in zip(whole.model.named_parameters(), split_.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
