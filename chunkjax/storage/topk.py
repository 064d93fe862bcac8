"""Top-k gradient compression of the storage tier (Smart-Infinity, "Gradient Compression").

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) sends only the top-k gradient entries of
each chunk (indices + values) over the shared link to the storage devices, decompressed next to
storage (:func:`chunkjax.storage.worker.topk_decompress`). Here the selection unit is each chunk
(the paper, :func:`topk_compress`) or the whole gradient (:func:`topk_compress_global`, Aji &
Heafield 2017 / Lin et al. 2018), with optional fixed shares for groups of elements and Deep
Gradient Compression's sparsity warm-up (:func:`topk_ratio_at`). In jax.numpy: runs where the
gradient is (e.g. the accelerator).
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.dtype(np.float32)

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


__all__ = ["chunk_ranges", "normalize_topk_groups", "topk_compress", "topk_compress_global", "topk_compress_many",
           "topk_k", "topk_ratio_at", "validate_topk_groups"]
