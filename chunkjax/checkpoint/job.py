"""One checkpoint save, in the pieces every save uses (:class:`SaveJob`): the checks and the
engine's wait, the temporary directory, a chunk's portable arrays from the engine
(:meth:`~chunkjax.checkpoint.protocol.ChunkIO.checkpoint_chunk`), its write, and the finalize
(``meta.json``, ``checksums.json``, fsync, atomic rename); a failure removes the temporary
directory and becomes one :class:`CheckpointWriteError` line.

**Atomicity.** Everything is written into a hidden temporary directory
``<directory>/.tmp_step_<N:08d>_<pid>_<random>/`` which is renamed to ``step_<N:08d>`` only
after every chunk and ``meta.json`` are written and fsynced (POSIX rename is atomic within one
filesystem). A crash (SIGKILL, power loss after the fsync) during a save therefore leaves the
previous checkpoints usable and nothing that :func:`~chunkjax.checkpoint.latest_step` or
:func:`~chunkjax.checkpoint.restore_checkpoint` would pick up; a write error removes the
temporary directory before raising :class:`CheckpointWriteError`. Temporaries left by a killed
process are removed by the next save into the same directory (those of live processes are left
alone).
"""
from __future__ import annotations

import errno as _errno
import os
import shutil

import numpy as np

import chunkjax.checkpoint.files as files
from chunkjax.checkpoint.codec import encode
from chunkjax.checkpoint.protocol import ChunkIO, CheckpointError, CheckpointWriteError


_UNCHECKED = object()  # engine_info's state default: no state to check (a restore)


def engine_info(engine, state=_UNCHECKED) -> dict:
    """``engine.checkpoint_info()`` of an engine implementing
    :class:`~chunkjax.checkpoint.protocol.ChunkIO`, and when ``state`` is given, a check that it
    is there for an engine whose state is passed in.

    Raises:
      CheckpointError: ``engine`` does not implement the protocol.
      TypeError: ``state`` is None for an engine whose state is passed in (a step).
    """
    if not isinstance(engine, ChunkIO):
        raise CheckpointError(f"cannot checkpoint a {type(engine).__name__}: pass a chunkjax.ChunkedStep, "
                              "ChunkedOptimizer, NnxOptimizer or another chunkjax.checkpoint.ChunkIO")
    info = engine.checkpoint_info()
    if state is None and info.get("needs_state"):
        raise TypeError(f"a {type(engine).__name__} keeps no state of its own: pass the state it returned "
                        "(save_checkpoint(directory, n, step, state, extra))")
    return info


def chunk_nbytes(engine, c: int) -> int:
    """Bytes of chunk ``c``'s portable arrays (``engine.checkpoint_arrays(c)``), before reading them."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
               for shape, dt in engine.checkpoint_arrays(c).values())


def run_save(job: "SaveJob", source: str) -> str:
    """A synchronous save: every chunk snapshotted (no copies: host chunks' own buffers are
    written directly) and written, then finalized; on failure the partial write is removed and
    the error raised (:meth:`SaveJob.failed`). Returns the checkpoint's path."""
    stage = "creating the temporary directory"
    try:
        job.open()
        for c in range(job.n_chunks):
            stage = f"reading chunk {c} of {job.n_chunks} from {source}"
            arrays = job.snapshot(c, copy=False)
            stage = f"writing chunk {c} of {job.n_chunks}"
            job.write(c, arrays)
            del arrays
        stage = job.finalize()
    except BaseException as e:
        err = job.failed(e, getattr(job, "stage", None) or stage)
        if err is e:
            raise
        raise err from e
    finally:
        job.close()
    return job.final


def make_directory(directory: str) -> None:
    """Create the checkpoint ``directory`` (and its parents) if missing.

    Raises:
      CheckpointWriteError: ``directory`` (or a parent) is a regular file, or the filesystem
        refuses to create it (one line; nothing written).
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointWriteError(_errno.ENOTDIR, f"checkpoint directory {directory} is a file, not a directory: "
                                   "give a directory this process can write")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        why = "a parent is a file" if isinstance(e, (FileExistsError, NotADirectoryError)) else files.one_line(e)
        raise CheckpointWriteError(e.errno or _errno.EIO, f"checkpoint directory {directory} cannot be created ({why}): "
                                   "give a directory this process can write") from None


def _set_aside_broken(directory, step_number: int) -> bool:
    """Whether checkpoint ``step_number`` in ``directory`` is broken (incomplete: no ``meta.json``;
    or corrupt: :func:`~chunkjax.checkpoint.files.verify_checkpoint` fails) and was renamed to
    ``step_<N:08d>.broken`` (``.broken.1``, ... if taken; a name no listing or restore picks up), with
    a ``RuntimeWarning`` naming both. Nothing is deleted: the files stay for inspection. A
    restore that skipped the corrupt newest checkpoint (:func:`~chunkjax.checkpoint.latest_step`)
    resumes from an earlier step, and the run's next save of that step number would otherwise
    stop on the broken directory (a fresh user's resumed run, session 24). One process only: with
    several, a directory that exists is left alone (False). An intact checkpoint: False."""
    import warnings

    import jax
    final = files.step_dir(directory, step_number)
    if jax.process_count() > 1:
        return False
    try:
        files.verify_checkpoint(directory, step_number)
        return False  # intact: never replaced
    except FileNotFoundError:
        why = f"incomplete (no {files.META})"
    except CheckpointError as e:
        why = f"corrupt ({e})"
    aside, k = final + ".broken", 0
    while os.path.exists(aside):
        k += 1
        aside = f"{final}.broken.{k}"
    os.rename(final, aside)
    warnings.warn(f"checkpoint step {step_number} at {final} is {why}: moved to {aside} to save this step",
                  RuntimeWarning, stacklevel=3)
    return True


class SaveJob:
    """One save, in the pieces both :func:`save_checkpoint` and :func:`save_checkpoint_async`
    use: checks and the engine's ``wait(state)`` (constructor), ``open`` (temporary directory),
    ``snapshot`` (a chunk's portable arrays from the engine), ``write`` (one chunk to disk), ``finalize``
    (meta.json, fsync, rename) and ``failed`` (cleanup, the error to raise)."""

    def __init__(self, directory, step_number: int, engine, state, extra, writer: bool = True):
        step_number = int(step_number)
        if step_number < 0:
            raise ValueError(f"step_number must be >= 0, got {step_number}")
        self.directory = directory = os.fspath(directory)
        self.key = os.path.realpath(directory)
        self.step_number = step_number
        self.final = files.step_dir(directory, step_number)
        if os.path.exists(self.final) and not (writer and _set_aside_broken(directory, step_number)):
            raise FileExistsError(f"checkpoint step {step_number} already exists at {self.final}: "
                                  "delete it or save another step")
        self.extra_json = encode(dict(extra or {}))  # fail on bad extra before writing anything
        self.info = engine_info(engine, state)
        self.engine, self.state = engine, state
        self.n_chunks = engine.layout.n_chunks
        self.chunks_meta: list = [None] * self.n_chunks
        self.sums: dict[str, list[int]] = {}  # every written file's [size, crc32] (checksums.json)
        self.ckptr = None
        self.stage = None  # set by finalize (the writer's stage)
        engine.wait(state)  # a state whose pending work failed (a StorageError...) is refused before any directory exists
        if writer:  # under jax.distributed only process 0 touches the directory
            make_directory(directory)
            files.remove_stale_temporaries(directory)
        # entries read from the state once its pending work is done (a step: the speculation policy's input)
        self.state_meta = dict(engine.checkpoint_state_meta(state)) if hasattr(engine, "checkpoint_state_meta") else {}
        self.tmp = files.tmp_dir(directory, step_number)

    def open(self) -> None:
        os.makedirs(self.tmp)
        self.ckptr = files.checkpointer()

    def snapshot(self, c: int, copy: bool) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays in the portable form (its meta.json entry is kept). With
        ``copy`` every array is host memory of its own: nothing aliases the state, which the
        next step may update in place or donate."""
        arrays, self.chunks_meta[c] = self.engine.checkpoint_chunk(self.state, c, copy=copy)
        return arrays

    def write(self, c: int, arrays: dict[str, np.ndarray]) -> None:
        """Write chunk ``c`` and record its files' sizes and crc32 (read back while cached)."""
        files.write_chunk(self.ckptr, os.path.join(self.tmp, files.chunk_name(c)), arrays)
        self.sums.update(files.tree_checksums(self.tmp, files.chunk_name(c)))

    def finalize(self) -> str:
        """Write meta.json, fsync, rename the temporary into place; returns the last stage."""
        engine, lay = self.engine, self.engine.layout
        meta = {"format": files.FORMAT, "version": files.VERSION, "step": self.step_number,
                "compute_dtype": np.dtype(engine.compute_dtype).name,
                "layout": files.layout_spec(lay), "layout_fingerprint": files.layout_fingerprint(lay),
                "chunks": self.chunks_meta,
                "optimizer": self.info["optimizer"], "saved_from": self.info["saved_from"],
                "extra": self.extra_json, **self.info.get("meta", {}), **self.state_meta}
        self.stage = f"writing {files.META}"
        files.write_meta(os.path.join(self.tmp, files.META), meta)
        self.stage = f"writing {files.CHECKSUMS}"
        self.sums[files.META] = files.file_checksum(os.path.join(self.tmp, files.META))
        files.write_checksums(self.tmp, self.sums)
        self.stage = "syncing to disk"
        files.fsync_tree(self.tmp)
        self.stage = "renaming the temporary directory into place"
        os.rename(self.tmp, self.final)
        files.fsync_dir(self.directory)
        self.stage = None
        self.state = None  # the snapshot is on disk: do not keep the state alive
        return "done"

    def failed(self, e: BaseException, stage: str) -> BaseException:
        """Remove the temporary directory; the exception to raise for ``e`` (``e`` itself for
        interrupts, CheckpointError, TypeError and the engine's own errors (``passthrough`` of
        its ``checkpoint_info``, e.g. a storage worker's StorageError), else a one-line
        CheckpointWriteError)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.state = None
        if not isinstance(e, Exception) or isinstance(e, (CheckpointError, TypeError, CheckpointWriteError,
                                                           *self.info.get("passthrough", ()))):
            return e
        prev = files.latest_step(self.directory, verify=False)
        code = getattr(e, "errno", None)
        tag = f" [{_errno.errorcode.get(code, code)}]" if code else ""
        msg = (f"saving checkpoint step {self.step_number} to {self.directory} failed while {stage}{tag}: "
               f"{files.one_line(e)}; the partial write was removed" +
               (f" and the existing checkpoints are intact (latest: step {prev})" if prev is not None else ""))
        return CheckpointWriteError(code, msg) if code else CheckpointWriteError(msg)

    def close(self) -> None:
        if self.ckptr is not None:
            self.ckptr.close()
            self.ckptr = None

