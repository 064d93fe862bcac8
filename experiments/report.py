"""Run folders that are never half-written, and the loss picture.

A run writes into ``<out_dir>/<time>-<model>.partial/`` and :meth:`RunFolder.commit` renames it
to its final name only when everything is written; :meth:`RunFolder.discard` removes it after a
failure, so an interrupted or failed run leaves no folder behind.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time

PARTIAL_SUFFIX = ".partial"


@dataclasses.dataclass
class RunFolder:
    """A run's output folder, written under a ``.partial`` name until committed."""

    path: pathlib.Path
    final: pathlib.Path

    @classmethod
    def create(cls, out_dir: str | os.PathLike, model: str) -> "RunFolder":
        root = pathlib.Path(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = f"{stamp}-{model}"
        final = root / base
        k = 1
        while final.exists() or (root / (final.name + PARTIAL_SUFFIX)).exists():
            final = root / f"{base}-{k}"
            k += 1
        path = root / (final.name + PARTIAL_SUFFIX)
        path.mkdir()
        return cls(path, final)

    def write_json(self, name: str, obj) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=1, default=_jsonable) + "\n")
        os.replace(tmp, self.path / name)

    def write_text(self, name: str, text: str) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path / name)

    def commit(self) -> pathlib.Path:
        os.replace(self.path, self.final)
        self.path = self.final
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _jsonable(x):
    try:
        import numpy as np
        if isinstance(x, np.generic):
            return x.item()
    except ImportError:
        pass
    return str(x)


def plot_losses(png: os.PathLike, metrics_jsonl: os.PathLike, title: str = "") -> None:
    """Training loss (raw and smoothed) and validation loss against tokens, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = [json.loads(l) for l in open(metrics_jsonl)]
    tr = [(r["tokens"], r["loss"]) for r in recs if "loss" in r]
    va = [(r["tokens"], r["val_loss"]) for r in recs if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if tr:
        t, l = map(np.asarray, zip(*tr))
        ax.plot(t, l, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        k = max(1, len(l) // 40)
        if len(l) > k:
            sm = np.convolve(l, np.ones(k) / k, mode="valid")
            ax.plot(t[k - 1:], sm, color="tab:blue", lw=1.8, label=f"train ({k}-step mean)")
    if va:
        t, l = map(np.asarray, zip(*va))
        ax.plot(t, l, "o-", color="tab:orange", lw=1.8, label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def replace_marked_section(path: os.PathLike, start: str, end: str, block: str,
                           new_file_title: str = "# Benchmarks and recorded GPU runs\n") -> None:
    """Write ``block`` (which begins with the marker ``start`` and ends with ``end``) into the
    markdown file ``path``: it replaces the text between an earlier run's markers, or is appended
    (the file is created with ``new_file_title`` if missing). Every benchmark's docs section goes
    through here, so rerunning a run rewrites its section and nothing else."""
    text = open(path).read() if os.path.exists(path) else new_file_title
    block = block.rstrip("\n")
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as fh:
        fh.write(text)
