"""The storage tier's side of the checkpoint protocol: a
:class:`~chunkjax.storage.near.NearStorageOptimizer`'s chunks as a
:class:`chunkjax.checkpoint.protocol.ChunkIO` (:class:`StorageChunks`, saved by
:func:`chunkjax.checkpoint.save_storage_checkpoint`; Smart-Infinity section 4: the optimizer
state on storage). The format is the one of :mod:`chunkjax.checkpoint`, so a checkpoint moves
between disk and memory in both directions (:mod:`chunkjax.storage.restore` builds a new
storage-tier optimizer from one).
"""
from __future__ import annotations

import numpy as np

from chunkjax.checkpoint.protocol import CheckpointError
from chunkjax.storage.files import StorageError

#: Name of the optional per-chunk error-feedback residual array of a storage-tier checkpoint.
EF_RESIDUAL = "ef_residual"


class StorageChunks:
    """A storage-tier optimizer's chunks through the checkpoint protocol, at its committed step.

    Each chunk is read by the worker that owns it
    (:meth:`~chunkjax.storage.near.NearStorageOptimizer.read_chunk`): float32 master, AdamW
    ``mu``/``nu``, compute params = the master cast to ``compute_dtype`` (what the workers send
    back), and with top-k error feedback the chunk's residual ``ef_residual`` (trainer memory;
    zeros before the first step). The state argument of the protocol's methods is ignored (None).

    Args:
      opt: the :class:`~chunkjax.storage.near.NearStorageOptimizer` (no step in flight).
      layout: the :class:`~chunkjax.layout.ChunkLayout` whose ``pack`` made the optimizer's chunks.
      compute_dtype: dtype of the saved compute params.

    Raises:
      CheckpointError: the optimizer's chunks are not ``layout.n_chunks`` chunks of
        ``layout.chunk_size`` elements.
    """

    def __init__(self, opt, layout, compute_dtype):
        sizes = list(opt.chunk_sizes.values())
        if len(sizes) != layout.n_chunks or any(n != layout.chunk_size for n in sizes):
            raise CheckpointError(f"the optimizer's {len(sizes)} chunks of {sorted(set(sizes))} elements do not "
                                  f"match the layout's {layout.n_chunks} chunks of {layout.chunk_size}: pass the "
                                  "layout whose pack() made the optimizer's chunks")
        self.opt, self.layout, self.compute_dtype = opt, layout, np.dtype(compute_dtype)
        self.ef = bool(getattr(opt, "error_feedback", False)) and getattr(opt, "compression", None) == "topk"

    def wait(self, state=None) -> None:
        """Nothing to wait for: the optimizer's steps commit synchronously."""
        del state

    def checkpoint_info(self) -> dict:
        """AdamW spec, the storage directories, the residual flag; a worker's StorageError passes through."""
        return {"optimizer": repr(self.opt.spec), "multiprocess": False, "passthrough": (StorageError,),
                "saved_from": {"step": type(self.opt).__name__, "n_ranks": 1, "storage_dirs": len(self.opt.dirs)},
                "meta": {EF_RESIDUAL: True} if self.ef else {}}

    def checkpoint_arrays(self, c: int) -> dict:
        """params (compute dtype), master, mu, nu (and ef_residual) of (chunk_size,) elements."""
        n, f32 = (self.layout.chunk_size,), np.dtype(np.float32)
        names = ["master", "mu", "nu"] + ([EF_RESIDUAL] if self.ef else [])
        return {"params": (n, self.compute_dtype), **{k: (n, f32) for k in names}}

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        """Chunk ``c`` read by its worker (copies, whatever ``copy`` says) and its meta.json entry."""
        del state, copy
        opt = self.opt
        master, m, v = opt.read_chunk(c)
        arrays = {"params": master.astype(self.compute_dtype), "master": master, "mu": m, "nu": v}
        if self.ef and c in opt._residual:
            arrays[EF_RESIDUAL] = np.asarray(opt._residual[c], np.float32)
        elif self.ef:
            arrays[EF_RESIDUAL] = np.zeros_like(master)
        return arrays, {"count": opt.committed_step, "moments": ["mu", "nu"], "rest": {}, "saved_from": "storage"}

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s float32 master params, read by its worker."""
        del state
        return self.opt.read_chunk(c)[0]

    def checkpoint_restore(self, saved):
        """Refused: a storage-tier state is restored into a new optimizer."""
        raise CheckpointError(f"{saved.where}: a storage-tier optimizer is restored into new directories with "
                              "chunkjax.storage.restore.restore_storage_checkpoint")
