"""Run folders that are never half-written, the loss picture, and the anchors' units of a
throughput row (:func:`anchor_units`).

A run writes into ``<out_dir>/<time>-<model>.partial/`` and :meth:`RunFolder.commit` renames it
to its final name only when everything is written; :meth:`RunFolder.discard` removes it after a
failure, so an interrupted or failed run leaves no folder behind.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import time

PARTIAL_SUFFIX = ".partial"
#: The H200's bf16 dense datasheet peak as the anchors (SuperOffload, ZenFlow) quote it, TFLOP/s.
ANCHOR_PEAK_TFLOPS = 989.0
#: Keys :func:`anchor_units` adds to a benchmark row.
ANCHOR_KEYS = ("model_tflops", "model_tflops_share_989", "model_mfu", "host_bytes_per_param")


def anchor_units(tokens_per_s: float | None, n_params: int, *, matmul_tflops: float | None = None,
                 host_bytes: int | None = None, n_devices: int = 1) -> dict:
    """A throughput row in the units of the offload papers (issue 23 item 4).

    Args:
      tokens_per_s: measured tokens per second of the whole step (all devices), or None.
      n_params: model parameters N.
      matmul_tflops: the bf16 matmul probe's rate of the same call (one device), TFLOP/s.
      host_bytes: host memory the system keeps for model data (bytes), or None.
      n_devices: devices the step ran on (the per-device figures divide by it).

    Returns:
      ``model_tflops``: 6 N FLOPs per token times tokens/s (recompute and attention not counted),
      TFLOP/s over all devices; ``model_tflops_share_989``: its per-device share of
      :data:`ANCHOR_PEAK_TFLOPS`; ``model_mfu``: per device against ``matmul_tflops``;
      ``host_bytes_per_param``: ``host_bytes / N``. Null where an input is missing.
    """
    tf = 6.0 * n_params * tokens_per_s / 1e12 if tokens_per_s else None
    per_dev = tf / max(int(n_devices or 1), 1) if tf is not None else None
    return {"model_tflops": tf,
            "model_tflops_share_989": per_dev / ANCHOR_PEAK_TFLOPS if per_dev is not None else None,
            "model_mfu": per_dev / matmul_tflops if per_dev is not None and matmul_tflops else None,
            "host_bytes_per_param": host_bytes / n_params if host_bytes is not None and n_params else None}


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


def loss_series(records: list[dict]) -> list[tuple[str, "np.ndarray", "np.ndarray"]]:
    """The curves of :func:`plot_losses`, each once: ``[(label, tokens, nats), ...]`` from the
    ``metrics.jsonl`` records: the per-step training loss; its running mean over ``k = len // 40``
    steps only when ``k > 1`` (a 1-step mean is the per-step line again: short runs drew it twice);
    the validation loss. Records without a loss (or with a non-finite one: a skipped step) are left out."""
    import numpy as np

    series = []
    tr = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None and math.isfinite(r["loss"])]
    if tr:
        t, l = map(np.asarray, zip(*tr))
        series.append(("train (per step)", t, l))
        k = len(l) // 40
        if k > 1:
            series.append((f"train ({k}-step mean)", t[k - 1:], np.convolve(l, np.ones(k) / k, mode="valid")))
    va = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if va:
        series.append(("validation", *map(np.asarray, zip(*va))))
    return series


def plot_losses(png: os.PathLike, metrics_jsonl: os.PathLike, title: str = "") -> None:
    """Training loss (per step, and its running mean on runs of 80 steps or more) and validation
    loss against tokens, as a PNG: :func:`loss_series`, one line each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_jsonl) as fh:
        series = loss_series([json.loads(line) for line in fh])
    smoothed = any(label.endswith("-step mean)") for label, _, _ in series)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, t, l in series:
        if label == "validation":
            ax.plot(t, l, "o-", color="tab:orange", lw=1.8, label=label)
        elif label == "train (per step)" and smoothed:  # faint beneath its running mean
            ax.plot(t, l, color="tab:blue", alpha=0.25, lw=0.8, label=label)
        else:
            ax.plot(t, l, color="tab:blue", lw=1.8 if smoothed else 1.2, label=label)
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
