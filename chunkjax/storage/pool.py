"""The near-storage worker processes seen from the trainer: start, messages with deadlines, failure.

One worker process per storage directory (:mod:`chunkjax.storage.worker`) talks to the trainer
over a pipe. Every send and receive here has a deadline (``timeout_s``): a worker that dies, stops
answering or stops taking messages raises :class:`~chunkjax.storage.files.StorageError` with one
line naming it (index, pid, directory) and what it was doing, after every worker is stopped; the
line names the last step every directory committed, where a resume starts. Shared by
:class:`chunkjax.storage.near.NearStorageOptimizer` (the bench's optimizer and the step's
``storage`` update location, :mod:`chunkjax.storage.updater`).
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

from chunkjax.storage.files import StorageError, committed_step
from chunkjax.storage.worker import _worker_main


class WorkerPool:
    """The trainer's side of the workers (a mixin: the owner sets ``dirs``, ``timeout_s`` and
    calls :meth:`_start_workers`; ``_step`` is its last committed step)."""

    def _start_workers(self, cfgs: list[dict]) -> None:
        """Spawn one worker per config (:func:`chunkjax.storage.worker._worker_main`) and wait for
        each to be ready; ``io_mode`` collects their I/O modes."""
        self._broken = None
        # sends run on this thread, so that a send blocked on a stopped worker has a deadline too
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="near_storage_send")
        ctx = multiprocessing.get_context("spawn")
        self.workers, self._conns, self.io_mode = [], [], {}
        for i, cfg in enumerate(cfgs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, cfg), name=f"near_storage_{i}", daemon=True)
            p.start()
            child.close()
            self.workers.append(p)
            self._conns.append(parent)
        for i in range(len(cfgs)):
            self.io_mode.update(self._expect(i, "ready", "starting")[2])

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def _send(self, i: int, msg: tuple, doing: str, nbytes: int = 0) -> None:
        """Send ``msg`` to worker ``i`` within ``timeout_s`` (on the sender thread: a payload larger
        than the pipe's buffer blocks until the worker reads it). Raises StorageError (and stops
        every worker) when the worker dies or does not take the message in time."""
        conn, proc = self._conns[i], self.workers[i]
        fut = self._sender.submit(conn.send, msg)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fut.result(timeout=0.05)
                return
            except concurrent.futures.TimeoutError:
                pass
            except (OSError, EOFError, ValueError):  # BrokenPipeError: the worker is gone
                raise self._dead(i, doing) from None
            if not proc.is_alive():
                raise self._dead(i, doing)
            if time.monotonic() > deadline:
                size = f" ({nbytes} bytes)" if nbytes else ""
                raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) took no message within "
                                 f"{self.timeout_s} s while {doing}{size}: it is stopped or hung")

    def _expect(self, i: int, kind: str, doing: str):
        conn, proc = self._conns[i], self.workers[i]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if conn.poll(0.05):
                    msg = conn.recv()
                    break
            except (EOFError, OSError):
                msg = None
                break
            if not proc.is_alive() and not conn.poll(0):
                msg = None
                break
            if time.monotonic() > deadline:
                raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) gave no reply within "
                                 f"{self.timeout_s} s while {doing}")
        if msg is None:
            proc.join(1)
            raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) died (exit code "
                             f"{proc.exitcode}) while {doing}")
        if msg[0] == "error":
            raise StorageError(f"near-storage worker {i} ({self.dirs[i]}) failed while {doing}: {msg[1]}; "
                               f"last committed step {getattr(self, '_step', None)}")
        if msg[0] != kind:
            raise self._fail(f"near-storage worker {i} answered {msg[0]!r}, expected {kind!r} while {doing}")
        return msg

    def _dead(self, i: int, doing: str) -> StorageError:
        proc = self.workers[i]
        proc.join(1)
        return self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) died (exit code "
                          f"{proc.exitcode}) while {doing}")

    def _fail(self, why: str) -> StorageError:
        """Stop every worker and return the error; the step named is where a resume starts (read
        from the manifests once the workers are stopped: a worker may have died mid-commit)."""
        self._kill_all()
        if self._broken:
            return StorageError(self._broken)
        try:
            step = committed_step(self.dirs)
        except StorageError:
            step = getattr(self, "_step", None)
        self._broken = (f"{why}; every shard is at the last committed step {step}: open a new "
                        "NearStorageOptimizer on the same directories to resume")
        return StorageError(self._broken)

    def _kill_all(self):
        """Kill every worker (SIGKILL also ends a stopped one, which unblocks a send to it), then
        close the pipes and the sender thread."""
        for p in getattr(self, "workers", []):
            if p.is_alive():
                p.kill()
            p.join(5)
        if getattr(self, "_sender", None) is not None:
            self._sender.shutdown(wait=True)
        for conn in getattr(self, "_conns", []):
            conn.close()

    def _check_usable(self):
        if self._broken:
            raise StorageError(self._broken)

