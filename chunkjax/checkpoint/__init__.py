"""Checkpoints of chunked training: saved chunk by chunk, atomic, placement-independent, checked.

A service for every engine that holds chunked model data through one small protocol
(:class:`~chunkjax.checkpoint.protocol.ChunkIO`, implemented by :class:`chunkjax.ChunkedStep` on
one device or a ZeRO ``data`` mesh in one or many processes, by the front door's
:class:`chunkjax.OffloadedStep`, by the drop-in optimizers
:class:`chunkjax.ChunkedOptimizer` / :class:`chunkjax.NnxOptimizer`, and by the storage tier);
this package imports no engine. One concept per module:

* :mod:`~chunkjax.checkpoint.protocol`: the protocol and the two errors;
* :mod:`~chunkjax.checkpoint.files`: the directory (``step_<N:08d>/``: one orbax PyTree per
  chunk, ``meta.json``, ``checksums.json`` with every file's size and crc32), listing,
  temporaries, verification, the layout fingerprint;
* :mod:`~chunkjax.checkpoint.codec`: the ``extra`` dict as JSON (arrays, PRNG keys, tuples);
* :mod:`~chunkjax.checkpoint.job`: one save (temporary directory, per-chunk writes, atomic
  rename, the one-line write error);
* :mod:`~chunkjax.checkpoint.save`: :func:`save_checkpoint`, :func:`save_storage_checkpoint`;
* :mod:`~chunkjax.checkpoint.peers`: a save over several processes, every wait with a deadline;
* :mod:`~chunkjax.checkpoint.async_save`: :func:`save_checkpoint_async` (background writer,
  bounded host memory);
* :mod:`~chunkjax.checkpoint.restore`: :func:`restore_checkpoint` into any engine, layout,
  placement or device count (leaves remapped by path), :func:`export_params`.

**Restore anywhere.** The saved form is independent of placement, device count and chunking:
with the same chunk layout each chunk is read and placed as it was saved (a device chunk onto the
host and back, a ZeRO chunk onto one device or another rank count); with another layout every
leaf moves by its path from its saved (chunk, offset) to its new one, params, master params and
each moment alike. Another parameter tree or another optimizer is a one-line
:class:`CheckpointError`.

**Bounded host memory** (a "chunk" is one chunk's ``params + master + moments`` in bytes): saving
holds at most two chunks beyond the state (a chunk's host copy and orbax's encoded copy),
restoring at most two (four when remapping); an asynchronous save at most
``max(max_inflight_bytes, 2 chunks)``. Measured as peak RSS growth by
``tests/test_checkpoint_memory.py`` (1.5 GiB state, 256 MiB chunks: save 0.75-1.0 chunks,
asynchronous save with a one-chunk bound 1.8-2.2, restore 0.75-1.3 beyond the state); the C
allocator may keep up to about half a chunk more after a process's first save.

**Atomicity and integrity**: :mod:`~chunkjax.checkpoint.job` (temporary directory renamed into
place; a crash leaves the previous checkpoints usable) and :mod:`~chunkjax.checkpoint.files`
(checksums verified on every read; :func:`latest_step` skips a corrupt newest checkpoint with a
warning).

Usage::

    step = make_chunked_step(...)            # or make_chunked_step(..., mesh=data_mesh()) on 8 devices
    state = step.init(params)
    ...train...
    save_checkpoint(ckpt_dir, n, step, state, {"rng": key, "data_position": n, "config": cfg})
    # or, training on while it writes (host memory: at most max(256 MiB, two chunks)):
    pending = save_checkpoint_async(ckpt_dir, n, step, state, extra, max_inflight_bytes=256 << 20)
    ...train...
    pending.wait()                           # raises CheckpointWriteError if the write failed
    # later, in a fresh process, with another schedule, chunk size or device count:
    state, extra = restore_checkpoint(ckpt_dir, other_step)   # the latest_step(ckpt_dir)

    # the drop-in optimizers keep their own state:
    save_checkpoint(ckpt_dir, n, opt, extra={"rng": key})     # opt: NnxOptimizer / ChunkedOptimizer
    params, extra = restore_checkpoint(ckpt_dir, opt)         # nnx.update(model, params) for NNX
"""
from chunkjax.checkpoint.async_save import DEFAULT_MAX_INFLIGHT_BYTES, AsyncSave, save_checkpoint_async
from chunkjax.checkpoint.files import (CHECKSUMS, FORMAT, META, VERSION, all_steps, delete_checkpoint,
                                       latest_step, layout_fingerprint, layout_spec, read_meta,
                                       remove_stale_temporaries, verify_checkpoint)
from chunkjax.checkpoint.peers import DEFAULT_PEER_TIMEOUT_S
from chunkjax.checkpoint.protocol import CheckpointError, CheckpointWriteError, ChunkIO, SavedChunks
from chunkjax.checkpoint.restore import SavedState, export_checkpoint_params, export_params, restore_checkpoint
from chunkjax.checkpoint.save import prune_checkpoints, save_checkpoint, save_storage_checkpoint

__all__ = ["AsyncSave", "CHECKSUMS", "CheckpointError", "CheckpointWriteError", "ChunkIO", "DEFAULT_MAX_INFLIGHT_BYTES",
           "DEFAULT_PEER_TIMEOUT_S", "FORMAT", "META", "SavedChunks", "SavedState", "VERSION", "all_steps",
           "delete_checkpoint", "prune_checkpoints", "export_checkpoint_params", "export_params", "latest_step", "layout_fingerprint",
           "layout_spec", "read_meta", "remove_stale_temporaries", "restore_checkpoint", "save_checkpoint",
           "save_checkpoint_async", "save_storage_checkpoint", "verify_checkpoint"]
