"""Restoring: a checkpoint opened for one chunk layout (:class:`SavedState`: checks, remap by leaf
path, chunks read lazily and verified), :func:`restore_checkpoint` into any engine implementing
:class:`~chunkjax.checkpoint.protocol.ChunkIO`, and the export of float32 params."""
from __future__ import annotations

import os

import numpy as np

import chunkjax.checkpoint.files as files
from chunkjax.checkpoint.codec import decode
from chunkjax.checkpoint.job import engine_info
from chunkjax.checkpoint.protocol import CheckpointError

#: ``saved_from["step"]`` of the front door's checkpoints (:class:`chunkjax.OffloadedStep`).
FRONT_DOOR = "OffloadedStep"


def restore_checkpoint(directory, step_fn, step_number: int | None = None):
    """Restore a checkpoint into ``step_fn``'s placement, layout and devices, chunk by chunk.

    ``step_fn`` is any engine implementing :class:`~chunkjax.checkpoint.protocol.ChunkIO`, which
    builds the state (:meth:`~chunkjax.checkpoint.protocol.ChunkIO.checkpoint_restore` of a
    :class:`SavedState`): a :class:`chunkjax.ChunkedStep` on one device (any placement or
    schedule: device / pinned host jax arrays with an optax state, or numpy master and
    ``Host*State`` for host-updated chunks) or over a ZeRO mesh (any stage, device count,
    process count and placement: every chunk sharded over its mesh, each process placing its own
    shards; host-updated chunks as one numpy slice and one ``Host*State`` per local rank), or a
    drop-in optimizer (:class:`chunkjax.ChunkedOptimizer`, :class:`chunkjax.NnxOptimizer`: its
    master params, optax state and step count are replaced). The checkpoint may come from any of
    them (and from the storage tier). If the compute
    dtype differs from the saved one, compute params are recast from the float32 master params.

    When the chunk layouts are equal each chunk is read and placed as it was saved. Otherwise
    (another chunk size, e.g. a ZeRO layout padded to another rank count, or another packing)
    every leaf is moved by its path: each new chunk is assembled from the saved chunks holding
    its leaves (params, master params and every optimizer moment element by element), reading
    saved chunks lazily with at most two held; padding is zero. The parameter tree (leaf paths,
    shapes, dtypes) must be the same, every saved chunk must hold the same moments and, when
    remapping, the same optimizer step count (the remapped chunks take it).

    Host memory beyond the restored state: two chunks (equal layouts: the chunk read and its
    placed copy) or four (remapping: two saved chunks, the new chunk being assembled and its
    placed copy), each ``params + master + moments``. Every file is checked against its
    recorded crc32 (``checksums.json``) just before it is read.

    Args:
      directory: the checkpoint root.
      step_fn: the engine to restore into: a :class:`chunkjax.ChunkedStep` (any topology) or a
        drop-in optimizer.
      step_number: which step; None for :func:`latest_step`.

    Returns:
      ``(state, extra)``: a :class:`chunkjax.TrainState` (a step; an :class:`chunkjax.OffloadedStep`
      holds it as its ``state``, with the saved non-parameter state), or the new params pytree in
      the params' dtypes on the device (a drop-in optimizer: what its ``update`` returns; for
      :class:`chunkjax.NnxOptimizer` an ``nnx.State`` for ``nnx.update(model, ...)``); and the
      saved ``extra`` dict (arrays come back as numpy arrays, PRNG keys as typed key arrays, tuples as tuples).

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: a file of the checkpoint missing, unreadable or corrupt (one line naming
        it, its size and crc32 against the saved ones, and the ``step_number=`` call restoring
        the newest earlier step, or that there is none; with ``step_number`` None such a newest
        checkpoint is skipped with a warning naming its fault and the step restored instead, and
        if every complete one is corrupt the newest's fault is raised, with no warning first),
        another parameter tree (the one-line message names the first leaf that
        differs), optimizer moments that cannot be converted into this step's optimizer state,
        step counts that differ over the chunks when the layout changes, or an object that is
        no ChunkIO engine.
    """
    engine_info(step_fn)  # a ChunkIO engine, or a one-line CheckpointError
    with SavedState(directory, step_fn.layout, step_fn.compute_dtype, step_number,
                    engine=type(step_fn).__name__) as saved:
        state = step_fn.checkpoint_restore(saved)
    return state, saved.extra


class SavedState:
    """A checkpoint opened for restoring into the chunk layout ``layout`` (the
    :class:`~chunkjax.checkpoint.protocol.SavedChunks` an engine's ``checkpoint_restore`` reads).

    Opening reads and verifies ``meta.json`` and checks the parameter tree; chunks are read on
    :meth:`chunk` (each file checked against its crc32 first), remapped by leaf path when
    ``layout`` chunks the tree differently, with at most two saved chunks held. Use it as a
    context manager (the orbax checkpointer is closed on exit).

    Args:
      directory: the checkpoint root.
      layout: the :class:`~chunkjax.layout.ChunkLayout` to restore into.
      compute_dtype: the dtype of the ``params`` :meth:`chunk` returns (saved params when the
        dtype is the saved one, else recast from the float32 master); None: no ``params``.
      step_number: which step; None for :func:`~chunkjax.checkpoint.latest_step`.
      names: the saved arrays to read (default: ``params`` when the compute dtype is the saved
        one, ``master`` and the moments).
      engine: the restoring engine's class name (``"NnxOptimizer"``), for
        the message when the parameter tree differs because the checkpoint is another engine's
        (a front door checkpoint restored into a drop-in optimizer).

    Attributes:
      meta: ``meta.json``. where: ``"checkpoint step N in <directory>"``. remap: True when the
      saved chunk layout differs from ``layout``. count, rest: the optimizer step count and
      rest-of-model scalars of the first chunk (the remapped chunks take them).

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: corrupt metadata, another parameter tree, chunks with different moments,
        or (remapping) different step counts.
    """

    def __init__(self, directory, layout, compute_dtype, step_number: int | None = None, *, names=None,
                 engine: str | None = None):
        meta = files.read_meta(directory, step_number)
        self.meta, self.layout = meta, layout
        self.root = files.step_dir(directory, meta["step"])
        self.where = where = f"checkpoint step {meta['step']} in {os.fspath(directory)}"
        saved, here = meta["layout"], files.layout_spec(layout)
        self.remap = files.layout_difference(saved, here) is not None
        if self.remap:
            diff = files.tree_difference(saved, here)
            if diff is not None:
                if meta.get("saved_from", {}).get("step") == FRONT_DOOR and engine not in (None, FRONT_DOOR):
                    raise CheckpointError(f"{where} was saved by chunkjax.offload (an {FRONT_DOOR}), not by a "
                                          f"{engine}: restore it into the step offload builds, step = chunkjax.offload("
                                          "model, tx, loss_fn, batch, device_budget=...); chunkjax.restore_checkpoint("
                                          "dir, step), then step.sync(model) for the model's params")
                raise CheckpointError(f"{where} holds another parameter tree: {diff}")
            if "chunk_trainable" in saved or "chunk_trainable" in here:
                raise CheckpointError(f"{where} has another chunk layout and frozen chunks, which are not remapped: "
                                      "restore with the saved layout and trainable leaves")
        self.common_moments, self.count, self.rest = files.common_optimizer(meta, where, need_one_count=self.remap)
        self.cdt = None if compute_dtype is None else np.dtype(compute_dtype)
        self.same_dtype = self.cdt is not None and meta["compute_dtype"] == self.cdt.name
        self.names = list(names) if names is not None else (
            (["params"] if self.same_dtype else []) + ["master", *self.common_moments])
        self.ckptr = files.checkpointer()
        self.src = _SavedChunks(self.ckptr, self.root, self.names, keep=2 if self.remap else 1)

    @property
    def extra(self):
        """The saved ``extra`` dict (arrays as numpy, PRNG keys as typed key arrays, tuples as tuples)."""
        return decode(self.meta["extra"])

    def moments(self, c: int) -> list[str]:
        """The optimizer moment names chunk ``c`` will have."""
        return list(self.common_moments) if self.remap else list(self.meta["chunks"][c]["moments"])

    def verify(self) -> None:
        """Check every saved chunk's files against their recorded size and crc32 (each read once;
        :meth:`chunk` checks again as it reads), so that an engine can refuse a corrupt checkpoint
        before it lets go of its own state. Raises CheckpointError naming the first bad file."""
        if self.src.sums is not None:
            for c in range(int(self.meta["layout"]["n_chunks"])):
                files.verify_files(self.root, self.src.sums, files.chunk_name(c))

    def arrays(self, c: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s saved arrays ``names`` ((layout.chunk_size,) numpy), remapped if needed."""
        if self.remap:
            return _assemble_chunk(self.src, self.meta["layout"], self.layout, c, self.names)
        return self.src.take(c)

    def chunk(self, c: int) -> tuple[dict[str, np.ndarray], dict]:
        """Chunk ``c`` in the portable form: ``({"master" (float32, writable), "params" (if a
        compute dtype was given), moment...}, {"count", "rest"})``."""
        if not self.layout.chunk_trainable[c]:  # a frozen chunk: its params in their own dtype
            return {"params": self.src.take(c, ["params"])["params"]}, {"count": None, "rest": {}}
        arrs = self.arrays(c)
        cm = {"count": self.count, "rest": self.rest} if self.remap else self.meta["chunks"][c]
        master = np.require(arrs.pop("master"), np.float32, ["C", "W", "O"])
        out = {"master": master}
        if self.cdt is not None:
            out["params"] = arrs.pop("params") if self.same_dtype else master.astype(self.cdt)
        out.update(arrs)
        return out, {"count": cm["count"], "rest": cm.get("rest", {})}

    def close(self) -> None:
        if self.ckptr is not None:
            self.ckptr.close()
            self.ckptr = self.src = None

    def __enter__(self) -> "SavedState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SavedChunks:
    """The saved chunks of one checkpoint, read lazily by index with at most ``keep`` held."""

    def __init__(self, ckptr, root: str, names, keep: int):
        self.ckptr, self.root, self.names, self.keep = ckptr, root, list(names), keep
        self.held: dict[int, dict] = {}  # insertion order = least recently used first
        self.sums = files.read_checksums(root)  # None: a version-1 checkpoint, read unverified

    def _read(self, c: int, names=None) -> dict[str, np.ndarray]:
        """Chunk ``c``'s files checked against their checksums, then read (CheckpointError
        naming the first bad file); ``names`` overrides the arrays read."""
        if self.sums is not None:
            files.verify_files(self.root, self.sums, files.chunk_name(c))
        return files.read_chunk(self.ckptr, os.path.join(self.root, files.chunk_name(c)), names or self.names)

    def get(self, c: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays (held for later calls; the least recently used is dropped)."""
        if c in self.held:
            self.held[c] = self.held.pop(c)
            return self.held[c]
        while len(self.held) >= self.keep:
            del self.held[next(iter(self.held))]
        self.held[c] = self._read(c)
        return self.held[c]

    def take(self, c: int, names=None) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays (``names`` instead of the default ones), not held (the caller
        owns them)."""
        out = None if names else self.held.pop(c, None)
        if out is None:
            out = self._read(c, names)
        return out


def _assemble_chunk(src: _SavedChunks, saved: dict, lay, c: int, names) -> dict[str, np.ndarray]:
    """New chunk ``c`` of ``lay``: ``{name: (lay.chunk_size,) numpy}`` for every saved array
    name, each leaf piece of the chunk copied from where the saved layout spec kept those
    elements of the leaf (one or several saved pieces); zero padding. Copies run in saved
    (chunk, offset) order, so each saved chunk is read once per new chunk."""
    saved_pieces = {s[0]: s[1] for s in saved["slots"]}
    copies = []  # (saved chunk, saved offset, new offset, elements)
    for i, p in lay.chunk_pieces(c):
        lo, hi = p.leaf_offset, p.leaf_offset + p.size
        for sc, so, slo, sn in saved_pieces[lay.slots[i].path]:
            a, b = max(lo, slo), min(hi, slo + sn)
            if a < b:
                copies.append((sc, so + a - slo, p.offset + a - lo, b - a))
    out: dict[str, np.ndarray] = {}
    for sc, so, no, n in sorted(copies):
        arrs = src.get(sc)
        for name in names:
            if name not in out:
                out[name] = np.zeros((lay.chunk_size,), arrs[name].dtype)
            out[name][no:no + n] = arrs[name][so:so + n]
    if not out:  # a chunk without leaf elements (not built by build_layout): zeros
        out = {n: np.zeros((lay.chunk_size,), np.float32) for n in names}
    return out


def export_params(step_fn, state=None):
    """The float32 master params as a plain params pytree.

    Args:
      step_fn: the engine (:class:`~chunkjax.checkpoint.protocol.ChunkIO`): the
        :class:`chunkjax.ChunkedStep` that owns ``state`` (its pending host updates are waited
        for first), or a drop-in optimizer.
      state: a :class:`chunkjax.TrainState` in any placement (on a mesh of one process); None
        for a drop-in optimizer.

    Returns:
      The pytree of ``step_fn.layout`` (the model's structure) with one float32 numpy array of
      the leaf's shape per leaf (frozen leaves: their params bit for bit, in their dtype).
      Built one chunk at a time: host memory holds the result (4 bytes
      per parameter) plus one (chunk_size,) float32 chunk; nothing is placed on the device.

    Raises:
      CheckpointError: ``step_fn`` is no ChunkIO engine. TypeError: ``state`` None for a step.
    """
    engine_info(step_fn, state)
    step_fn.wait(state)
    lay = step_fn.layout
    leaves: list = [None] * len(lay.slots)
    for c in range(lay.n_chunks):
        if not lay.chunk_pieces(c):
            continue
        m = step_fn.checkpoint_master(state, c)
        for i, p in lay.chunk_pieces(c):  # a frozen chunk's master is its params, in their own dtype
            if leaves[i] is None:
                leaves[i] = np.zeros((lay.slots[i].size,), np.asarray(m).dtype)
            leaves[i][p.leaf_offset:p.leaf_offset + p.size] = m[p.offset:p.offset + p.size]
        del m
    return lay.treedef.unflatten([x.reshape(s.shape) for x, s in zip(leaves, lay.slots)])


def export_checkpoint_params(directory, layout, step_number: int | None = None):
    """Like :func:`export_params`, read from a checkpoint instead of a live state (no step
    object, nothing placed on a device).

    Args:
      directory: the checkpoint root.
      layout: a :class:`~chunkjax.layout.ChunkLayout` of the checkpoint's parameter tree (same
        leaf paths, shapes and dtypes; its chunking may differ from the saved one).
      step_number: which step; None for :func:`latest_step`.

    Returns:
      The pytree of ``layout`` with one float32 numpy array of the leaf's shape per leaf, read
      one saved chunk at a time.

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: another parameter tree (the message names the first leaf that differs).
    """
    meta = files.read_meta(directory, step_number)
    diff = files.tree_difference(meta["layout"], files.layout_spec(layout))
    if diff is not None:
        raise CheckpointError(f"checkpoint step {meta['step']} holds another parameter tree: {diff}")
    root = files.step_dir(directory, meta["step"])
    index = {s.path: i for i, s in enumerate(layout.slots)}
    by_chunk: dict[int, list] = {}  # saved chunk -> (leaf index, offset, leaf offset, size)
    for path, pieces, _, _ in meta["layout"]["slots"]:
        for c, off, loff, n in pieces:
            by_chunk.setdefault(c, []).append((index[path], off, loff, n))
    ckptr = files.checkpointer()
    leaves: list = [None] * len(layout.slots)
    try:
        src = _SavedChunks(ckptr, root, ["master"], keep=1)
        trainable = meta["layout"].get("chunk_trainable", [True] * meta["layout"]["n_chunks"])
        for c in range(meta["layout"]["n_chunks"]):
            m = src.take(c)["master"] if trainable[c] else src.take(c, ["params"])["params"]  # frozen: own dtype
            for i, off, loff, n in by_chunk.get(c, ()):
                if leaves[i] is None:
                    leaves[i] = np.zeros((layout.slots[i].size,), m.dtype)
                leaves[i][loff:loff + n] = m[off:off + n]
            del m
    finally:
        ckptr.close()
    return layout.treedef.unflatten([x.reshape(s.shape) for x, s in zip(leaves, layout.slots)])

