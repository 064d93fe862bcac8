"""Near-storage optimizer updates (SmartUpdate), top-k gradient compression, and the baseline.

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) observes that with the optimizer state
on storage (ZeRO-Infinity's NVMe offload), the shared host <-> storage link carries the whole state
every step: read fp32 master, m, v (12 bytes/param) and write them back (12), plus the gradients
and params. Its *SmartUpdate* (section "SmartUpdate") runs the update next to each storage device
(on an FPGA in the paper), so the shared link carries only gradients in and updated
compute-dtype params out (bf16 + bf16 = 4 bytes/param here), while each device's own link carries
its shard of the state. Its *gradient compression* (section "Gradient Compression") sends only the
top-k gradient entries of each chunk (indices + values), decompressed next to storage.

This module implements, on CPU processes:

* :class:`NearStorageOptimizer`: one worker process per storage directory (the "SmartSSD"): it
  owns the directory's chunk files (a :class:`chunkjax.storage.DiskTier` over that directory
  only, with the data transfer handler's fixed staging buffers) and runs AdamW there. The trainer
  computes the global gradient norm (for ``clip_by_global_norm``) and the overflow / non-finite
  check *before* sending; a non-finite step changes no state. Steps use a two-phase commit: every
  worker writes step N to new files and reports, then the trainer tells all to commit; a worker
  that dies (or a full disk) raises :class:`StorageError` and every shard stays at (or recovers
  to) the last step all completed. A new optimizer over the same directories resumes from there.
* :func:`topk_compress` (jax.numpy, runs where the gradient is, e.g. the accelerator) and
  :func:`topk_decompress` (numpy, in the worker); the selection unit is each chunk (the paper)
  or the whole gradient (:func:`topk_compress_global`), with optional sparsity warm-up
  (:func:`topk_ratio_at`, Deep Gradient Compression); optional error feedback (the paper has
  none): the residual ``g - decompress(compress(g))`` of each chunk stays on the trainer
  (optionally decayed) and is added to the next step's gradient; it is written to storage with
  each committed step, so a resumed run continues exactly.
* :class:`BaselineOptimizer` (ZeRO-Infinity style): the trainer reads master, m, v of each chunk
  from storage into host staging buffers, updates on the host, writes them back.

Accounting (per step, bytes): the shared link (trainer <-> workers: gradient payload in, i.e. the
gradient, or top-k indices (int32) + values; params out; in the baseline: every state byte read
from and written to storage) and each storage device's own link (its directory's reads + writes).
:class:`chunkjax.storage.LinkModel` throttles both to given rates; such results are an emulation
and are labelled ``emulated: True``. Here the shared link is throttled in the trainer process
(all its traffic passes there, one transfer at a time) and each device link in its worker.

The AdamW arithmetic is the one of :class:`chunkjax.host_update.AdamW` (optax's ``adamw``:
``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate``), in float32 numpy with the
same operations in the same order (the numba kernel of ``host_update`` gives the same bits).
Against eager optax it is bit-exact on one array; on a list of chunks optax differed in the last
bit or two of some master params (20 steps, ``tests/test_storage.py``: within rtol 1e-6).
Clipping divides by the global norm then multiplies by ``max_norm``, as
``optax.clip_by_global_norm``; the norm is taken over the uncompressed gradient.

Params leave the workers as bf16 only (the compute dtype of this project).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import numbers
import os
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.host_update import INT32_MAX, AdamW, learning_rate_at
from chunkjax.storage import DiskTier, Link, LinkModel, StorageError, committed_step, replace_file
from chunkjax.storage_worker import BF16, F32, _f32_of, _worker_main, adamw_lazy_, adamw_numpy_, topk_decompress

__all__ = ["AdamW", "BaselineOptimizer", "LinkModel", "NearStorageOptimizer", "StepResult", "StorageError",
           "adamw_hyper", "adamw_lazy_", "adamw_numpy_", "chunk_ranges", "clip_args", "topk_compress",
           "topk_compress_global", "topk_compress_many", "topk_decompress", "topk_k", "topk_ratio_at",
           "normalize_topk_groups", "validate_topk_groups"]


# ----------------------------------------------------------------------------------------------
# AdamW in float32 numpy (matches chunkjax.host_update's kernel and eager optax).
# ----------------------------------------------------------------------------------------------

def adamw_hyper(spec: AdamW, count: int) -> tuple[np.float32, ...]:
    """Float32 scalars of the AdamW step taken when the state's count is ``count`` (the count
    before the step, 0 at the first): (b1, 1-b1, b2, 1-b2, 1/(1-b1^t), 1/(1-b2^t), eps, wd, -lr)."""
    f32 = np.float32
    t = min(count + 1, INT32_MAX)
    return (f32(spec.b1), f32(1 - spec.b1), f32(spec.b2), f32(1 - spec.b2),
            f32(1) / (f32(1) - f32(spec.b1) ** f32(t)), f32(1) / (f32(1) - f32(spec.b2) ** f32(t)),
            f32(spec.eps), f32(spec.weight_decay), -learning_rate_at(spec.learning_rate, count))


def clip_args(spec: AdamW, global_norm: float) -> tuple | None:
    """The ``clip`` argument of :func:`adamw_numpy_`: None when ``spec.max_grad_norm`` is None or
    ``global_norm < max_grad_norm`` (optax keeps the gradient), else float32 (global_norm, max_norm)."""
    if spec.max_grad_norm is None or global_norm < spec.max_grad_norm:
        return None
    return (np.float32(global_norm), np.float32(spec.max_grad_norm))


# ----------------------------------------------------------------------------------------------
# Top-k compression.
# ----------------------------------------------------------------------------------------------

def topk_k(n: int, ratio: float) -> int:
    """Entries kept of an n-element chunk: ``max(1, ceil(ratio * n))``, at most n."""
    if not 0 < ratio <= 1:
        raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
    return min(n, max(1, math.ceil(ratio * n)))


@functools.partial(jax.jit, static_argnums=1)
def _topk(g, k):
    _, idx = jax.lax.top_k(jnp.abs(g), k)
    return idx.astype(jnp.int32), g[idx]


def topk_compress(grad, ratio: float = 0.01):
    """Top-k compression of one gradient chunk (Smart-Infinity, "Gradient Compression"), in jax.numpy:
    runs on the device that holds ``grad``.

    Args:
      grad: (n,) gradient (any float dtype; a jax or numpy array).
      ratio: fraction of entries kept; k = :func:`topk_k` (n, ratio).

    Returns:
      (indices, values): (k,) int32 positions of the k largest ``|grad|`` (``jax.lax.top_k``, ties
      to the lower index), and (k,) ``grad[indices]`` in grad's dtype. Wire size: k*(4 + itemsize).
    """
    g = jnp.asarray(grad).reshape(-1)
    return _topk(g, topk_k(g.size, ratio))


@functools.partial(jax.jit, static_argnums=1)
def _topk_rows(g, k):
    _, idx = jax.lax.top_k(jnp.abs(g), k)
    return idx.astype(jnp.int32), jnp.take_along_axis(g, idx, axis=1)


def topk_compress_many(grads, ratio: float = 0.01) -> list:
    """:func:`topk_compress` of many chunks, equal-sized ones in one batched call (one dispatch per
    size instead of one per chunk). Returns ``[(indices, values), ...]`` in the order given, each
    equal to ``topk_compress`` of that chunk."""
    flat = [jnp.asarray(g).reshape(-1) for g in grads]
    out: list = [None] * len(flat)
    groups: dict = {}
    for j, g in enumerate(flat):
        groups.setdefault((g.size, str(g.dtype)), []).append(j)
    for (n, _), js in groups.items():
        idx, vals = _topk_rows(jnp.stack([flat[j] for j in js]), topk_k(n, ratio))
        for r, j in enumerate(js):
            out[j] = (idx[r], vals[r])
    return out


def chunk_ranges(start: int, stop: int, chunk_sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """The elements [start, stop) of the flattened model (chunks laid end to end, ``chunk_sizes``
    elements each, in order) as ``[(chunk, start_in_chunk, stop_in_chunk), ...]``: the form
    ``topk_groups`` takes. Raises ValueError when the range is empty or beyond the last chunk."""
    bounds = np.cumsum([0] + [int(n) for n in chunk_sizes])
    if not 0 <= start < stop <= bounds[-1]:
        raise ValueError(f"elements [{start}, {stop}) are not a non-empty range of the {bounds[-1]} elements")
    out = []
    for c in range(len(chunk_sizes)):
        lo, hi = max(start, bounds[c]), min(stop, bounds[c + 1])
        if lo < hi:
            out.append((c, int(lo - bounds[c]), int(hi - bounds[c])))
    return out


_GROUPS_FORM = "[(share, [(chunk, start, stop), ...]), ...] with integer chunk, start and stop"


def normalize_topk_groups(groups) -> tuple:
    """``topk_groups`` as ``((share: float, ((chunk, start, stop): ints, ...)), ...)``. Raises
    ValueError (one line giving the expected form) for anything else, e.g. a range of two numbers
    or non-integer bounds."""
    try:
        out = []
        for group in groups:
            share, ranges = group
            rs = []
            for r in ranges:
                c, lo, hi = r
                if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (c, lo, hi)):
                    raise TypeError
                rs.append((int(c), int(lo), int(hi)))
            if isinstance(share, bool) or not isinstance(share, numbers.Real):
                raise TypeError
            out.append((float(share), tuple(rs)))
        return tuple(out)
    except (TypeError, ValueError):
        raise ValueError(f"topk_groups: expected {_GROUPS_FORM}, got {groups!r}"[:400]) from None


def validate_topk_groups(groups, chunk_sizes: Sequence[int]) -> None:
    """Check ``topk_groups`` (see :func:`topk_compress_global`) against (n_chunks,) ``chunk_sizes``.
    Raises ValueError naming the bad share or range (the form of :func:`normalize_topk_groups`;
    shares in (0, 1] summing to <= 1; ranges ``(chunk, start, stop)`` inside their chunk and not
    overlapping)."""
    total = 0.0
    seen: dict[int, list[tuple[int, int]]] = {}
    for share, ranges in normalize_topk_groups(groups):
        if not 0 < share <= 1:
            raise ValueError(f"topk_groups: share {share!r} must be in (0, 1]")
        total += share
        if not ranges:
            raise ValueError("topk_groups: a group with no element range")
        for c, lo, hi in ranges:
            if not (0 <= c < len(chunk_sizes) and 0 <= lo < hi <= chunk_sizes[c]):
                raise ValueError(f"topk_groups: range {(c, lo, hi)} is not inside a chunk "
                                 f"(chunk {c} of {len(chunk_sizes)})")
            for a, b in seen.get(c, []):
                if lo < b and a < hi:
                    raise ValueError(f"topk_groups: ranges {(c, a, b)} and {(c, lo, hi)} overlap")
            seen.setdefault(c, []).append((lo, hi))
    if total > 1 + 1e-9:
        raise ValueError(f"topk_groups: the shares sum to {total:g} (> 1)")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _global_topk_device(x, ks: tuple[int, ...], spans: tuple[tuple[tuple[int, int], ...], ...]):
    """On x's device: the ``ks[g]`` largest |x| among the elements of group g (group 0: those in no
    span of ``spans``; group g >= 1: ``spans[g-1]``, flat (lo, hi) ranges). Returns (k,) int32
    ascending flat indices and x at them."""
    a = jnp.abs(x.astype(jnp.float32))
    gid = jnp.zeros(x.shape[0], jnp.int8)
    for g, group in enumerate(spans, 1):
        for lo, hi in group:
            gid = gid.at[lo:hi].set(g)
    picks = []
    for g, k in enumerate(ks):
        if k:
            picks.append(jax.lax.top_k(jnp.where(gid == g, a, -1.0), k)[1])  # |x| >= 0 > -1: members first
    idx = jnp.sort(jnp.concatenate(picks)).astype(jnp.int32)
    return idx, x[idx]


def _group_counts(k: int, groups, sizes: list[int]) -> list[int]:
    """Entries kept per group: ``[rest, group 1, ...]``; group g gets ``round(share * k)``, at most
    its ``sizes[g]`` elements and what earlier groups left of k; the rest (``sizes[0]`` elements in
    no group) gets what remains, at most its size."""
    ks = [0]
    for g, (share, _) in enumerate(groups, 1):
        ks.append(min(sizes[g], round(share * k), k - sum(ks)))
    ks[0] = min(sizes[0], k - sum(ks))
    return ks


def _on_accelerator(g) -> bool:
    return isinstance(g, jax.Array) and any(d.platform != "cpu" for d in g.devices())


def topk_compress_global(grads, ratio: float = 0.01, groups=(), device: bool | None = None) -> list:
    """Top-k over *all* chunks together (one selection unit for the whole model, as top-k
    sparsification over the full flattened gradient in Aji & Heafield 2017 / Lin et al. 2018)
    instead of ``ratio`` of every chunk: k = :func:`topk_k` (total elements, ratio) entries of
    largest ``|grad|`` overall, so a chunk with large gradients sends more entries and one with
    small gradients fewer (possibly none). Same wire format and total size as per-chunk top-k
    (int32 index within its chunk + value per kept entry).

    ``groups``: optional fixed shares of the k entries, ``[(share, [(j, start, stop), ...]), ...]``
    (``j``: position in ``grads``; :func:`chunk_ranges` builds the ranges of a flat interval):
    each group sends its ``round(share * k)`` largest entries (at most its size), and the elements
    in no group send the remaining ones, again the largest. The total stays k. Used to give the
    token embedding a fixed part of the budget: without it the embedding's share of a global
    top-k swings from step to step with the scale of its gradient (docs/storage.md, "Top-k: a fixed
    share for the embedding").

    ``device``: where the selection runs. True: ``jax.lax.top_k`` on the gradients' device (one per
    group), and only the k kept indices and values move to the host. False: ``numpy.argpartition``
    on the host, which needs the whole gradient there (``jax.lax.top_k`` of 7.3M entries took ~1 s
    on this 2-core CPU, argpartition ~0.1 s). None (default): True when the gradients are jax arrays
    on an accelerator. Both keep the same entries, except which of several equal ``|grad|`` at the
    cut are kept (unspecified; deterministic for equal input).

    Returns ``[(indices, values), ...]`` per chunk: indices int32 ascending, values in the
    chunk's dtype (numpy arrays). Raises ValueError for bad ``groups`` (:func:`validate_topk_groups`)."""
    sizes = [int(np.prod(np.shape(g))) for g in grads]
    bounds = np.cumsum([0] + sizes)
    total = int(bounds[-1])
    k = topk_k(total, ratio)
    if groups:
        groups = normalize_topk_groups(groups)
        validate_topk_groups(groups, sizes)
    if device is None:
        device = all(_on_accelerator(g) for g in grads)
    if device:
        flat = [jnp.asarray(g).reshape(-1) for g in grads]
        n_in = [sum(hi - lo for _, lo, hi in ranges) for _, ranges in groups]
        ks = tuple(_group_counts(k, groups, [total - sum(n_in), *n_in]))
        spans = tuple(tuple((int(bounds[j] + lo), int(bounds[j] + hi)) for j, lo, hi in ranges)
                      for _, ranges in groups)
        x = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
        idx, vals = (np.asarray(a) for a in _global_topk_device(x, ks, spans))
        cut = np.searchsorted(idx, bounds)
        return [((idx[cut[c]:cut[c + 1]] - bounds[c]).astype(np.int32),
                 vals[cut[c]:cut[c + 1]].astype(np.dtype(flat[c].dtype))) for c in range(len(flat))]
    flat = [np.asarray(g).reshape(-1) for g in grads]
    a = np.concatenate([np.abs(g.astype(F32, copy=False)) for g in flat])
    if not groups:
        idx = np.sort(np.argpartition(a, total - k)[total - k:]) if k < total else np.arange(total)
    else:
        gid = np.zeros(total, np.int32)  # 0: in no group
        for g, (_, ranges) in enumerate(groups, 1):
            for j, lo, hi in ranges:
                gid[bounds[j] + lo:bounds[j] + hi] = g
        members = [np.flatnonzero(gid == g) for g in range(len(groups) + 1)]
        ks = _group_counts(k, groups, [m.size for m in members])
        picks = []
        for pos, kg in zip(members, ks):
            if 0 < kg < pos.size:
                picks.append(pos[np.argpartition(a[pos], pos.size - kg)[pos.size - kg:]])
            elif kg > 0:
                picks.append(pos)
        idx = np.sort(np.concatenate(picks)) if picks else np.zeros(0, np.int64)
    cut = np.searchsorted(idx, bounds)
    out = []
    for c, g in enumerate(flat):
        loc = (idx[cut[c]:cut[c + 1]] - bounds[c]).astype(np.int32)
        out.append((loc, g[loc]))
    return out


def topk_ratio_at(step: int, ratio: float, warmup_steps: int = 0, start: float = 0.25) -> float:
    """Density of step ``step`` (1 = the first) with Deep Gradient Compression's sparsity warm-up
    (Lin et al., ICLR 2018, section 3.3): over the first ``warmup_steps`` steps the kept fraction
    falls exponentially from ``start`` to ``ratio`` (``start * (ratio/start)^((step-1)/warmup_steps)``),
    then stays at ``ratio``. ``warmup_steps=0``: always ``ratio``."""
    if warmup_steps <= 0 or step > warmup_steps or start <= ratio:
        return ratio
    return float(start * (ratio / start) ** ((step - 1) / warmup_steps))


# ----------------------------------------------------------------------------------------------
# Step results and the trainer-side common part.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepResult:
    """What one optimizer step did.

    Attributes:
      step: the committed step after this call (unchanged when skipped).
      params: per chunk, the (n_c,) updated params in the compute dtype (ml_dtypes.bfloat16
        numpy arrays); None when skipped.
      skipped: True when the gradient was not finite (nothing was sent or changed).
      grad_norm: global L2 norm of the (uncompressed) gradient.
      shared_link_bytes: bytes on the shared link this step (see module docstring).
      shared_link_in / shared_link_out: its two directions (to storage side / back), bytes.
      storage_link_bytes: per storage directory, bytes read + written on its own link.
      update_s: wall seconds of the update phase (send, update, receive, commit).
      n_params: parameters updated (for bytes per param).
      emulated: True when a LinkModel throttled the links (times are an emulation).
      residual_bytes: bytes of error-feedback residuals the trainer wrote to ``residual_dir``
        (not part of ``shared_link_bytes``).
    """

    step: int
    params: list | None
    skipped: bool
    grad_norm: float
    shared_link_bytes: int = 0
    shared_link_in: int = 0
    shared_link_out: int = 0
    storage_link_bytes: dict = dataclasses.field(default_factory=dict)
    update_s: float = 0.0
    n_params: int = 0
    emulated: bool = False
    residual_bytes: int = 0

    @property
    def shared_link_bytes_per_param(self) -> float:
        return self.shared_link_bytes / max(self.n_params, 1)

    @property
    def storage_link_bytes_per_param(self) -> float:
        return sum(self.storage_link_bytes.values()) / max(self.n_params, 1)


def _sizes_of(chunk_sizes) -> dict[int, int]:
    sizes = dict(chunk_sizes) if isinstance(chunk_sizes, Mapping) else dict(enumerate(chunk_sizes))
    if sorted(sizes) != list(range(len(sizes))):
        raise ValueError("chunk ids must be 0..n_chunks-1")
    return {int(c): int(n) for c, n in sorted(sizes.items())}


class _Trainer:
    """Shared part: global norm, overflow check, clip scale, hyperparameters."""

    def _init_common(self, chunk_sizes, spec: AdamW, link_model: LinkModel | None):
        if not isinstance(spec, AdamW):
            raise ValueError(f"spec must be chunkjax.host_update.AdamW, got {type(spec).__name__}")
        self.spec = spec
        self.chunk_sizes = _sizes_of(chunk_sizes)
        self.n_params = sum(self.chunk_sizes.values())
        self.link_model = link_model or LinkModel()

    def _check_grads(self, grads):
        if len(grads) != len(self.chunk_sizes):
            raise ValueError(f"need {len(self.chunk_sizes)} gradient chunks, got {len(grads)}")
        out = []
        for c, g in enumerate(grads):
            g = jnp.asarray(g).reshape(-1)
            if g.size != self.chunk_sizes[c]:
                raise ValueError(f"gradient chunk {c} has {g.size} elements, chunk size is {self.chunk_sizes[c]}")
            out.append(g)
        # optax.global_norm: sqrt of the sum of per-leaf sums of squares, in leaf order.
        norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in out)))
        return out, norm


def validate_storage_dirs(dirs) -> None:
    """Check a list of storage directories (one per storage device) before anything is created:
    at least one, no two the same, each an existing directory or creatable (its nearest existing
    parent is a writable directory), none a file (reported case 16: a bad offload target once
    failed deep inside the first step).

    Raises:
      ValueError: one line naming the directory and what to change.
    """
    if isinstance(dirs, (str, bytes, os.PathLike)):
        raise ValueError(f"dirs={os.fspath(dirs)!r}: pass a list of directories (one per storage device)")
    dirs = [os.fspath(d) for d in dirs]
    if not dirs:
        raise ValueError("no storage directories: pass one per storage device")
    real = [os.path.realpath(d) for d in dirs]
    for i, r in enumerate(real):
        if r in real[:i]:
            raise ValueError(f"storage directory {dirs[i]!r} is given twice: give each storage device once")
    for d in dirs:
        if os.path.exists(d):
            if not os.path.isdir(d):
                raise ValueError(f"storage directory {d!r} is a file: give a directory")
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"storage directory {d!r} is not writable: give a writable directory")
            continue
        parent = os.path.dirname(os.path.abspath(d))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"storage directory {d!r} cannot be created ({parent!r} is not a writable directory)")


class NearStorageOptimizer(_Trainer):
    """AdamW with the state on storage and the update next to it (Smart-Infinity's SmartUpdate).

    One worker process (multiprocessing, "spawn") per directory owns that directory's chunk files
    (chunk c in ``dirs[c % len(dirs)]``, layout in :mod:`chunkjax.storage`) and updates its chunks;
    the trainer sends gradients (bf16 or fp32, dense or top-k) and receives updated bf16 params.

    Args:
      dirs: one directory per storage device (created if missing). If they hold a committed run,
        it is resumed at the last step all directories completed (``init_params`` is then ignored).
      chunk_sizes: (n_chunks,) elements per chunk (or ``{c: n}`` with ids 0..n_chunks-1).
      spec: :class:`chunkjax.host_update.AdamW` (learning rate float or schedule, b1, b2, eps,
        weight_decay, max_grad_norm for global-norm clipping).
      init_params: per chunk, the (n_c,) initial fp32 master params (for a fresh run).
      compression: None (dense gradients) or "topk".
      topk_ratio: fraction of the entries sent with "topk" (default 0.01).
      topk_scope: "chunk" (default, as the paper: ``topk_ratio`` of every chunk) or "global" (the
        ``topk_ratio`` largest entries of the whole gradient, :func:`topk_compress_global`; same
        total bytes, spread over the chunks by gradient size).
      topk_groups: with ``topk_scope="global"``, fixed shares of the kept entries,
        ``[(share, [(chunk, start, stop), ...]), ...]`` (:func:`chunk_ranges` builds the ranges of
        a leaf; :func:`topk_compress_global`), e.g. ``[(0.5, <the token embedding>)]``; the
        elements in no group share the rest. Default: none.
      topk_warmup_steps: Deep Gradient Compression's sparsity warm-up (:func:`topk_ratio_at`,
        starting at ``topk_warmup_start``); 0 (default): ``topk_ratio`` from the first step.
      error_feedback: keep each chunk's compression residual (float32, on the gradient's device)
        and add it to the next step's gradient (off by default, as in the paper).
      init_state: instead of ``init_params``, a restored state (what
        :func:`chunkjax.checkpoint.restore_storage_checkpoint` passes): a callable ``c -> (master,
        m, v)``, each (n_c,) float32, called once per chunk in id order and streamed to its worker
        (host memory: one chunk), committed as step ``init_step``. Ignored, like ``init_params``,
        when ``dirs`` hold a committed run.
      init_step: the committed step (= AdamW step count) of ``init_state`` (default 0).
      init_residual: with error feedback and ``init_state``, the residual per chunk ``{c: (n_c,)
        float32}`` at ``init_step`` (written to ``residual_dir`` before the workers commit);
        default zeros.
      sparse_update: with "topk", how a worker applies a sparse gradient: "dense" (default: the
        AdamW step on the decompressed gradient, zeros included, so every m and v decays) or
        "lazy" (:func:`adamw_lazy_`: only the kept entries step).
      ef_decay: the kept residual is multiplied by this each step (1.0, default: classic error
        feedback; < 1 forgets old residual, bounding how large an entry's burst can grow).
      residual_dir: with error feedback, where the trainer writes each committed step's residuals
        (``ef_residual.step<N>.npy``, float32, 4 bytes/param/step: :attr:`StepResult.residual_bytes`,
        not counted on the shared link; put it on the trainer's own disk to keep them off it).
        Default: ``dirs[0]``. Written before the workers commit, the previous one removed after, so
        a resume (a new optimizer with ``error_feedback=True``) restores the residuals of the
        step it resumes at and continues exactly as an uninterrupted run.
      link_model: emulated rates (bytes/s) of the shared link and of each device link.
      io_mode, n_buffers, fsync: passed to each worker's :class:`DiskTier`.
      timeout_s: longest wait for one worker reply, seconds (a dead worker is detected at once).

    Raises:
      StorageError: a worker failed to start, the directories are inconsistent, or (from
        :meth:`step`) a worker died or a disk is full; the message names the worker and the last
        committed step.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes, spec: AdamW, *, init_params=None,
                 init_state=None, init_step: int = 0, init_residual=None,
                 compression: str | None = None, topk_ratio: float = 0.01, topk_scope: str = "chunk",
                 topk_groups=(), topk_warmup_steps: int = 0, topk_warmup_start: float = 0.25,
                 error_feedback: bool = False, ef_decay: float = 1.0, sparse_update: str = "dense",
                 residual_dir: str | None = None,
                 link_model: LinkModel | None = None, io_mode: str = "auto", n_buffers: int = 3, fsync: bool = True,
                 timeout_s: float = 300.0, _fault: dict | None = None):
        validate_storage_dirs(dirs)  # the whole configuration before any file or process
        if n_buffers < 3:
            raise ValueError(f"n_buffers={n_buffers}: the data transfer handler needs >= 3 staging buffers "
                             "(read k+1, update k, write k-1)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        self._init_common(chunk_sizes, spec, link_model)
        if compression not in (None, "topk"):
            raise ValueError(f"compression must be None or 'topk', got {compression!r}")
        topk_k(1, topk_ratio)  # validates the ratio
        topk_k(1, topk_warmup_start)
        if topk_scope not in ("chunk", "global"):
            raise ValueError(f"topk_scope must be 'chunk' or 'global', got {topk_scope!r}")
        if not 0 < ef_decay <= 1:
            raise ValueError(f"ef_decay={ef_decay}: must be in (0, 1]")
        self.topk_groups = normalize_topk_groups(topk_groups)
        if self.topk_groups:
            if compression != "topk" or topk_scope != "global":
                raise ValueError("topk_groups needs compression='topk' and topk_scope='global'")
            validate_topk_groups(self.topk_groups, list(self.chunk_sizes.values()))
        if sparse_update not in ("dense", "lazy"):
            raise ValueError(f"sparse_update must be 'dense' or 'lazy', got {sparse_update!r}")
        self.sparse_update = sparse_update
        self.dirs = [os.fspath(d) for d in dirs]
        self.compression, self.topk_ratio, self.error_feedback = compression, topk_ratio, error_feedback
        self.topk_scope, self.ef_decay = topk_scope, float(ef_decay)
        self.topk_warmup_steps, self.topk_warmup_start = int(topk_warmup_steps), float(topk_warmup_start)
        self.fsync = fsync
        self.residual_dir = os.fspath(residual_dir) if residual_dir is not None else self.dirs[0]
        self.timeout_s = timeout_s
        self.shared_link = Link(self.link_model.shared_bytes_per_s, "shared")
        self._residual: dict[int, jax.Array] = {}
        self._broken: str | None = None
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        target = committed_step(self.dirs)  # the step every worker recovers to
        if self.error_feedback and compression == "topk":  # before any process: a missing file fails fast
            self._load_residual(target or 0)
        n = len(self.dirs)
        ctx = multiprocessing.get_context("spawn")
        self.workers, self._conns, self.io_mode = [], [], {}
        self.owned = [[c for c in self.chunk_sizes if c % n == i] for i in range(n)]
        try:
            for i, d in enumerate(self.dirs):
                parent, child = ctx.Pipe()
                cfg = dict(dir=d, index=i, n_dirs=n, sizes={c: self.chunk_sizes[c] for c in self.owned[i]},
                           n_buffers=n_buffers, io_mode=io_mode, fsync=fsync, target_step=target,
                           disk_bytes_per_s=self.link_model.disk_bytes_per_s, sparse_update=sparse_update,
                           fault=_fault if _fault and _fault.get("worker") == i else None)
                p = ctx.Process(target=_worker_main, args=(child, cfg), name=f"near_storage_{i}", daemon=True)
                p.start()
                child.close()
                self.workers.append(p)
                self._conns.append(parent)
            for i in range(n):
                _, step, mode = self._expect(i, "ready", "starting")
                self.io_mode.update(mode)
            self._step = target
            if target is None and init_state is not None:
                self._init_restored(init_state, int(init_step), init_residual)
            elif target is None:
                if init_params is None:
                    raise StorageError(f"{self.dirs} hold no committed run: pass init_params")
                for i in range(n):
                    masters = {c: np.asarray(init_params[c], F32).reshape(-1) for c in self.owned[i]}
                    self._conns[i].send(("init", masters))
                for i in range(n):
                    self._expect(i, "ok", "initialising")
                self._step = 0
        except BaseException:
            self._kill_all()
            raise

    def _init_restored(self, init_state, step: int, init_residual) -> None:
        """Commit a restored state as step ``step``: the residual file first (error feedback), then
        every chunk's (master, m, v) streamed to its worker, one chunk in flight per call."""
        if step < 0:
            raise ValueError(f"init_step must be >= 0, got {step}")
        if self.error_feedback and self.compression == "topk" and step > 0:
            res = {c: np.asarray(init_residual[c], F32).reshape(-1) if init_residual is not None
                   else np.zeros(n, F32) for c, n in self.chunk_sizes.items()}
            self._save_residual(step, res)
            self._residual = {c: jnp.asarray(r) for c, r in res.items()}
        n = len(self.dirs)
        for i in range(n):
            self._conns[i].send(("init_stream", step))
        for c, size in self.chunk_sizes.items():
            kinds = tuple(np.asarray(a, F32).reshape(-1) for a in init_state(c))
            if len(kinds) != 3 or any(a.size != size for a in kinds):
                raise ValueError(f"init_state({c}) must give (master, m, v) of {size} elements each, got "
                                 f"{[a.size for a in kinds]}")
            self._conns[c % n].send(("init_chunk", c, kinds))
            del kinds
        for i in range(n):
            self._expect(i, "ok", f"restoring step {step}")
        self._step = step

    def read_chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``c``'s (master, m, v), (n_c,) float32 copies at the committed step, read by its
        worker (host memory: one chunk; :func:`chunkjax.checkpoint.save_storage_checkpoint`
        saves chunk by chunk with it)."""
        self._check_usable()
        if c not in self.chunk_sizes:
            raise ValueError(f"no chunk {c} (chunks 0..{len(self.chunk_sizes) - 1})")
        i = c % len(self.dirs)
        self._conns[i].send(("read_chunk", c))
        _, got, arrays = self._expect(i, "chunk", f"reading chunk {c}")
        return arrays

    # -- error-feedback residuals on storage -------------------------------------------------
    def _residual_path(self, step: int) -> str:
        return os.path.join(self.residual_dir, f"ef_residual.step{step:09d}.npy")

    def _residual_files(self) -> dict[int, str]:
        out = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.residual_dir):
                if name.startswith("ef_residual.step") and name.endswith(".npy"):
                    with contextlib.suppress(ValueError):
                        out[int(name[len("ef_residual.step"):-4])] = os.path.join(self.residual_dir, name)
        return out

    def _load_residual(self, step: int):
        """Restore the residuals of committed step ``step`` (zero at step 0) and remove the files of
        other steps (a step written but not committed everywhere, or one already superseded)."""
        os.makedirs(self.residual_dir, exist_ok=True)
        files = self._residual_files()
        if step > 0:
            if step not in files:
                raise StorageError(f"error feedback: no residual file for the committed step {step} in "
                                   f"{self.residual_dir} (the run was written without error_feedback, or with "
                                   "another residual_dir): resume with the same settings")
            flat = np.load(files[step])
            if flat.dtype != F32 or flat.shape != (self.n_params,):
                raise StorageError(f"{files[step]} holds {flat.dtype} {flat.shape}, expected float32 "
                                   f"({self.n_params},)")
            o = 0
            for c, n in self.chunk_sizes.items():
                self._residual[c] = jnp.asarray(flat[o:o + n])
                o += n
        for s, f in files.items():
            if s != step:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.residual_dir, "ef_residual.tmp.npy"))

    def _save_residual(self, step: int, residual: dict) -> int:
        """Write the residuals after ``step`` (before the workers commit it); returns the bytes."""
        flat = np.concatenate([np.asarray(residual[c], F32).reshape(-1) for c in self.chunk_sizes])
        try:
            replace_file(self._residual_path(step), os.path.join(self.residual_dir, "ef_residual.tmp.npy"),
                         lambda f: np.save(f, flat), self.fsync)
        except OSError as e:
            raise StorageError(f"writing the error-feedback residuals of step {step} to {self.residual_dir} "
                               f"failed ({e}); last committed step {self._step}") from e
        return flat.nbytes

    @property
    def committed_step(self) -> int:
        """The last step every worker committed (0: initial params)."""
        return self._step

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    # -- messaging ---------------------------------------------------------------------------
    def _expect(self, i: int, kind: str, doing: str):
        conn, proc = self._conns[i], self.workers[i]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if conn.poll(0.05):
                    msg = conn.recv()
                    break
            except (EOFError, OSError):
                msg = None
                break
            if not proc.is_alive() and not conn.poll(0):
                msg = None
                break
            if time.monotonic() > deadline:
                raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) gave no reply within "
                                 f"{self.timeout_s} s while {doing}")
        if msg is None:
            proc.join(1)
            raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) died (exit code "
                             f"{proc.exitcode}) while {doing}")
        if msg[0] == "error":
            raise StorageError(f"near-storage worker {i} ({self.dirs[i]}) failed while {doing}: {msg[1]}; "
                               f"last committed step {getattr(self, '_step', None)}")
        if msg[0] != kind:
            raise self._fail(f"near-storage worker {i} answered {msg[0]!r}, expected {kind!r} while {doing}")
        return msg

    def _collect(self, step: int):
        """Receive every worker's updated params, streamed chunk by chunk as each is updated (the
        shared link carries them while the workers still read and write their state), then its
        "prepared". Returns ``(params, storage_bytes, received_bytes, failure)``; ``failure`` is the
        first :class:`StorageError` (a worker's error, death or silence past ``timeout_s``)."""
        from multiprocessing.connection import wait
        params: dict[int, np.ndarray] = {}
        storage: dict[str, int] = {}
        received, failure = 0, None
        pending = {self._conns[i]: i for i in range(len(self.dirs))}
        deadline = time.monotonic() + self.timeout_s
        doing = f"preparing step {step}"
        while pending and not self._broken:
            ready = wait(list(pending), timeout=0.05)
            if not ready:
                for conn, i in list(pending.items()):
                    if not self.workers[i].is_alive() and not conn.poll(0):
                        failure = failure or self._dead(i, doing)
                if time.monotonic() > deadline:
                    i = next(iter(pending.values()))
                    failure = failure or self._fail(f"near-storage worker {i} (pid {self.workers[i].pid}, "
                                                    f"{self.dirs[i]}) gave no reply within {self.timeout_s} s "
                                                    f"while {doing}")
                continue
            for conn in ready:
                i = pending.get(conn)
                if i is None:
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    failure = failure or self._dead(i, doing)
                    break
                if msg[0] == "param":
                    with self.shared_link.transfer(msg[2].nbytes):
                        params[msg[1]] = msg[2].view(BF16)
                    received += msg[2].nbytes
                    deadline = time.monotonic() + self.timeout_s
                elif msg[0] == "prepared":
                    storage.update({d: msg[2][d] + msg[3][d] for d in msg[2]})
                    del pending[conn]
                elif msg[0] == "error":
                    failure = failure or StorageError(
                        f"near-storage worker {i} ({self.dirs[i]}) failed while {doing}: {msg[1]}; "
                        f"last committed step {self._step}")
                    del pending[conn]
                else:
                    failure = failure or self._fail(f"near-storage worker {i} answered {msg[0]!r}, "
                                                    f"expected 'param' or 'prepared' while {doing}")
        return params, storage, received, failure

    def _dead(self, i: int, doing: str) -> StorageError:
        proc = self.workers[i]
        proc.join(1)
        return self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) died (exit code "
                          f"{proc.exitcode}) while {doing}")

    def _fail(self, why: str) -> StorageError:
        """Stop every worker and return the error; the step named is where a resume starts (read
        from the manifests once the workers are stopped: a worker may have died mid-commit)."""
        self._kill_all()
        if self._broken:
            return StorageError(self._broken)
        try:
            step = committed_step(self.dirs)
        except StorageError:
            step = getattr(self, "_step", None)
        self._broken = (f"{why}; every shard is at the last committed step {step}: open a new "
                        "NearStorageOptimizer on the same directories to resume")
        return StorageError(self._broken)

    def _kill_all(self):
        for p in getattr(self, "workers", []):
            if p.is_alive():
                p.kill()
            p.join(5)

    def _check_usable(self):
        if self._broken:
            raise StorageError(self._broken)

    # -- the step ----------------------------------------------------------------------------
    def _compress(self, grads: list, step: int) -> tuple[dict, dict]:
        """Top-k of every chunk for ``step`` (1 = first): ``({c: (indices, values)}, new residuals)``;
        with error feedback the residual is added first and the new one (``ef_decay`` times what was
        not sent) only replaces the kept one once the step is committed."""
        ratio = topk_ratio_at(step, self.topk_ratio, self.topk_warmup_steps, self.topk_warmup_start)
        cs = list(self.chunk_sizes)
        if not self.error_feedback:
            if self.topk_scope == "global":
                return dict(zip(cs, topk_compress_global([grads[c] for c in cs], ratio, self.topk_groups))), {}
            return dict(zip(cs, topk_compress_many([grads[c] for c in cs], ratio))), {}
        ge = {c: grads[c].astype(jnp.float32) + self._residual.get(c, 0.0) for c in cs}
        if self.topk_scope == "global":
            comp = dict(zip(cs, topk_compress_global([ge[c] for c in cs], ratio, self.topk_groups)))
        else:
            comp = {c: topk_compress(ge[c], ratio) for c in cs}
        out, residual = {}, {}
        for c in cs:
            idx, vals = comp[c]
            if self.topk_scope == "global":  # on the host: the kept count varies per chunk and step
                vals = np.asarray(vals).astype(np.dtype(grads[c].dtype))  # (a jax scatter would recompile)
                r = np.array(ge[c], F32)
                r[np.asarray(idx, np.int64)] -= vals.astype(F32)
                if self.ef_decay != 1.0:
                    r *= np.float32(self.ef_decay)
            else:
                vals = jnp.asarray(vals).astype(grads[c].dtype)
                r = ge[c].at[jnp.asarray(idx)].add(-vals.astype(jnp.float32))
                r = r if self.ef_decay == 1.0 else r * jnp.float32(self.ef_decay)
            residual[c], out[c] = r, (idx, vals)
        return out, residual

    def _payload(self, c: int, g: jax.Array, compressed=None):
        """(wire message part, bytes) for chunk c's gradient (``compressed``: its top-k from
        :meth:`_compress`)."""
        if self.compression != "topk":
            a = np.asarray(g)
            a = a.view(np.uint16) if a.dtype == BF16 else a.astype(F32, copy=False)
            return ("dense", a), a.nbytes
        idx, vals = compressed
        idx, vals = np.asarray(idx), np.asarray(vals)
        vals = vals.view(np.uint16) if vals.dtype == BF16 else vals.astype(F32, copy=False)
        return ("topk", idx, vals), idx.nbytes + vals.nbytes

    def step(self, grads: Sequence) -> StepResult:
        """One AdamW step of every chunk.

        Args:
          grads: per chunk c, the (n_c,) gradient (jax or numpy; bfloat16 or float32).

        Returns:
          :class:`StepResult` with the new bf16 params per chunk and the byte accounting.

        Raises:
          StorageError: a worker died, timed out or failed (e.g. its disk is full). The step is not
            committed; after a dead worker this object is unusable (open a new one to resume).
        """
        self._check_usable()
        grads, norm = self._check_grads(grads)
        if not math.isfinite(norm):
            return StepResult(self._step, None, True, norm, n_params=self.n_params, emulated=self.link_model.emulated)
        t0 = time.perf_counter()
        scale = clip_args(self.spec, norm)
        hp = adamw_hyper(self.spec, self._step)
        step = self._step + 1
        n = len(self.dirs)
        sent = 0

        def send(i, msg):
            try:
                self._conns[i].send(msg)
            except (BrokenPipeError, OSError):
                raise self._fail(f"near-storage worker {i} (pid {self.workers[i].pid}, {self.dirs[i]}) died "
                                 f"(exit code {self.workers[i].exitcode}) before step {step}") from None

        # the step's header first: every worker starts reading its state while the gradients are
        # compressed and sent (the header is a few bytes: not counted on the shared link)
        for i in range(n):
            send(i, ("step", step, scale, hp, None))
        batched, residual = {}, {}
        if self.compression == "topk":  # one batched top-k per size (or one global one)
            try:
                batched, residual = self._compress(grads, step)
            except BaseException as e:  # the workers wait for these gradients: stop them
                raise self._fail(f"compressing the gradients of step {step} failed ({type(e).__name__}: {e})") \
                    from e
        for i in range(n):
            parts, nbytes = {}, 0
            try:
                for c in self.owned[i]:
                    parts[c], b = self._payload(c, grads[c], batched.get(c))
                    nbytes += b
            except BaseException as e:  # the workers wait for these gradients: stop them
                raise self._fail(f"preparing the gradients of step {step} failed ({type(e).__name__}: {e})") from e
            with self.shared_link.transfer(nbytes):
                send(i, ("grads", step, parts))
            sent += nbytes
        params, storage, received, failure = self._collect(step)
        if failure is not None:
            if not self._broken:  # a worker reported an error (e.g. a full disk): abort the others
                for i in range(n):
                    with contextlib.suppress(StorageError, OSError, EOFError):
                        self._conns[i].send(("abort", step))
                        self._expect(i, "aborted", f"aborting step {step}")
            raise failure
        residual_bytes = 0
        if residual:  # error feedback: the residuals of this step on storage before anyone commits it
            try:
                residual_bytes = self._save_residual(step, residual)
            except StorageError:
                for i in range(n):
                    with contextlib.suppress(StorageError, OSError, EOFError):
                        self._conns[i].send(("abort", step))
                        self._expect(i, "aborted", f"aborting step {step}")
                raise
        for i in range(n):
            self._conns[i].send(("commit", step))
        for i in range(n):
            self._expect(i, "committed", f"committing step {step}")
        self._step = step
        if residual:
            self._residual = residual
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._residual_path(step - 1))
        return StepResult(step, [params[c] for c in self.chunk_sizes], False, norm, sent + received, sent, received,
                          storage, time.perf_counter() - t0, self.n_params, self.link_model.emulated,
                          residual_bytes)

    def read_state(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``{c: (master, m, v)}`` float32 copies at the committed step, read by the workers."""
        self._check_usable()
        out = {}
        for i in range(len(self.dirs)):
            self._conns[i].send(("read",))
            out.update(self._expect(i, "state", "reading state")[1])
        return dict(sorted(out.items()))

    def close(self):
        """Stop the workers (committed state stays on storage)."""
        for i, conn in enumerate(getattr(self, "_conns", [])):
            if self.workers[i].is_alive():
                with contextlib.suppress(StorageError, OSError, EOFError):
                    conn.send(("close",))
        for p in getattr(self, "workers", []):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------------
# The ZeRO-Infinity-style baseline.
# ----------------------------------------------------------------------------------------------

class BaselineOptimizer(_Trainer):
    """AdamW with the state on storage, updated on the host (the ZeRO-Infinity baseline that
    Smart-Infinity compares against): each step reads master, m, v of every chunk from storage into
    the host staging buffers, updates them on the host and writes them back, so every state byte
    crosses the shared host <-> storage link twice (>= 24 bytes/param/step; the gradient itself is
    already on the host and is not counted on that link).

    Args: as :class:`NearStorageOptimizer` (no compression); ``io_threads`` I/O threads (default
    2 per directory) and ``n_buffers`` staging buffers (default n_dirs + 2, so that a write per
    directory can be in flight: 1.13 s against 1.46 s with 3 buffers for 4 directories under an
    emulated 3 MB/s per directory, 16 MB/s shared, where the bound is 1.05 s) in this process.
    With a ``link_model``, ``shared_bytes_per_s`` throttles all storage traffic together and
    ``disk_bytes_per_s`` each directory.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes, spec: AdamW, *, init_params=None,
                 link_model: LinkModel | None = None, io_mode: str = "auto", n_buffers: int | None = None,
                 io_threads: int | None = None, fsync: bool = True):
        validate_storage_dirs(dirs)
        self._init_common(chunk_sizes, spec, link_model)
        n = len(dirs)
        self.tier = DiskTier(dirs, self.chunk_sizes, n_buffers=n_buffers or n + 2, io_threads=io_threads or 2 * n,
                             io_mode=io_mode, link_model=self.link_model, fsync=fsync)
        self.dirs = self.tier.dirs
        if self.tier.committed_step is None:
            if init_params is None:
                raise StorageError(f"{self.dirs} hold no committed run: pass init_params")
            self.tier.initialize(init_params)

    @property
    def committed_step(self) -> int:
        return self.tier.committed_step

    def step(self, grads: Sequence) -> StepResult:
        """One AdamW step of every chunk, on the host; arguments and result as
        :meth:`NearStorageOptimizer.step`. Raises StorageError (e.g. a full disk; nothing committed)."""
        grads, norm = self._check_grads(grads)
        count = self.tier.committed_step
        if not math.isfinite(norm):
            return StepResult(count, None, True, norm, n_params=self.n_params, emulated=self.link_model.emulated)
        t0 = time.perf_counter()
        scale, hp = clip_args(self.spec, norm), adamw_hyper(self.spec, count)
        host = [np.asarray(g) for g in grads]
        params = {}

        def fn(c, views):
            g = host[c]
            g = _f32_of(g.view(np.uint16)) if g.dtype == BF16 else g.astype(F32, copy=False)
            adamw_numpy_(views[0], views[1], views[2], g, scale, hp)
            params[c] = views[0].astype(BF16)

        io = self.tier.update(fn)
        storage = {d: io.read[d] + io.written[d] for d in io.read}
        total = sum(storage.values())
        return StepResult(self.tier.committed_step, [params[c] for c in self.chunk_sizes], False, norm, total,
                          sum(io.read.values()), sum(io.written.values()), storage, time.perf_counter() - t0,
                          self.n_params, self.link_model.emulated)

    def read_state(self):
        return {c: self.tier.read_chunk(c) for c in self.chunk_sizes}

    def close(self):
        self.tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
