"""Synchronous saves: :func:`save_checkpoint` of any engine implementing
:class:`~chunkjax.checkpoint.protocol.ChunkIO` (one process or, for a step over several
processes, every process calling it) and :func:`save_storage_checkpoint` of the storage tier."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from chunkjax.checkpoint.async_save import previous_save
import chunkjax.checkpoint.files as files
from chunkjax.checkpoint.job import SaveJob, engine_info, run_save
from chunkjax.checkpoint.peers import save_multiprocess


def save_checkpoint(directory, step_number: int, step_fn, state=None, extra: dict | None = None, *,
                    peer_timeout_s: float | None = None, keep: int | None = None) -> str:
    """Save the whole training state of ``step_fn`` as checkpoint ``step_number``, atomically.

    Waits for the engine's pending work (``step_fn.wait(state)``: a step's host updates), then
    writes chunk by chunk (:meth:`~chunkjax.checkpoint.protocol.ChunkIO.checkpoint_chunk`): each
    chunk's compute params ((chunk_size,) ``step_fn.compute_dtype``), float32 master
    params and float32 optimizer moments, plus the step count of its optimizer; then
    ``meta.json`` with the layout and ``extra``. ZeRO chunks are written whole: the rank shards
    of params, master params and moments are gathered into (chunk_size,) arrays (rank order).
    Host memory beyond the state itself: at most two chunks' params, master and moments (about
    ``2 * chunk_size * (2 + 4 + 8)`` bytes for bf16 AdamW: a device chunk's host copy and orbax's
    encoded copy while it writes; one chunk for host-updated chunks). Every file's size and zlib
    crc32 go to ``checksums.json`` (read back while cached: a few percent of the save). If a
    :func:`save_checkpoint_async` into the same directory through the same ``step_fn`` is still
    running, it is waited for first. See :func:`save_checkpoint_async` for a save that lets
    training continue while it writes.

    Args:
      directory: the checkpoint root (created if missing).
      step_number: the training step (int >= 0); the checkpoint goes to ``step_<N:08d>``.
      step_fn: the engine (:class:`~chunkjax.checkpoint.protocol.ChunkIO`): the
        :class:`chunkjax.ChunkedStep` that owns ``state``, or a drop-in optimizer
        (:class:`chunkjax.ChunkedOptimizer`, :class:`chunkjax.NnxOptimizer`: its master params,
        optax state per chunk and step count).
      state: the step's :class:`chunkjax.TrainState` (any placement, topology and ZeRO stage; it
        stays usable); None for an engine that keeps its own state (the drop-in optimizers).
      extra: a JSON-like dict saved with the state (RNG keys, data position, configuration):
        numbers, strings, None, lists, tuples, dicts with string keys, numpy or jax arrays and
        typed PRNG key arrays (``jax.random.key``).
      peer_timeout_s: under ``jax.distributed`` only: seconds each process waits at most for the
        others before each chunk's gather and before the outcome (None:
        :data:`DEFAULT_PEER_TIMEOUT_S`, or 60 s plus 1 s per 100 MiB of chunk if larger).
      keep: once the save is complete, delete all but the newest ``keep`` checkpoints of
        ``directory`` (:func:`chunkjax.checkpoint.prune_checkpoints`; orbax's ``max_to_keep``);
        None (the default) keeps every one.

    Returns:
      The path of the new checkpoint directory.

    Raises:
      FileExistsError: a checkpoint of ``step_number`` already exists.
      ValueError: ``keep`` is not None or an int >= 1 (before anything is written).
      TypeError: ``extra`` holds something that cannot be saved, or ``state`` is None for a step.
      CheckpointError: the optimizer state has no per-chunk form (not elementwise), the ranks of
        a ZeRO chunk hold different step counts, or ``step_fn`` is no ChunkIO engine.
      CheckpointWriteError: writing failed (e.g. ENOSPC); the previous checkpoints are intact and
        the partial write has been removed. Under ``jax.distributed``: a peer process was lost
        (killed, or silent past ``peer_timeout_s``); the one line names it, the writer has
        removed its temporary directory. Also the unreported failure of an earlier
        :func:`save_checkpoint_async` into ``directory`` whose :meth:`AsyncSave.wait` was never
        called (nothing new is saved then).
    """
    if keep is not None:
        check_keep(keep)
    info = engine_info(step_fn, state)  # a ChunkIO engine (and its state), or one line
    previous_save(directory, step_fn)
    if info["multiprocess"]:
        path = save_multiprocess(directory, step_number, step_fn, state, extra, peer_timeout_s)
    else:
        path = run_save(SaveJob(directory, step_number, step_fn, state, extra), "the state")
    if keep is not None and jax.process_index() == 0:  # the writer's directory (under jax.distributed: process 0)
        prune_checkpoints(directory, keep)
    return path


def save_storage_checkpoint(directory, step_number: int, opt, layout, extra: dict | None = None, *,
                            compute_dtype=jnp.bfloat16) -> str:
    """Save the state of a storage-tier optimizer (optimizer state on disk, Smart-Infinity
    section 4) as a chunkjax checkpoint, chunk by chunk and atomically, in the same format as
    :func:`save_checkpoint` (so :func:`~chunkjax.checkpoint.restore_checkpoint` can bring it into
    memory, any placement, device count or chunk size, and
    :func:`chunkjax.storage.restore.restore_storage_checkpoint` back onto storage): the
    :func:`save_checkpoint` of ``opt.chunk_io(layout, compute_dtype)``
    (:class:`chunkjax.storage.chunk_io.StorageChunks`).

    Each chunk's float32 master, AdamW ``mu`` and ``nu`` at the committed step are read by the
    worker that owns the chunk (:meth:`~chunkjax.storage.near.NearStorageOptimizer.read_chunk`),
    so host memory holds one chunk (``12 * chunk_size`` bytes plus its compute params) at a time;
    with error feedback the chunk's residual (trainer memory) is saved with it as
    ``ef_residual``. The optimizer step count is the committed step. Atomicity, the temporary
    directory and the errors are those of :func:`save_checkpoint`.

    Args:
      directory: the checkpoint root (created if missing).
      step_number: the training step (int >= 0), usually ``opt.committed_step``.
      opt: a :class:`chunkjax.storage.near.NearStorageOptimizer` (AdamW) with no step in flight.
      layout: the :class:`~chunkjax.layout.ChunkLayout` whose ``pack`` made the optimizer's
        chunks: ``layout.n_chunks`` chunks of ``layout.chunk_size`` elements.
      extra: as in :func:`save_checkpoint` (data position, RNG keys, configuration).
      compute_dtype: dtype of the saved compute params (the master cast), default bfloat16.

    Returns:
      The path of the new checkpoint directory.

    Raises:
      CheckpointError: the optimizer's chunks do not match ``layout``.
      FileExistsError, TypeError, CheckpointWriteError: as :func:`save_checkpoint`.
      chunkjax.storage.StorageError: a worker is dead or failed to read a chunk (nothing is
        left behind: the partial write is removed first).
    """
    return run_save(SaveJob(directory, step_number, opt.chunk_io(layout, compute_dtype), None, extra), "storage")


def prune_checkpoints(directory, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints of ``directory`` (each through
    :func:`~chunkjax.checkpoint.files.delete_checkpoint`: a crash mid-delete leaves nothing that looks complete and no
    orphan); the retention of orbax's ``CheckpointManager(max_to_keep=...)``. Returns the deleted
    steps, oldest first.

    Raises:
      ValueError: ``keep`` is not an int >= 1.
    """
    check_keep(keep)
    gone = files.all_steps(directory)[:-keep]
    for s in gone:
        files.delete_checkpoint(directory, s)
    return gone


def check_keep(keep) -> None:
    """``keep`` (checkpoints kept) is an int >= 1, else one-line ValueError."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (the newest checkpoints kept) or None (keep all), got {keep!r}")
