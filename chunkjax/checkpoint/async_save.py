"""Asynchronous saves: :func:`save_checkpoint_async` snapshots the state chunk by chunk in the
calling thread and one background thread writes (:class:`AsyncSave`), with the host memory held
bounded by ``max_inflight_bytes`` (back-pressure)."""
from __future__ import annotations

import collections
import logging
import os
import threading

from chunkjax.checkpoint.job import SaveJob, chunk_nbytes, engine_info
from chunkjax.checkpoint.protocol import CheckpointError


#: Default of :func:`save_checkpoint_async`'s ``max_inflight_bytes``: 1 GiB.
DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30


def save_checkpoint_async(directory, step_number: int, step_fn, state=None, extra: dict | None = None, *,
                          max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES) -> "AsyncSave":
    """Start saving checkpoint ``step_number`` in the background; training may go on as soon as
    this returns.

    The call waits for the step's host updates (``step_fn.wait(state)``), then snapshots the state
    chunk by chunk into host memory, in the calling thread: device chunks copied device -> host
    (ZeRO shards gathered), host-updated chunks copied with numpy (the next step updates them in
    place; device buffers are donated), ``extra`` encoded. Each snapshot is handed to one
    background writer thread, which writes it exactly as :func:`save_checkpoint` does (orbax
    PyTree per chunk) and drops it; after the last chunk the writer writes ``meta.json``, fsyncs
    and renames the temporary directory into place. The result is the same checkpoint, file for
    file, as :func:`save_checkpoint` of the same state would write.

    **Back-pressure.** The host memory held by the save counts each snapshot not yet written and,
    twice, the chunk being written (its snapshot and orbax's encoded copy). Before taking a
    snapshot the call blocks while one more chunk would exceed ``max_inflight_bytes`` (unless
    nothing is held), so the save holds at most ``max(max_inflight_bytes, 2 chunks)`` at all
    times (a chunk: ``params + master + moments`` bytes; :attr:`AsyncSave.peak_inflight_bytes`).
    With a bound of the state's size plus a chunk the call returns as soon as everything is
    snapshotted; with less than 3 chunks it returns once all but the last chunk have been
    written.

    **One save per directory.** Starting a save (this or :func:`save_checkpoint`) into a
    directory whose previous asynchronous save through the same ``step_fn`` is still running
    waits for that one first (the step object keeps track of its saves). Calls for one directory
    are expected from one thread and one step object.

    The writer is a non-daemon thread: a normal interpreter exit finishes the save first. A
    SIGKILL or crash during the background write leaves the previous checkpoints usable and a
    temporary directory that the next save into the directory removes (module docstring,
    *Atomicity*).

    Args:
      directory, step_number, step_fn, state, extra: as :func:`save_checkpoint`. ``state`` may be
        donated to / updated by the next training step as soon as the call returns.
      max_inflight_bytes: bound (bytes, int >= 0) on the host memory the save holds: snapshots
        not yet written plus orbax's copy of the chunk being written; at least two chunks are
        always allowed. Default 1 GiB.

    Returns:
      An :class:`AsyncSave`: ``.wait()`` (the path, or the write error), ``.done()``, ``.path``.

    Raises (in the call; nothing is left on disk then):
      ValueError: ``step_number`` < 0 or ``max_inflight_bytes`` < 0.
      FileExistsError, TypeError, CheckpointError: as :func:`save_checkpoint`, before anything is
        written or while reading the state.
      CheckpointWriteError: the temporary directory cannot be created, reading the state failed,
        or an earlier asynchronous save into ``directory`` failed and was never waited for
        (nothing new is saved then). Errors of the background write are raised by
        :meth:`AsyncSave.wait` (or, if it is never called, by the next save into the directory).
    """
    max_inflight_bytes = int(max_inflight_bytes)
    if max_inflight_bytes < 0:
        raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
    info = engine_info(step_fn, state)  # a ChunkIO engine (and its state), or one line
    previous_save(directory, step_fn)
    if info["multiprocess"]:
        raise CheckpointError("asynchronous saves of a state over several processes are not supported: use "
                              "save_checkpoint (every process calls it)")
    job = SaveJob(directory, step_number, step_fn, state, extra)
    try:
        job.open()
    except BaseException as e:
        job.close()
        err = job.failed(e, "creating the temporary directory")
        if err is e:
            raise
        raise err from e
    handle = AsyncSave(job, max_inflight_bytes)
    _async_saves(step_fn)[job.key] = handle
    handle._thread.start()
    stage = None
    try:
        for c in range(job.n_chunks):
            if not handle._reserve(chunk_nbytes(step_fn, c)):  # its bytes, before the snapshot
                return handle  # the writer failed: its error comes at wait()
            stage = f"reading chunk {c} of {job.n_chunks} from the state"
            arrays = job.snapshot(c, copy=True)
            nbytes = sum(a.nbytes for a in arrays.values())
            if not handle._put((c, arrays), nbytes):
                return handle
            del arrays
        stage = None
        job.state = None  # everything is snapshotted: the writer must not keep the state alive
        handle._put(_FINAL, 0)
    except BaseException as e:
        handle._abort()  # stop and join the writer before removing its temporary directory
        handle._reported = True
        err = job.failed(e, stage or "handing the chunks to the writer")
        if err is e:
            raise
        raise err from e
    return handle


_FINAL = object()  # the writer's last item: finalize


_log = logging.getLogger(__name__)


def _async_saves(step_fn) -> dict:
    """The step object's asynchronous saves still tracked: realpath of a checkpoint root -> its
    latest :class:`AsyncSave` (kept on the step the caller passes to every save: no module state)."""
    return vars(step_fn).setdefault("_checkpoint_async_saves", {})


def previous_save(directory, step_fn) -> None:
    """Wait for the asynchronous save into ``directory`` (through ``step_fn``) still running, if
    any; raise its CheckpointWriteError if it failed and nobody has seen it through ``wait()``."""
    saves = _async_saves(step_fn)
    key = os.path.realpath(os.fspath(directory))
    prev = saves.get(key)
    if prev is None:
        return
    prev._done.wait()
    if saves.get(key) is prev:
        del saves[key]
    if prev._error is not None and not prev._reported:
        prev._reported = True
        raise prev._error


class AsyncSave:
    """A checkpoint being written in the background, from :func:`save_checkpoint_async`.

    Attributes:
      path: the checkpoint directory it creates (``<directory>/step_<N:08d>``), once complete.
      step: its step number.
      peak_inflight_bytes: the most bytes held at once by this save (snapshots not yet written,
        the chunk being written counted twice); at most ``max(max_inflight_bytes, 2 chunks)``.
    """

    def __init__(self, job: "SaveJob", max_inflight_bytes: int):
        self._job = job
        self.path, self.step = job.final, job.step_number
        self.max_inflight_bytes = max_inflight_bytes
        self.peak_inflight_bytes = 0
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._reported = False
        self._stop = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chunkjax-checkpoint-{job.step_number}", daemon=False)

    def done(self) -> bool:
        """True once the background write has finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is complete (renamed into place and fsynced).

        Args:
          timeout: seconds to wait at most; None waits as long as it takes.

        Returns:
          :attr:`path`.

        Raises:
          CheckpointWriteError: the background write failed (e.g. ENOSPC): the previous
            checkpoints are intact and the temporary directory has been removed.
          TimeoutError: ``timeout`` passed first (the save goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} is still being written after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "writing"
        return f"AsyncSave(step={self.step}, path={self.path!r}, {state})"

    def _reserve(self, nbytes: int) -> bool:
        """Block, before a snapshot is taken, until ``nbytes`` more fit under the bound (or
        nothing is in flight). False if the writer has failed."""
        with self._cv:
            while (self._error is None and self._inflight > 0
                   and self._inflight + nbytes > self.max_inflight_bytes):
                self._cv.wait()
            return self._error is None

    def _put(self, item, nbytes: int) -> bool:
        """Hand ``item`` (a snapshot of ``nbytes``, reserved) to the writer. False if the writer
        has failed (the item is dropped)."""
        with self._cv:
            if self._error is not None:
                return False
            self._queue.append((item, nbytes))
            self._add(nbytes)
            self._cv.notify_all()
            return True

    def _add(self, nbytes: int) -> None:
        self._inflight += nbytes
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight)

    def _abort(self) -> None:
        """Stop the writer (after the chunk it is writing) and join it."""
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        job, stage = self._job, None
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    item, nbytes = self._queue.popleft()
                if item is _FINAL:
                    stage = job.finalize()
                    return
                c, arrays = item
                del item
                stage = f"writing chunk {c} of {job.n_chunks}"
                with self._cv:
                    self._add(nbytes)  # orbax's encoded copy while it writes (tensorstore)
                job.write(c, arrays)
                del arrays
                with self._cv:
                    self._inflight -= 2 * nbytes
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - kept for wait()
            err = job.failed(e, getattr(job, "stage", None) or stage)
            if err is not e:
                err.__cause__ = e
            _log.error("background checkpoint save failed: %s", err)
            with self._cv:
                self._error = err
                self._queue.clear()
                self._inflight = 0
                self._cv.notify_all()
        finally:
            job.close()
            self._done.set()

