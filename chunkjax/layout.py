"""Chunk layout: flatten a parameter pytree into fixed-size flat chunks.

PatrickStar (Fang et al., arXiv 2108.05818, section 4.1 "Chunk-based memory management") keeps
model data in *chunks*: contiguous buffers of ``chunk_size`` elements into which tensors are
appended in the order the step first uses them. The four chunk lists of a chunk (compute params,
fp32 master params, Adam m and v) share one offset layout, so a tensor's optimizer state sits at
the same (chunk, offset) as its parameter. This module computes that layout.

* Leaves are grouped by (dtype, trainable) (one chunk list per group, never mixing itemsizes or
  trainable with frozen leaves in one buffer; see ``build_layout(trainable=)``) and ordered by
  first use. A leaf of at most ``chunk_size`` elements is placed whole, as in PatrickStar: into
  the open chunk of its group if it fits, else into a new chunk (the rest of the old one is
  padding). A leaf *larger* than a chunk spans consecutive chunks of its group: it fills the
  rest of the open chunk and continues into new ones; its last chunk stays open for the next
  leaves. So the chunk size no longer follows the largest leaf (the embedding).
* A leaf's place is its :class:`Piece` s, ``(chunk, offset in chunk, offset in leaf, size)`` in
  leaf order; a leaf is the concatenation of its pieces, its gradient is cut into the same pieces.
* ``chunk_size`` counts *elements*; padding waste is counted in *bytes* (``waste_bytes``), so a
  search over chunk sizes with mixed bf16/f32 leaves compares like with like.
* :meth:`ChunkLayout.pack`, :meth:`ChunkLayout.unpack`, :meth:`ChunkLayout.unpack_subtree` and
  :meth:`ChunkLayout.scatter_add` are pure jnp code (static slices and concatenations) and can be
  used inside ``jax.jit``.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from chunkjax.errors import complex_param_error

#: Elements of one copy :meth:`ChunkLayout.host_chunks` hands a thread (16 MiB of float32).
FILL_PIECE = 2**22
#: Threads :meth:`ChunkLayout.host_chunks` fills a chunk with (at most the CPU count).
FILL_THREADS = 8
#: Chunk sizes are a multiple of this many elements (keeps buffers aligned).
CHUNK_ALIGN_ELEMS = 128

#: Default target of the chunk-size search: at least this many chunks where the model allows.
DEFAULT_MIN_CHUNKS = 8
#: The most chunks a layout may have: the planner's cost grows with the chunk count (a chunk size of
#: a few elements would give millions of chunks and a plan that never ends).
MAX_CHUNKS = 4096

#: Default padding bound of the chunk-size search: padding bytes / all chunk bytes.
DEFAULT_MAX_WASTE = 0.05

#: Default largest chunk the search picks (elements; 64M, a multiple of CHUNK_ALIGN_ELEMS).
DEFAULT_MAX_CHUNK_ELEMS = 64 * 2**20


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One contiguous run of a leaf's elements (row-major order) inside one chunk.

    Attributes:
      chunk: index of the chunk (global over all groups).
      offset: first element of the piece inside the chunk.
      leaf_offset: first element of the piece inside the flattened leaf.
      size: number of elements (0 only for a leaf with no elements).
    """

    chunk: int
    offset: int
    leaf_offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where one leaf of the pytree lives.

    Attributes:
      path: the leaf's key path, ``"h_0/attn/c_attn/kernel"`` style.
      pieces: the leaf's :class:`Piece` s in leaf order, in consecutive chunks of one group;
        one piece unless the leaf is larger than a chunk (or starts at the end of one).
      shape: the leaf's shape.
      dtype: the leaf's dtype (equal to its chunks' dtype).
    """

    path: str
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(math.prod(self.shape))

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunks the leaf touches, in leaf order."""
        return tuple(p.chunk for p in self.pieces)

    def piece_in(self, chunk: int) -> Piece | None:
        """The leaf's piece in ``chunk`` (None if it has none there)."""
        return next((p for p in self.pieces if p.chunk == chunk), None)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Leaf -> pieces (chunk, offset, leaf offset, size), shape and dtype, for one pytree.

    Attributes:
      treedef: the pytree structure the layout was built from.
      slots: one :class:`LeafSlot` per leaf, in ``jax.tree.leaves`` order.
      chunk_size: elements per chunk (same for every dtype group).
      chunk_dtypes: dtype of each chunk, ``len == n_chunks``; chunks are numbered in
        first-use order.
      chunk_trainable: whether each chunk is trained, ``len == n_chunks`` (default ``None``: all
        True). A frozen chunk (False) is stored and fetched like a parameter chunk but has no
        master params, optimizer state or gradient; chunks of a non-floating dtype must be frozen.

    Raises:
      ValueError: pieces that leave a chunk, overlap, do not cover their leaf in order, or sit in
        a chunk of another dtype; a bad ``chunk_trainable``.
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
        runs: dict[int, list[tuple[int, int, str]]] = {}
        for s in self.slots:
            pos = 0
            for p in s.pieces:
                if not 0 <= p.chunk < len(self.chunk_dtypes):
                    raise ValueError(f"leaf {s.path} names chunk {p.chunk} of {len(self.chunk_dtypes)}")
                if p.offset < 0 or p.size < 0 or p.offset + p.size > self.chunk_size:
                    raise ValueError(f"leaf {s.path} overflows chunk {p.chunk}")
                if p.leaf_offset != pos:
                    raise ValueError(f"leaf {s.path}: piece in chunk {p.chunk} starts at element {p.leaf_offset}, "
                                     f"expected {pos} (pieces must cover the leaf in order)")
                if np.dtype(s.dtype) != np.dtype(self.chunk_dtypes[p.chunk]):
                    raise ValueError(f"leaf {s.path} dtype {s.dtype} in chunk of {self.chunk_dtypes[p.chunk]}")
                runs.setdefault(p.chunk, []).append((p.offset, p.offset + p.size, s.path))
                pos += p.size
            if not s.pieces or pos != s.size:
                raise ValueError(f"leaf {s.path}: pieces hold {pos} of its {s.size} elements")
        for c, rs in runs.items():
            rs.sort()
            for (_, e0, a), (b1, _, b) in zip(rs, rs[1:]):
                if b1 < e0:
                    raise ValueError(f"leaves {a} and {b} overlap in chunk {c}")

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
    def chunk_used(self) -> tuple[int, ...]:
        """Elements of real data (no padding) per chunk, ``len == n_chunks``."""
        used = [0] * self.n_chunks
        for s in self.slots:
            for p in s.pieces:
                used[p.chunk] += p.size
        return tuple(used)

    @property
    def waste_bytes(self) -> int:
        """Padding bytes over all chunks, each chunk counted in its own dtype."""
        return sum((self.chunk_size - u) * np.dtype(d).itemsize for u, d in zip(self.chunk_used, self.chunk_dtypes))

    @functools.cached_property
    def _pieces_by_chunk(self) -> tuple[tuple[tuple[int, Piece], ...], ...]:
        by: list[list[tuple[int, Piece]]] = [[] for _ in range(self.n_chunks)]
        for i, s in enumerate(self.slots):
            for p in s.pieces:
                by[p.chunk].append((i, p))
        return tuple(tuple(sorted(b, key=lambda t: t[1].offset)) for b in by)

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {s.path: i for i, s in enumerate(self.slots)}

    def chunk_pieces(self, chunk: int) -> tuple[tuple[int, Piece], ...]:
        """``(slot index, piece)`` of every leaf piece in one chunk, ordered by offset."""
        return self._pieces_by_chunk[chunk]

    def chunk_leaves(self, chunk: int) -> list[LeafSlot]:
        """Slots of the leaves with a piece in one chunk, ordered by that piece's offset."""
        return [self.slots[i] for i, _ in self.chunk_pieces(chunk)]

    def chunks_of(self, prefixes: Sequence[str]) -> tuple[int, ...]:
        """Sorted ids of every chunk touched by a leaf whose path starts with one of ``prefixes``."""
        return tuple(sorted({c for s in self.slots if _matches(s.path, prefixes) for c in s.chunks}))

    # ---- pack / unpack (pure, jit-friendly) -------------------------------------------
    def pack_chunk(self, chunk: int, leaves: Sequence | Mapping[int, Any], dtype=None) -> jax.Array:
        """One chunk buffer from the leaves that have a piece in it.

        Args:
          chunk: the chunk id.
          leaves: leaf arrays indexed by slot index (the list of all leaves, or a mapping holding
            at least the indices of :meth:`chunk_pieces`); shapes must match the slots.
          dtype: the buffer's dtype (default: the chunk's); leaves are cast to it.

        Returns:
          a ``(chunk_size,)`` array; padding is zero.

        Raises:
          ValueError: a leaf's shape differs from its slot's.
        """
        dt = dtype or self.chunk_dtypes[chunk]
        parts, pos = [], 0
        for i, p in self.chunk_pieces(chunk):
            s = self.slots[i]
            leaf = leaves[i]
            if tuple(np.shape(leaf)) != s.shape:
                raise ValueError(f"leaf {s.path} has shape {np.shape(leaf)}, layout expects {s.shape}")
            if p.offset > pos:
                parts.append(jnp.zeros((p.offset - pos,), dt))
            parts.append(_cut(jnp.ravel(jnp.asarray(leaf)).astype(dt), s, p))
            pos = p.offset + p.size
        if pos < self.chunk_size:
            parts.append(jnp.zeros((self.chunk_size - pos,), dt))
        return jnp.concatenate(parts)

    def host_chunks(self, leaf_at: Callable[[int], Any], dtype=np.float32, chunks: Sequence[int] | None = None,
                    threads: int | None = None):
        """The chunk buffers, built on the host with numpy.

        Args:
          leaf_at: ``leaf_at(i)`` gives leaf ``i`` of ``slots`` (an array of shape
            ``slots[i].shape``); called about once per leaf: the leaf last drawn is kept, so a
            spanning leaf is drawn once for consecutive chunks (of ``chunks``' order).
          dtype: the buffers' dtype (the leaves are cast to it), or one dtype per chunk id.
          chunks: the chunk ids to build, in this order (default every chunk in id order).
          threads: threads copying a leaf's pieces into the buffer (default up to
            :data:`FILL_THREADS`); a piece above :data:`FILL_PIECE` elements is split, so the pages
            of a fresh buffer are written (faulted in) by several threads at once.

        Yields:
          a fresh writable ``(chunk_size,)`` numpy array per chunk of ``chunks``; padding is zero.
          Host memory: one chunk and one leaf at a time (for models that never exist whole in host
          memory).
        """
        dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * self.n_chunks
        ids = range(self.n_chunks) if chunks is None else [int(c) for c in chunks]
        n_threads = max(1, min(FILL_THREADS, os.cpu_count() or 1) if threads is None else int(threads))
        pool = None
        if n_threads > 1:
            pool = concurrent.futures.ThreadPoolExecutor(n_threads, thread_name_prefix="chunkjax-fill")

        def copy(jobs):  # numpy releases the GIL while it copies
            if pool is None or len(jobs) < 2:
                for d, x in jobs:
                    np.copyto(d, x)
            else:
                list(pool.map(lambda j: np.copyto(*j), jobs))

        drawn: dict[int, np.ndarray] = {}
        try:
            for c in ids:
                dt = dtypes[c]
                buf = np.zeros((self.chunk_size,), dt)
                jobs = []
                for i, p in self.chunk_pieces(c):
                    if i not in drawn:  # the leaf as drawn (a leaf's chunks share one dtype)
                        copy(jobs)  # the previous leaf's pieces first: one leaf alive at a time
                        jobs = []
                        drawn = {i: np.asarray(leaf_at(i), dt).ravel()}
                    src = drawn[i]
                    for o in range(0, p.size, FILL_PIECE):
                        k = min(FILL_PIECE, p.size - o)
                        lo = p.leaf_offset + o
                        jobs.append((buf[p.offset + o:p.offset + o + k], src[lo:lo + k]))
                copy(jobs)
                del jobs
                yield buf
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def pack(self, tree, dtype=None) -> list[jax.Array]:
        """Flatten ``tree`` into chunk buffers.

        Args:
          tree: a pytree with this layout's structure (shapes must match; dtypes are cast to
            the chunk dtype, or to ``dtype`` when given).
          dtype: optional dtype for every chunk (e.g. ``float32`` for master params).

        Returns:
          ``n_chunks`` 1-D arrays of ``chunk_size`` elements; padding is zero.

        Raises:
          ValueError: a leaf's shape differs from its slot's.
        """
        leaves = self.treedef.flatten_up_to(tree)
        for s, leaf in zip(self.slots, leaves):
            if tuple(np.shape(leaf)) != s.shape:
                raise ValueError(f"leaf {s.path} has shape {np.shape(leaf)}, layout expects {s.shape}")
        return [self.pack_chunk(c, leaves, dtype) for c in range(self.n_chunks)]

    def unpack(self, chunks: Sequence[jax.Array] | Mapping[int, jax.Array]):
        """Inverse of :meth:`pack`: rebuild the pytree from chunk buffers (static slices; a
        spanning leaf is the concatenation of its pieces)."""
        return self.treedef.unflatten([_take(chunks, s) for s in self.slots])

    def unpack_subtree(self, chunks: Mapping[int, jax.Array], keys: Sequence[str]) -> dict:
        """Rebuild only the top-level entries ``keys`` of a dict pytree.

        Args:
          chunks: chunk id -> buffer, holding at least ``chunks_of(keys)``.
          keys: top-level dict keys (e.g. ``("wte", "wpe")``).

        Returns:
          ``{key: subtree}`` with leaves sliced out of the chunk buffers.
        """
        leaves = [(_take(chunks, s) if _matches(s.path, keys) else None) for s in self.slots]
        tree = self.treedef.unflatten(leaves)  # leaves outside ``keys`` stay None
        return {k: tree[k] for k in keys}

    def scatter_add(self, acc: jax.Array, chunk: int, subtree_grads: Mapping[str, Any]) -> jax.Array:
        """Add the gradient leaves of ``subtree_grads`` (a ``{key: subtree}`` dict) into chunk
        buffer ``acc`` (``(chunk_size,)``) of chunk ``chunk``: each leaf's piece in that chunk is
        added at its offset; leaves without a piece there are skipped."""
        for key, sub in subtree_grads.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(sub)
            for pth, g in flat:
                s = self.slots[self._index[key + ("/" + _path_str(pth) if pth else "")]]
                p = s.piece_in(chunk)
                if p is not None:
                    acc = jax.lax.dynamic_update_slice(
                        acc, jax.lax.dynamic_slice(acc, (p.offset,), (p.size,)) + _cut(jnp.ravel(g).astype(acc.dtype), s, p),
                        (p.offset,))
        return acc

    def summary(self) -> str:
        """A short human-readable table of the chunks (a spanning leaf's piece is shown as
        ``path[k/n]``)."""
        lines = [f"ChunkLayout: {self.n_chunks} chunks x {self.chunk_size} elements, "
                 f"{len(self.slots)} leaves, {self.n_elements} elements, waste {self.waste_bytes} bytes"]
        for c, used in enumerate(self.chunk_used):
            ps = self.chunk_pieces(c)
            first = "-"
            if ps:
                s = self.slots[ps[0][0]]
                first = s.path if len(s.pieces) == 1 else f"{s.path}[{s.chunks.index(c) + 1}/{len(s.pieces)}]"
            lines.append(f"  chunk {c:3d} {np.dtype(self.chunk_dtypes[c]).name:8s}"
                         f"{'' if self.chunk_trainable[c] else ' frozen'} {len(ps):3d} leaves "
                         f"{used / self.chunk_size:6.1%} full  first={first}")
        return "\n".join(lines)


def _matches(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _cut(flat: jax.Array, s: LeafSlot, p: Piece) -> jax.Array:
    """Piece ``p`` of the flattened leaf ``flat`` (the leaf itself when it is whole)."""
    return flat if p.size == s.size else jax.lax.slice(flat, (p.leaf_offset,), (p.leaf_offset + p.size,))


def _take(chunks, s: LeafSlot) -> jax.Array:
    parts = [jax.lax.slice(chunks[p.chunk], (p.offset,), (p.offset + p.size,)) for p in s.pieces]
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(s.shape)


# ---- building a layout ---------------------------------------------------------------------

def _leaf_info(params) -> tuple[Any, list[tuple[str, tuple[int, ...], np.dtype]]]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    info = [(_path_str(p), tuple(np.shape(x)), np.dtype(x.dtype)) for p, x in flat]
    return treedef, info


def _greedy_pack(order: Sequence[int], info, chunk_size: int, frozen: frozenset = frozenset()):
    """First-use packing, one open chunk per (dtype, trainable) group; leaf indices in ``frozen``
    are the frozen ones. A leaf of at most ``chunk_size`` elements goes whole into the open chunk
    of its group or a new one; a larger leaf fills the open chunk and continues into new ones.

    Returns:
      (leaf index -> list of (chunk, offset, leaf offset, size), chunk groups (dtype, frozen)).
    """
    placed: dict[int, list[tuple[int, int, int, int]]] = {}
    groups: list[tuple[np.dtype, bool]] = []
    open_chunk: dict[tuple, tuple[int, int]] = {}  # (dtype, frozen) -> (chunk id, fill)
    for i in order:
        _, shape, dt = info[i]
        size = int(math.prod(shape))
        group = (dt, i in frozen)
        cur = open_chunk.get(group)
        if cur is None or (cur[1] + size > chunk_size and (size <= chunk_size or cur[1] == chunk_size)):
            cur = (len(groups), 0)
            groups.append(group)
        pieces, done = [], 0
        while True:
            n = min(size - done, chunk_size - cur[1])
            pieces.append((cur[0], cur[1], done, n))
            done, cur = done + n, (cur[0], cur[1] + n)
            if done == size:
                break
            cur = (len(groups), 0)
            groups.append(group)
        placed[i] = pieces
        open_chunk[group] = cur
    return placed, groups


def _frozen_leaves(params, info, trainable) -> frozenset:
    """Indices (``jax.tree.leaves`` order) of the frozen leaves: ``trainable=None`` freezes the
    non-floating leaves; else a pytree of bools with ``params``' structure."""
    floating = [jnp.issubdtype(dt, jnp.floating) for _, _, dt in info]
    if trainable is None:
        for name, _, dt in (x for x in info if jnp.issubdtype(x[2], jnp.complexfloating)):
            raise complex_param_error(name, dt.name)  # differentiable: not frozen unasked
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


def _waste_bytes(order, info, chunk_size: int, frozen: frozenset = frozenset()) -> tuple[int, int]:
    """(padding bytes, all chunk bytes) of the packing at ``chunk_size``."""
    placed, groups = _greedy_pack(order, info, chunk_size, frozen)
    used = [0] * len(groups)
    for pieces in placed.values():
        for c, _, _, n in pieces:
            used[c] += n
    items = [dt.itemsize for dt, _ in groups]
    return sum((chunk_size - u) * it for u, it in zip(used, items)), chunk_size * sum(items)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def search_chunk_size(params, order: Sequence[str] | None = None, *, min_chunks: int = DEFAULT_MIN_CHUNKS,
                      max_waste: float = DEFAULT_MAX_WASTE, max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
                      align: int = CHUNK_ALIGN_ELEMS, n_candidates: int = 64, trainable=None) -> int:
    """Choose ``chunk_size`` (elements) from a target chunk count and a padding bound.

    The rule: ``hi`` is the largest multiple of ``align`` that still gives at least
    ``min_chunks`` chunks (``total_elements // min_chunks`` rounded down; at least ``align``),
    capped at ``max_chunk_elems``. Candidates run from ``hi`` down to ``hi / 2`` in
    ``n_candidates`` aligned steps; the first (largest) whose padding bytes are at most
    ``max_waste`` of all chunk bytes wins; if none is, the one with least padding bytes (ties:
    the larger). Padding counts **bytes**, each chunk in its own dtype. Leaves larger than the
    size span chunks, so the largest leaf is no floor.

    Args:
      params: pytree of arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated).
      order: leaf paths in first-use order (default: ``jax.tree.leaves`` order).
      min_chunks: target count: sizes giving at least this many chunks (>= 1).
      max_waste: padding bound, a fraction of all chunk bytes (0 <= max_waste < 1).
      max_chunk_elems: the largest size considered (elements).
      align: sizes are multiples of it (``CHUNK_ALIGN_ELEMS``; ZeRO layouts pass
        ``lcm(ranks, CHUNK_ALIGN_ELEMS)``).
      n_candidates: number of sizes tried.
      trainable: as in :func:`build_layout` (the packing groups follow it).

    Returns:
      chunk size in elements, a multiple of ``align``.

    Raises:
      ValueError: ``min_chunks < 1``, ``align < 1``, ``max_chunk_elems < align`` or
        ``max_waste`` outside [0, 1).
    """
    if min_chunks < 1 or align < 1 or max_chunk_elems < align or not 0 <= max_waste < 1:
        raise ValueError(f"search_chunk_size needs min_chunks >= 1, align >= 1, max_chunk_elems >= align and "
                         f"0 <= max_waste < 1; got min_chunks={min_chunks}, align={align}, "
                         f"max_chunk_elems={max_chunk_elems}, max_waste={max_waste}")
    _, info = _leaf_info(params)
    idx = _order_indices(info, order)
    frozen = _frozen_leaves(params, info, trainable)
    total = sum(int(math.prod(s)) for _, s, _ in info)
    hi = max(align, min(total // min_chunks, max_chunk_elems) // align * align)
    lo = max(align, _round_up(hi // 2, align))
    step = max(align, _round_up((hi - lo) // max(n_candidates, 1), align))
    best = None
    for cs in range(hi, lo - 1, -step):
        waste, stored = _waste_bytes(idx, info, cs, frozen)
        if waste <= max_waste * stored:
            return cs
        if best is None or waste < best[0]:
            best = (waste, cs)
    return best[1]


def _order_indices(info, order: Sequence[str] | None) -> list[int]:
    if order is None:
        return list(range(len(info)))
    pos = {p: k for k, p in enumerate(order)}
    # leaves the step never reads go last, in tree order
    return sorted(range(len(info)), key=lambda i: (pos.get(info[i][0], len(pos) + i)))


def build_layout(params, chunk_size: int | None = None, order: Sequence[str] | None = None,
                 *, min_chunks: int = DEFAULT_MIN_CHUNKS, trainable=None) -> ChunkLayout:
    """Build the chunk layout of a parameter pytree.

    Args:
      params: pytree of arrays or ``jax.ShapeDtypeStruct``.
      chunk_size: elements per chunk (>= 1, any size: leaves larger than it span chunks);
        ``None`` runs :func:`search_chunk_size` with its defaults (at least ``min_chunks``
        chunks, at most 5 % padding bytes, at most 64M elements).
      order: leaf paths in first-use order (see :func:`first_use_order`); chunks are numbered
        and filled in that order, so chunk 0 is needed first.
      min_chunks: passed to the search when ``chunk_size`` is None.
      trainable: which leaves are trained. ``None``: floating leaves are trainable, integer and
        bool leaves frozen, a complex leaf refused (ValueError); or a pytree of bools with
        ``params``' structure (False = frozen: fetched as a parameter, no master, state or update). Chunks
        hold only trainable or only frozen leaves (``ChunkLayout.chunk_trainable``).

    Returns:
      a :class:`ChunkLayout`.

    Raises:
      ValueError: no array leaves; ``chunk_size < 1`` or so small that the layout would have more
        than :data:`MAX_CHUNKS` chunks; ``trainable`` is not a bool pytree of the
        params' structure, or marks a non-floating leaf True.
    """
    treedef, info = _leaf_info(params)
    if not info:
        raise ValueError("params has no array leaves: nothing to chunk")
    idx = _order_indices(info, order)
    frozen = _frozen_leaves(params, info, trainable)
    if chunk_size is None:
        chunk_size = search_chunk_size(params, order, min_chunks=min_chunks, trainable=trainable)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1 element, got {chunk_size}: or leave chunk_size=None to search")
    total = sum(int(math.prod(sh)) for _, sh, _ in info)
    if -(-total // int(chunk_size)) > MAX_CHUNKS:
        least = _round_up(-(-total // MAX_CHUNKS), CHUNK_ALIGN_ELEMS)
        raise ValueError(f"chunk_size={chunk_size} elements gives over {MAX_CHUNKS} chunks for {total:,} elements: "
                         f"use chunk_size >= {least} or leave chunk_size=None to search")
    placed, groups = _greedy_pack(idx, info, int(chunk_size), frozen)
    slots = tuple(LeafSlot(path=p, pieces=tuple(Piece(*t) for t in placed[i]), shape=s, dtype=d)
                  for i, (p, s, d) in enumerate(info))
    return ChunkLayout(treedef=treedef, slots=slots, chunk_size=int(chunk_size),
                       chunk_dtypes=tuple(dt for dt, _ in groups),
                       chunk_trainable=tuple(not fr for _, fr in groups))


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
