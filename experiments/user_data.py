"""Your own data for fine-tuning (``python -m experiments.train --init-from <folder> --data ...``).

``--data`` names files or folders (comma-separated; a folder gives its ``*.txt``, ``*.md``,
``*.jsonl`` and ``*.json`` files, sorted), tokenized with the checkpoint's own tokenizer:

* **text** (any other suffix): a document per file, cut into paragraphs at blank lines; the
  held-out paragraphs are joined back (``"\\n\\n"``) into the file's held-out text, the rest into
  its training text, so a file's text flows without end-of-text tokens inside it.
* **JSON lines** (``.jsonl`` / ``.json``, one object a line): ``{"text": ...}`` is a document;
  ``{"prompt": ..., "completion": ...}`` is an example whose loss counts only the completion and
  the end-of-text token after it (the prompt's tokens are loss-masked). Documents and prompts are
  encoded with the tokenizer's special tokens (Llama's BOS first), completions without.

Split: paragraph or line ``k`` of all the data is held out when ``u[k] < val_fraction`` with
``u = np.random.default_rng(seed).random(n)`` (at least one is held out). Documents and examples
are joined with the tokenizer's end-of-text id into one token stream per split: the job's batches
are windows of ``seq + 1`` tokens of it (packing to the sequence length: no padding).

Loss masks travel in the stream itself, as :mod:`models.llama` reads them: id ``t`` counts,
``-1 - t`` is token ``t`` whose prediction the loss skips. Streams are int32.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from experiments.data import TokenData, Tokenizer

TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")


def masked(ids: Sequence[int]) -> list[int]:
    """``ids`` marked as not counted by the loss (``-1 - t`` each)."""
    return [-1 - int(t) for t in ids]


def data_files(spec: str | Sequence[str]) -> list[str]:
    """The files of ``--data`` (comma-separated string or a list): files as given, folders as
    their ``.txt``/``.md``/``.jsonl``/``.json`` files, sorted.

    Raises:
      ValueError: a path that does not exist, a folder with no such file, or nothing given.
    """
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p and p.strip()]
    if not parts:
        raise ValueError("--data names no file: give text files, JSON-lines files or folders, comma-separated")
    files = []
    for p in parts:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if f.endswith(TEXT_SUFFIXES + JSON_SUFFIXES) and os.path.isfile(os.path.join(p, f)))
            if not found:
                raise ValueError(f"--data {p}: the folder has no .txt, .md, .jsonl or .json file")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"--data {p}: no such file or folder")
    return files


def _records(path: str) -> list[dict]:
    """The examples of one file: ``{"text": paragraph, "file": path}`` per paragraph of a text
    file; the parsed object per line of a JSON-lines file (``{"prompt", "completion"}`` or ``{"text"}``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            content = fh.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
                         "save it as UTF-8") from None
    if not path.endswith(JSON_SUFFIXES):
        paras = [p.strip("\n") for p in content.replace("\r\n", "\n").split("\n\n")]
        return [{"text": p, "file": path} for p in paras if p.strip()]
    out = []
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--data {path}:{n}: not JSON ({e.msg}): one object a line") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
            out.append({"prompt": obj["prompt"], "completion": obj["completion"]})
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            out.append({"text": obj["text"]})
        else:
            raise ValueError(f'--data {path}:{n}: expected {{"text": ...}} or {{"prompt": ..., "completion": ...}}')
    return out


def _continuation(tok: Tokenizer, text: str) -> list[int]:
    """``text``'s ids without the tokenizer's added special tokens (no BOS before a completion)."""
    hf = getattr(tok, "hf", None)
    if hf is not None and hasattr(hf, "encode"):
        try:
            return list(hf.encode(text, add_special_tokens=False).ids)
        except TypeError:  # a tokenizer whose encode takes no add_special_tokens
            pass
    return tok.encode(text)


def _stream(records: list[dict], tok: Tokenizer) -> np.ndarray:
    """One token stream: text files' paragraphs re-joined per file, JSON documents and examples,
    each followed by the end-of-text id; prompts loss-masked."""
    ids: list[int] = []
    k = 0
    while k < len(records):
        r = records[k]
        if "file" in r:  # consecutive paragraphs of one text file: one document
            j = k
            while j < len(records) and records[j].get("file") == r["file"]:
                j += 1
            ids += tok.encode("\n\n".join(x["text"] for x in records[k:j])) + [tok.eot_id]
            k = j
            continue
        if "prompt" in r:
            ids += masked(tok.encode(r["prompt"])) + _continuation(tok, r["completion"]) + [tok.eot_id]
        else:
            ids += tok.encode(r["text"]) + [tok.eot_id]
        k += 1
    return np.asarray(ids, np.int32)


def load_user_data(spec: str | Sequence[str], tokenizer: Tokenizer, val_fraction: float = 0.1, seed: int = 0,
                   min_val_tokens: int = 2, min_train_tokens: int = 2) -> TokenData:
    """Tokenized train / held-out streams of ``--data`` (module docstring).

    Args:
      spec: ``--data`` (comma-separated string or list of paths).
      tokenizer: the checkpoint's tokenizer (:class:`experiments.data.Tokenizer`).
      val_fraction: share of paragraphs / lines held out, in (0, 1).
      seed: the split's seed.
      min_val_tokens, min_train_tokens: the fewest tokens each stream must have (the job needs
        ``batch * seq + 1`` held-out and ``seq + 1`` training tokens).
    Returns:
      :class:`experiments.data.TokenData` with int32 ``train`` / ``val`` (loss-masked ids
      negative) and ``meta``: ``data_files``, ``train_examples``, ``val_examples``,
      ``masked_train_tokens``, ``sample_prompt`` (the first held-out prompt, or the first words
      of the first held-out text: what the job samples from before and after).
    Raises:
      ValueError: a missing file, a bad JSON line, no data, or a split with too few tokens (one line
        saying what to change).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    files = data_files(spec)
    records = [r for f in files for r in _records(f)]
    if len(records) < 2:
        raise ValueError(f"--data {','.join(files)}: {len(records)} example(s); need at least 2 (paragraphs of a text "
                         "file, or lines of a JSON-lines file) to hold one out")
    u = np.random.default_rng(seed).random(len(records))
    held = u < val_fraction
    if not held.any():
        held[int(np.argmin(u))] = True
    if held.all():
        held[int(np.argmax(u))] = False
    train_recs = [r for r, h in zip(records, held) if not h]
    val_recs = [r for r, h in zip(records, held) if h]
    train, val = _stream(train_recs, tokenizer), _stream(val_recs, tokenizer)
    for name, arr, need in (("held-out", val, min_val_tokens), ("training", train, min_train_tokens)):
        if arr.size < need:
            raise ValueError(f"--data: the {name} split has {arr.size} tokens, fewer than the {need} the job needs "
                             "(batch x seq + 1 held-out, seq + 1 training): give more data or lower --batch / --seq")
    first = val_recs[0]
    prompt = first["prompt"] if "prompt" in first else " ".join(first["text"].split()[:4])
    meta = {"data_files": files, "train_examples": len(train_recs), "val_examples": len(val_recs),
            "masked_train_tokens": int((train < 0).sum()), "sample_prompt": prompt, "val_fraction": val_fraction,
            "seed": seed}
    return TokenData(train, val, tokenizer.vocab_size, tokenizer, meta)
