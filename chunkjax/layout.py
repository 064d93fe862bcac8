"""Chunk layout: flatten a parameter pytree into fixed-size flat chunks.

PatrickStar (Fang et al., arXiv 2108.05818, section 4.1 "Chunk-based memory management") keeps
model data in *chunks*: contiguous buffers of ``chunk_size`` elements into which tensors are
appended in the order the step first uses them. The four chunk lists of a chunk (compute params,
fp32 master params, Adam m and v) share one offset layout, so a tensor's optimizer state sits at
the same (chunk, offset) as its parameter. This module computes that layout.

* Leaves are grouped by (dtype, trainable) (one chunk list per group, never mixing itemsizes or
  trainable with frozen leaves in one buffer; see ``build_layout(trainable=)``), ordered by first use, and packed greedily: a leaf goes into the current chunk of its dtype
  group if it fits, otherwise a new chunk is opened. A leaf is never split across chunks.
* ``chunk_size`` counts *elements*; padding waste is counted in *bytes* (``waste_bytes``), so a
  search over chunk sizes with mixed bf16/f32 leaves compares like with like.
* :meth:`ChunkLayout.pack` and :meth:`ChunkLayout.unpack` are pure jnp code (static slices and
  concatenations) and can be used inside ``jax.jit``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

#: Chunk sizes are rounded up to a multiple of this many elements (keeps buffers aligned).
CHUNK_ALIGN_ELEMS = 128

_MSG_CHUNK_TOO_SMALL = (
    "chunk_size={chunk_size} elements is smaller than the largest leaf {path} ({size} elements): "
    "use chunk_size >= {size} or leave chunk_size=None to search for one"
)


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where one leaf of the pytree lives.

    Attributes:
      path: the leaf's key path, ``"h_0/attn/c_attn/kernel"`` style.
      chunk: index of the chunk (global over all dtype groups).
      offset: first element of the leaf inside the chunk.
      shape: the leaf's shape.
      dtype: the leaf's dtype (equal to the chunk's dtype).
    """

    path: str
    chunk: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(math.prod(self.shape))


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Leaf -> (chunk, offset, shape, dtype) table for one pytree.

    Attributes:
      treedef: the pytree structure the layout was built from.
      slots: one :class:`LeafSlot` per leaf, in ``jax.tree.leaves`` order.
      chunk_size: elements per chunk (same for every dtype group).
      chunk_dtypes: dtype of each chunk, ``len == n_chunks``; chunks are numbered in
        first-use order.
      chunk_trainable: whether each chunk is trained, ``len == n_chunks`` (default ``None``: all
        True). A frozen chunk (False) is stored and fetched like a parameter chunk but has no
        master params, optimizer state or gradient; chunks of a non-floating dtype must be frozen.
    """

    treedef: Any
    slots: tuple[LeafSlot, ...]
    chunk_size: int
    chunk_dtypes: tuple[np.dtype, ...]
    chunk_trainable: tuple[bool, ...] | None = None

    def __post_init__(self):
        tr = (True,) * len(self.chunk_dtypes) if self.chunk_trainable is None else tuple(self.chunk_trainable)
        if len(tr) != len(self.chunk_dtypes) or not all(isinstance(t, (bool, np.bool_)) for t in tr):
            raise ValueError(f"chunk_trainable must be {len(self.chunk_dtypes)} bools (one per chunk), got {tr}")
        for c, (t, d) in enumerate(zip(tr, self.chunk_dtypes)):
            if t and not jnp.issubdtype(d, jnp.floating):
                raise ValueError(f"chunk {c} of dtype {np.dtype(d).name} is marked trainable: "
                                 "only floating chunks can be trained, mark its leaves frozen")
        object.__setattr__(self, "chunk_trainable", tuple(bool(t) for t in tr))
        for s in self.slots:
            if s.offset + s.size > self.chunk_size:
                raise ValueError(f"leaf {s.path} overflows chunk {s.chunk}")
            if np.dtype(s.dtype) != np.dtype(self.chunk_dtypes[s.chunk]):
                raise ValueError(f"leaf {s.path} dtype {s.dtype} in chunk of {self.chunk_dtypes[s.chunk]}")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def n_chunks(self) -> int:
        return len(self.chunk_dtypes)

    @property
    def n_elements(self) -> int:
        """Elements of real data (no padding)."""
        return sum(s.size for s in self.slots)

    def chunk_bytes(self, chunk: int, dtype=None) -> int:
        """Bytes of one chunk buffer in ``dtype`` (default: the chunk's own dtype)."""
        return self.chunk_size * np.dtype(dtype or self.chunk_dtypes[chunk]).itemsize

    @property
    def waste_bytes(self) -> int:
        """Padding bytes over all chunks, each chunk counted in its own dtype."""
        used = [0] * self.n_chunks
        for s in self.slots:
            used[s.chunk] += s.size
        return sum((self.chunk_size - u) * np.dtype(d).itemsize for u, d in zip(used, self.chunk_dtypes))

    def chunk_leaves(self, chunk: int) -> list[LeafSlot]:
        """Slots of one chunk ordered by offset."""
        return sorted((s for s in self.slots if s.chunk == chunk), key=lambda s: s.offset)

    def chunks_of(self, prefixes: Sequence[str]) -> tuple[int, ...]:
        """Sorted chunk ids holding any leaf whose path starts with one of ``prefixes``."""
        return tuple(sorted({s.chunk for s in self.slots if _matches(s.path, prefixes)}))

    # ---- pack / unpack (pure, jit-friendly) -------------------------------------------
    def pack(self, tree, dtype=None) -> list[jax.Array]:
        """Flatten ``tree`` into chunk buffers.

        Args:
          tree: a pytree with this layout's structure (shapes must match; dtypes are cast to
            the chunk dtype, or to ``dtype`` when given).
          dtype: optional dtype for every chunk (e.g. ``float32`` for master params).

        Returns:
          ``n_chunks`` 1-D arrays of ``chunk_size`` elements; padding is zero.
        """
        leaves = self.treedef.flatten_up_to(tree)
        by_chunk: list[list[tuple[int, jax.Array]]] = [[] for _ in range(self.n_chunks)]
        for s, leaf in zip(self.slots, leaves):
            if tuple(np.shape(leaf)) != s.shape:
                raise ValueError(f"leaf {s.path} has shape {np.shape(leaf)}, layout expects {s.shape}")
            by_chunk[s.chunk].append((s.offset, leaf))
        out = []
        for c, items in enumerate(by_chunk):
            dt = dtype or self.chunk_dtypes[c]
            parts, pos = [], 0
            for off, leaf in sorted(items, key=lambda t: t[0]):
                if off > pos:
                    parts.append(jnp.zeros((off - pos,), dt))
                parts.append(jnp.ravel(jnp.asarray(leaf)).astype(dt))
                pos = off + int(np.size(leaf))
            if pos < self.chunk_size:
                parts.append(jnp.zeros((self.chunk_size - pos,), dt))
            out.append(jnp.concatenate(parts))
        return out

    def unpack(self, chunks: Sequence[jax.Array] | Mapping[int, jax.Array]):
        """Inverse of :meth:`pack`: rebuild the pytree from chunk buffers (static slices)."""
        leaves = [_take(chunks[s.chunk], s) for s in self.slots]
        return self.treedef.unflatten(leaves)

    def unpack_subtree(self, chunks: Mapping[int, jax.Array], keys: Sequence[str]) -> dict:
        """Rebuild only the top-level entries ``keys`` of a dict pytree.

        Args:
          chunks: chunk id -> buffer, holding at least ``chunks_of(keys)``.
          keys: top-level dict keys (e.g. ``("wte", "wpe")``).

        Returns:
          ``{key: subtree}`` with leaves sliced out of the chunk buffers.
        """
        leaves = [(_take(chunks[s.chunk], s) if _matches(s.path, keys) else None) for s in self.slots]
        tree = self.treedef.unflatten(leaves)  # leaves outside ``keys`` stay None
        return {k: tree[k] for k in keys}

    def scatter_add(self, acc: jax.Array, chunk: int, subtree_grads: Mapping[str, Any]) -> jax.Array:
        """Add the gradient leaves of ``subtree_grads`` (a ``{key: subtree}`` dict) into chunk
        buffer ``acc`` of chunk ``chunk`` at their offsets; leaves of other chunks are skipped."""
        for key, sub in subtree_grads.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(sub)
            for p, g in flat:
                s = self._slot_by_path[key + ("/" + _path_str(p) if p else "")]
                if s.chunk == chunk:
                    acc = jax.lax.dynamic_update_slice(
                        acc, jax.lax.dynamic_slice(acc, (s.offset,), (s.size,)) + jnp.ravel(g).astype(acc.dtype),
                        (s.offset,))
        return acc

    @property
    def _slot_by_path(self) -> dict[str, LeafSlot]:
        return {s.path: s for s in self.slots}

    def summary(self) -> str:
        """A short human-readable table of the chunks."""
        lines = [f"ChunkLayout: {self.n_chunks} chunks x {self.chunk_size} elements, "
                 f"{len(self.slots)} leaves, {self.n_elements} elements, waste {self.waste_bytes} bytes"]
        for c in range(self.n_chunks):
            ls = self.chunk_leaves(c)
            used = sum(s.size for s in ls)
            lines.append(f"  chunk {c:3d} {np.dtype(self.chunk_dtypes[c]).name:8s} {len(ls):3d} leaves "
                         f"{used / self.chunk_size:6.1%} full  first={ls[0].path if ls else '-'}")
        return "\n".join(lines)


def _matches(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _take(buf: jax.Array, s: LeafSlot) -> jax.Array:
    return jax.lax.slice(buf, (s.offset,), (s.offset + s.size,)).reshape(s.shape)


# ---- building a layout ---------------------------------------------------------------------

def _leaf_info(params) -> tuple[Any, list[tuple[str, tuple[int, ...], np.dtype]]]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    info = [(_path_str(p), tuple(np.shape(x)), np.dtype(x.dtype)) for p, x in flat]
    return treedef, info


def _greedy_pack(order: Sequence[int], info, chunk_size: int, frozen: frozenset = frozenset()):
    """Greedy first-use packing, one open chunk per (dtype, trainable) group; leaf indices in
    ``frozen`` are the frozen ones. Returns (slot chunk/offset per leaf, chunk dtypes)."""
    placed: dict[int, tuple[int, int]] = {}
    dtypes: list[np.dtype] = []
    open_chunk: dict[tuple, tuple[int, int]] = {}  # (dtype, frozen) -> (chunk id, fill)
    for i in order:
        _, shape, dt = info[i]
        size = int(math.prod(shape))
        group = (dt, i in frozen)
        cur = open_chunk.get(group)
        if cur is None or cur[1] + size > chunk_size:
            cur = (len(dtypes), 0)
            dtypes.append(dt)
        placed[i] = (cur[0], cur[1])
        open_chunk[group] = (cur[0], cur[1] + size)
    return placed, dtypes


def _frozen_leaves(params, info, trainable) -> frozenset:
    """Indices (``jax.tree.leaves`` order) of the frozen leaves: ``trainable=None`` freezes the
    non-floating leaves; else a pytree of bools with ``params``' structure."""
    floating = [jnp.issubdtype(dt, jnp.floating) for _, _, dt in info]
    if trainable is None:
        return frozenset(i for i, f in enumerate(floating) if not f)
    try:
        flags = jax.tree.structure(params).flatten_up_to(trainable)
    except (ValueError, TypeError) as e:
        raise ValueError(f"trainable must be a pytree of bools with the params' structure: {e}") from None
    for i, t in enumerate(flags):
        if not isinstance(t, (bool, np.bool_)):
            raise ValueError(f"trainable leaf for {info[i][0]} is {t!r}: use True or False")
        if t and not floating[i]:
            raise ValueError(f"leaf {info[i][0]} of dtype {info[i][2].name} cannot be trainable: mark it False")
    return frozenset(i for i, t in enumerate(flags) if not t)


def _waste_bytes(order, info, chunk_size: int, frozen: frozenset = frozenset()) -> int:
    placed, dtypes = _greedy_pack(order, info, chunk_size, frozen)
    used = [0] * len(dtypes)
    for i, (c, _) in placed.items():
        used[c] += int(math.prod(info[i][1]))
    return sum((chunk_size - u) * d.itemsize for u, d in zip(used, dtypes))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def search_chunk_size(params, order: Sequence[str] | None = None, *, min_chunks: int = 1,
                      n_candidates: int = 64, max_factor: float = 2.0, trainable=None) -> int:
    """Choose ``chunk_size`` (elements) minimising padding waste in **bytes**.

    Candidates run from the largest leaf (rounded up to :data:`CHUNK_ALIGN_ELEMS`) to
    ``max_factor`` times that, in ``n_candidates`` aligned steps; the one with least waste bytes
    wins (ties go to the smaller size, i.e. finer granularity). When ``min_chunks > 1`` the upper
    end is capped so the model yields at least that many chunks where possible.

    Args:
      params: pytree of arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated).
      order: leaf paths in first-use order (default: ``jax.tree.leaves`` order).
      min_chunks: prefer sizes giving at least this many chunks.
      trainable: as in :func:`build_layout` (the packing groups follow it).

    Returns:
      chunk size in elements (a multiple of ``CHUNK_ALIGN_ELEMS``, >= the largest leaf).
    """
    _, info = _leaf_info(params)
    idx = _order_indices(info, order)
    frozen = _frozen_leaves(params, info, trainable)
    lo = _round_up(max(int(math.prod(s)) for _, s, _ in info), CHUNK_ALIGN_ELEMS)
    total = sum(int(math.prod(s)) for _, s, _ in info)
    hi = max(lo, _round_up(int(lo * max_factor), CHUNK_ALIGN_ELEMS))
    if min_chunks > 1:
        hi = max(lo, min(hi, _round_up(total // min_chunks, CHUNK_ALIGN_ELEMS)))
    step = max(CHUNK_ALIGN_ELEMS, _round_up((hi - lo) // max(n_candidates, 1), CHUNK_ALIGN_ELEMS))
    best = None
    for cs in range(lo, hi + 1, step):
        w = _waste_bytes(idx, info, cs, frozen)
        if best is None or w < best[0]:
            best = (w, cs)
    return best[1]


def _order_indices(info, order: Sequence[str] | None) -> list[int]:
    if order is None:
        return list(range(len(info)))
    pos = {p: k for k, p in enumerate(order)}
    # leaves the step never reads go last, in tree order
    return sorted(range(len(info)), key=lambda i: (pos.get(info[i][0], len(pos) + i)))


def build_layout(params, chunk_size: int | None = None, order: Sequence[str] | None = None,
                 *, min_chunks: int = 1, trainable=None) -> ChunkLayout:
    """Build the chunk layout of a parameter pytree.

    Args:
      params: pytree of arrays or ``jax.ShapeDtypeStruct``.
      chunk_size: elements per chunk; ``None`` runs :func:`search_chunk_size`.
      order: leaf paths in first-use order (see :func:`first_use_order`); chunks are numbered
        and filled in that order, so chunk 0 is needed first.
      min_chunks: passed to the search when ``chunk_size`` is None.
      trainable: which leaves are trained. ``None``: floating leaves are trainable, integer and
        bool leaves frozen; or a pytree of bools with ``params``' structure (False = frozen: kept
        and fetched like a parameter, no master, optimizer state, gradient or update). Chunks
        hold only trainable or only frozen leaves (``ChunkLayout.chunk_trainable``).

    Returns:
      a :class:`ChunkLayout`.

    Raises:
      ValueError: ``chunk_size`` is smaller than the largest leaf (the message names it);
        ``trainable`` is not a bool pytree of the params' structure, or marks a non-floating
        leaf True.
    """
    treedef, info = _leaf_info(params)
    if not info:
        raise ValueError("params has no array leaves: nothing to chunk")
    idx = _order_indices(info, order)
    frozen = _frozen_leaves(params, info, trainable)
    if chunk_size is None:
        chunk_size = search_chunk_size(params, order, min_chunks=min_chunks, trainable=trainable)
    big = max(range(len(info)), key=lambda i: math.prod(info[i][1]))
    if math.prod(info[big][1]) > chunk_size:
        raise ValueError(_MSG_CHUNK_TOO_SMALL.format(chunk_size=chunk_size, path=info[big][0],
                                                     size=int(math.prod(info[big][1]))))
    placed, dtypes = _greedy_pack(idx, info, chunk_size, frozen)
    slots = tuple(LeafSlot(path=p, chunk=placed[i][0], offset=placed[i][1], shape=s, dtype=d)
                  for i, (p, s, d) in enumerate(info))
    chunk_trainable = [True] * len(dtypes)
    for i in frozen:
        chunk_trainable[placed[i][0]] = False
    return ChunkLayout(treedef=treedef, slots=slots, chunk_size=int(chunk_size), chunk_dtypes=tuple(dtypes),
                       chunk_trainable=tuple(chunk_trainable))


# ---- first use, from a trace ------------------------------------------------------------

def first_use_order(fn: Callable, params, *args) -> list[str]:
    """Leaf paths of ``params`` in the order ``fn(params, *args)`` first reads them.

    A tracing pass: ``jax.make_jaxpr`` on abstract values (nothing is allocated), then the index
    of the first equation that consumes each parameter input. Leaves never read come last, in
    tree order.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = [_path_str(p) for p, _ in flat]
    n = len(flat)
    closed = jax.make_jaxpr(fn)(params, *args)
    jaxpr = closed.jaxpr
    invars = jaxpr.invars[:n]
    first: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal) and v not in first:
                first[v] = k
    big = len(jaxpr.eqns) + 1
    order = sorted(range(n), key=lambda i: (first.get(invars[i], big), i))
    return [paths[i] for i in order]
