"""A storage-tier optimizer restored from a checkpoint of either tier: :func:`restore_storage_checkpoint`
(Smart-Infinity section 4: the optimizer state on storage; the checkpoint format is
:mod:`chunkjax.checkpoint`'s)."""
from __future__ import annotations

import os

import numpy as np

from chunkjax.checkpoint import CheckpointError, SavedState, files
from chunkjax.storage.chunk_io import EF_RESIDUAL
from chunkjax.storage.files import read_manifest
from chunkjax.storage.near import NearStorageOptimizer


def restore_storage_checkpoint(directory, dirs, spec, layout, step_number: int | None = None, **opt_kwargs):
    """Restore a checkpoint onto storage: a new
    :class:`~chunkjax.storage.near.NearStorageOptimizer` over ``dirs`` whose chunk files hold the
    checkpoint's master params and AdamW moments, committed at the checkpoint's optimizer step.

    The checkpoint may come from a storage-tier run
    (:func:`chunkjax.checkpoint.save_storage_checkpoint`, any number of storage directories) or
    from memory (:func:`chunkjax.checkpoint.save_checkpoint` of a ``ChunkedStep``, any topology
    with AdamW, any placement). ``layout`` may chunk the same parameter tree differently (another
    chunk size): leaves are then moved by path as in :func:`chunkjax.checkpoint.restore_checkpoint`.
    Chunks are read, assembled and streamed to their worker one at a time (host memory: one
    chunk, two saved chunks plus the new one when remapping). With
    ``error_feedback=True`` the saved residuals are restored (zeros when the checkpoint has
    none, e.g. one saved from memory).

    Args:
      directory: the checkpoint root.
      dirs: the storage directories for the new optimizer (one per storage device); they must
        hold no committed run.
      spec: the :class:`chunkjax.host_update.AdamW` to continue with (learning-rate schedule,
        betas, weight decay, clipping); the step count comes from the checkpoint.
      layout: the :class:`~chunkjax.layout.ChunkLayout` the caller packs gradients with.
      step_number: which step; None for :func:`chunkjax.checkpoint.latest_step`.
      **opt_kwargs: further ``NearStorageOptimizer`` arguments (compression, topk_ratio,
        error_feedback, link_model, fsync, ...).

    Returns:
      ``(opt, extra)``: the optimizer (its ``committed_step`` is the saved optimizer step count)
      and the checkpoint's ``extra`` dict.

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: another parameter tree, an optimizer other than Adam/AdamW (moments other
        than ``mu``, ``nu``), chunks with different step counts, or ``dirs`` that already hold a
        committed run (restore into empty directories; nothing is written then).
      chunkjax.storage.StorageError: a worker failed (e.g. a full disk); no step is committed.
    """
    dirs = [os.fspath(d) for d in dirs]
    with SavedState(directory, layout, None, step_number, names=["master", "mu", "nu"]) as saved:
        where, meta = saved.where, saved.meta
        moments, count, _ = files.common_optimizer(meta, where, need_one_count=True)
        if sorted(moments) != ["mu", "nu"] or count is None:
            raise CheckpointError(f"{where} holds optimizer moments {sorted(moments)}: the storage tier runs AdamW "
                                  "(mu, nu); restore it into memory with restore_checkpoint instead")
        used = [d for d in dirs if read_manifest(d) is not None]
        if used:
            raise CheckpointError(f"{used} already hold a storage-tier run: restore into empty directories")
        residual = None
        if opt_kwargs.get("error_feedback") and opt_kwargs.get("compression") == "topk" and meta.get(EF_RESIDUAL):
            with SavedState(directory, layout, None, meta["step"], names=[EF_RESIDUAL]) as res:
                residual = {c: res.arrays(c)[EF_RESIDUAL] for c in range(layout.n_chunks)}

        def state_of(c):
            arrs = saved.arrays(c)
            return tuple(np.asarray(arrs[n], np.float32) for n in ("master", "mu", "nu"))

        opt = NearStorageOptimizer(dirs, [layout.chunk_size] * layout.n_chunks, spec, init_state=state_of,
                                   init_step=int(count), init_residual=residual, **opt_kwargs)
    return opt, saved.extra
