"""What a checkpoint needs from an engine that holds chunked model data: :class:`ChunkIO`.

The checkpoint package (:mod:`chunkjax.checkpoint`) saves and restores chunks in one *portable*
form (per chunk ``c``: ``params`` ((chunk_size,) compute dtype), ``master`` ((chunk_size,)
float32) and one (chunk_size,) float32 array per optimizer moment, named by the optax field:
``mu``/``nu`` for Adam/AdamW, ``mu`` for Lion, ``trace`` for SGD with momentum; whole, unsharded
chunks). It knows no engine: every engine implements :class:`ChunkIO`, i.e. says which arrays its
chunks have, hands out chunk ``c`` of a state in the portable form, waits for its pending work and
builds a state from portable chunks for its own placement and topology. The engines:
:class:`chunkjax.ChunkedStep` (one device or a data mesh, one or many processes;
:mod:`chunkjax.step_checkpoint`), the front door's :class:`chunkjax.OffloadedStep` (its step's
chunks and its non-parameter state: :mod:`chunkjax.front_checkpoint`), the drop-in optimizers :class:`chunkjax.ChunkedOptimizer` and
:class:`chunkjax.NnxOptimizer` (:mod:`chunkjax.flax_api`), and the storage tier
(:class:`chunkjax.storage.chunk_io.StorageChunks` over a
:class:`~chunkjax.storage.near.NearStorageOptimizer`). The optax / host-state conversions they
share are :mod:`chunkjax.portable`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint cannot be restored into this engine (layout or optimizer mismatch, a missing or
    malformed checkpoint), or a state has no checkpoint form."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (full disk, I/O error, ...). The previous checkpoints are
    intact and the temporary directory of the failed save has been removed. ``errno`` is the
    underlying error's, when it had one; the message is the one line without OSError's
    ``[Errno N]`` prefix (it names the errno itself)."""

    def __str__(self) -> str:
        return self.strerror if self.errno is not None and self.strerror else super().__str__()


class SavedChunks(Protocol):
    """A checkpoint opened for restoring into one chunk layout (given to
    :meth:`ChunkIO.checkpoint_restore`; built by :func:`chunkjax.checkpoint.open_checkpoint`).

    Attributes:
      meta: the checkpoint's ``meta.json`` (dict).
      where: ``"checkpoint step N in <directory>"`` for messages.
    """

    meta: dict
    where: str

    def moments(self, c: int) -> list[str]:
        """The optimizer moment names chunk ``c`` will have (checked before anything is read)."""

    def verify(self) -> None:
        """Check every saved chunk's files against their crc32 before any is read (an engine that
        frees its own state before restoring calls it first). Raises CheckpointError naming the
        first bad file."""

    def chunk(self, c: int) -> tuple[dict[str, np.ndarray], dict]:
        """Chunk ``c`` in the portable form, in the engine's layout (remapped by leaf path when
        the saved layout differs): ``({"params": (chunk_size,) compute dtype, "master":
        (chunk_size,) float32, moment: (chunk_size,) float32, ...}, {"count": int | None,
        "rest": {moment: float}})``. Each file is checked against its crc32 before it is read.
        Raises CheckpointError naming a corrupt file."""


@runtime_checkable
class ChunkIO(Protocol):
    """An engine's chunked model data, as a checkpoint sees it.

    ``state`` is the engine's state object (:class:`chunkjax.TrainState` of a step); engines that
    keep their state themselves (the drop-in optimizers, the storage tier) take ``None``. An engine
    may also have ``checkpoint_state_meta(state) -> dict``: further top-level meta.json entries read
    from the state after :meth:`wait` (a step's speculation policy input:
    :meth:`chunkjax.step_checkpoint.StepChunkIO.checkpoint_state_meta`).

    Attributes:
      layout: the :class:`~chunkjax.layout.ChunkLayout` (chunk_size elements, n_chunks, slots).
      compute_dtype: dtype of the saved ``params`` arrays.
    """

    layout: Any
    compute_dtype: Any

    def wait(self, state) -> Any:
        """Block until the engine's pending work on ``state`` is done (host updates of a step)."""

    def checkpoint_info(self) -> dict:
        """What meta.json records about the engine: ``{"optimizer": str, "saved_from": dict
        (the engine kind and its rank count), "multiprocess": bool (a state spanning several
        processes: every process calls save/restore), "meta": dict (further top-level meta.json
        entries), "passthrough": tuple of exception types the engine raises itself (passed through
        unwrapped), "needs_state": bool (``state`` must not be None)}``; the last three optional."""

    def checkpoint_arrays(self, c: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: (shape, dtype)}`` of chunk ``c``'s portable arrays (without reading them)."""

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict[str, np.ndarray], dict]:
        """Chunk ``c`` in the portable form and its meta.json entry ``{"count": int | None,
        "moments": [names], "rest": {moment: float}, "saved_from": str}``. With ``copy`` no array
        aliases the state (the next step may update or donate it). Under ``jax.distributed`` a
        collective: every process calls it for the same chunks in the same order. Raises
        CheckpointError for a state without a per-chunk form."""

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s (chunk_size,) float32 master params as numpy (one process)."""

    def checkpoint_restore(self, saved: SavedChunks) -> Any:
        """A state built from ``saved``, chunk by chunk, in the engine's placement and topology
        (checking every chunk's moments before reading any array). Raises CheckpointError."""
