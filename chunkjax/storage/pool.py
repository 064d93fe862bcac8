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
import sys
import time
import weakref

import ml_dtypes
import numpy as np

from chunkjax.storage.files import StorageError, committed_step
from chunkjax.storage.worker import BOOTSTRAP_EXIT_CODE, _worker_main, exit_if_spawned_import

BF16 = np.dtype(ml_dtypes.bfloat16)

#: An item of :meth:`chunkjax.storage.near.NearStorageOptimizer.finish`'s gradient pairs that ends
#: the step unwritten (the caller failed midway): every worker drops the step and stays at the
#: committed one.
SKIP_STEP = ("skip", None)

#: The resume advice of a failure seen through :class:`chunkjax.storage.near.NearStorageOptimizer`
#: itself (its owner may set ``resume_advice`` to its own API's: :mod:`chunkjax.storage.updater`).
OPTIMIZER_RESUME = "open a new NearStorageOptimizer on the same directories to resume from it"

#: A worker seen stopped (``T`` in ``/proc/PID/stat``: SIGSTOP, a debugger) at this many watch
#: polls in a row fails the step (one poll could fall between a job-control stop and its continue).
STOPPED_POLLS = 2


def _proc_state(pid: int) -> str:
    """The one-letter state of a process (``/proc/PID/stat``: ``R``, ``S``, ``T`` stopped, ...);
    ``"?"`` where ``/proc`` cannot say (not Linux, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _stop_dropped(workers: list, conns: list, sender) -> None:
    """Stop the workers of a pool collected (or left at interpreter exit) without ``close``: end
    their pipes (a worker then exits at its next receive, the committed state on storage), wait
    briefly, kill what is left. Runs on whatever thread collects the pool: never joins a thread."""
    for conn in conns:
        conn.close()
    for p in workers:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join(5)
    sender.shutdown(wait=False)


class WorkerPool:
    """The trainer's side of the workers (a mixin: the owner sets ``dirs``, ``timeout_s`` and
    calls :meth:`_start_workers`; ``_step`` is its last committed step). The messages of one step
    (:meth:`_send_grads`, :meth:`_collect`, :meth:`_stop_step`) also use the owner's
    ``chunk_sizes``, ``order``, ``shared_link`` and ``_payload``."""

    def _start_workers(self, cfgs: list[dict]) -> None:
        """Spawn one worker per config (:func:`chunkjax.storage.worker._worker_main`) and wait for
        each to be ready; ``io_mode`` collects their I/O modes. In a spawned process still
        importing the main script (no ``__main__`` guard) this exits quietly instead
        (:func:`chunkjax.storage.worker.exit_if_spawned_import`; the parent reports it)."""
        exit_if_spawned_import()
        self._broken = self._stop_reason = None
        self._stopped_polls: dict[int, int] = {}
        self._waiting: dict = {}  # worker -> what the trainer waits on it for (see watch())
        # sends run on this thread, so that a send blocked on a stopped worker has a deadline too
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="near_storage_send")
        ctx = multiprocessing.get_context("spawn")
        self.workers, self._conns, self.io_mode = [], [], {}
        # a pool dropped without close (its owner never closed it) stops its workers once collected
        self._dropped = weakref.finalize(self, _stop_dropped, self.workers, self._conns, self._sender)
        for i, cfg in enumerate(cfgs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, cfg), name=f"near_storage_{i}", daemon=True)
            p.start()
            child.close()
            self.workers.append(p)
            self._conns.append(parent)
        for i in range(len(cfgs)):
            self.io_mode.update(self._expect(i, "ready", "starting")[2])

    def watch(self, final: bool = False) -> str | None:
        """Polled by the thread that waits on this step (``HostWork.join``): a worker that died or
        is stopped (:data:`STOPPED_POLLS` polls in a row) makes the step fail now, not at the
        deadline (the step's own thread raises the :class:`StorageError`; this call only asks it
        to). ``final``: the waiter's deadline has passed: name what each worker still owes.

        Returns:
          one line naming the worker (index, pid, directory), its state and what it owes (the
          step's own error adds what to do), or None when nothing is wrong; with ``final``, None
          also when no worker owes the step anything (the deadline was missed elsewhere).
        """
        if not getattr(self, "workers", None) or self._broken:
            return None
        owing = [i for i in range(len(self.workers)) if i in self._waiting]
        if final and not owing:  # the deadline was missed elsewhere (the host chunks): no worker to name
            return None
        for i in owing or range(len(self.workers)):
            p = self.workers[i]
            doing = self._waiting.get(i, "waiting for the step")
            if not p.is_alive():
                why = f"near-storage worker {i} (pid {p.pid}, {self.dirs[i]}) died (exit code {p.exitcode}) while {doing}"
            elif _proc_state(p.pid) in ("T", "t"):
                self._stopped_polls[i] = self._stopped_polls.get(i, 0) + 1
                if self._stopped_polls[i] < STOPPED_POLLS and not final:
                    continue
                why = (f"near-storage worker {i} (pid {p.pid}, {self.dirs[i]}) is stopped (SIGSTOP or a debugger) "
                       f"while {doing}")
            else:
                self._stopped_polls.pop(i, None)
                if not final:
                    continue
                why = (f"near-storage worker {i} (pid {p.pid}, {self.dirs[i]}) has not answered while {doing} "
                       f"(process state {_proc_state(p.pid)})")
            self._stop_reason = why
            return why
        return None

    def stop(self, why: str) -> StorageError:
        """Kill every worker now (SIGKILL: a hung or stopped one too) and return the
        :class:`StorageError` whose one line names ``why``, the last step every directory committed
        and what to do (the owner's ``resume_advice``); every later call on the pool raises it.
        For an owner whose own wait on the workers' work has passed its deadline
        (:meth:`chunkjax.storage.updater.DiskState.close`)."""
        return self._fail(why)

    def _check_stop(self) -> None:
        """Fail here (the step's thread) when :meth:`watch` asked for it."""
        if self._stop_reason and not self._broken:
            raise self._fail(self._stop_reason)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def _send(self, i: int, msg: tuple, doing: str, nbytes: int = 0) -> None:
        """Send ``msg`` to worker ``i`` within ``timeout_s`` (on the sender thread: a payload larger
        than the pipe's buffer blocks until the worker reads it). Raises StorageError (and stops
        every worker) when the worker dies or does not take the message in time."""
        self._wait_sent(i, self._sender.submit(self._conns[i].send, msg), doing, nbytes)

    def _send_later(self, i: int, msg: tuple, doing: str) -> None:
        """Hand ``msg`` for worker ``i`` to the sender thread and return at once, after the send
        handed over before it has gone (one message in flight: the caller's next one is built
        while the worker takes this one). :meth:`_sent` waits for it. Raises as :meth:`_send`."""
        self._sent()
        self._in_flight = (i, self._sender.submit(self._conns[i].send, msg), doing)

    def _sent(self) -> None:
        """Wait for the message :meth:`_send_later` handed over (within ``timeout_s``)."""
        pending, self._in_flight = getattr(self, "_in_flight", None), None
        if pending is not None:
            self._wait_sent(*pending)

    def _wait_sent(self, i: int, fut, doing: str, nbytes: int = 0) -> None:
        proc = self.workers[i]
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
            self._check_stop()
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
            self._check_stop()
            if time.monotonic() > deadline:
                raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) gave no reply within "
                                 f"{self.timeout_s} s while {doing}")
        if msg is None:
            proc.join(1)
            if doing == "starting" and proc.exitcode == BOOTSTRAP_EXIT_CODE:
                self._kill_all()
                main = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
                raise StorageError(f"the near-storage workers are spawned processes that import {main} again, and "
                                   "its training code ran there: put the training code under "
                                   "if __name__ == \"__main__\": (docs/own_model.md)")
            raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) died (exit code "
                             f"{proc.exitcode}) while {doing}")
        if msg[0] == "error":
            raise self._worker_error(i, doing, msg[1])
        if msg[0] != kind:
            raise self._fail(f"near-storage worker {i} answered {msg[0]!r}, expected {kind!r} while {doing}")
        return msg

    def _worker_error(self, i: int, doing: str, text: str) -> StorageError:
        """The error a worker reported (``text``: its exception, e.g. a full disk while writing a
        chunk), in one line with what it was doing, the last committed step and what to do. The
        workers stay up (the caller aborts the step); the state stays at the committed step."""
        text = text.removeprefix("StorageError: ")
        line = f"near-storage worker {i} (pid {self.workers[i].pid}) failed" + (
            f" while {doing}: {text}" if " while " not in text else f": {text}")
        if "committed step" not in text:
            line += f" (last committed step {getattr(self, '_step', None)})"
        advice = getattr(self, "resume_advice", None)
        return StorageError(line + (f"; {advice}" if advice else ""))

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
        advice = getattr(self, "resume_advice", None) or OPTIMIZER_RESUME
        self._broken = f"{why}; the storage directories stay at the last committed step {step}: {advice}"
        return StorageError(self._broken)

    def _kill_all(self):
        """Kill every worker (SIGKILL also ends a stopped one, which unblocks a send to it), then
        close the pipes and the sender thread."""
        if getattr(self, "_dropped", None) is not None:
            self._dropped.detach()  # stopped here: nothing left for the collection
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

    def _send_grads(self, source, batched: dict, step: int, progress: dict) -> int:
        """Send each chunk's gradient to its worker, one message per chunk (host memory: one
        chunk's payload), on the sender thread while :meth:`_collect` takes the params back.
        ``source``: ``{c: gradient}`` (sent in :attr:`order`) or an iterable of ``(c, gradient)``
        pairs that may block until the caller has the next one (``progress["idle"]`` is then set:
        the wait is the caller's, not a worker's). ``progress`` says which worker a blocked send
        waits on. Returns the bytes sent."""
        sent, n = 0, len(self.dirs)
        pairs = ((c, source[c]) for c in self.order) if isinstance(source, (dict, list, tuple)) else iter(source)
        while True:
            progress.update(idle=True)
            item = next(pairs, None)
            progress.update(idle=False, at=time.monotonic())
            if item is None:
                break
            if item is SKIP_STEP:
                progress.update(skipped=True)
                for i in range(n):
                    self._conns[i].send(("skip", step))
                break
            c, g = item
            part, b = self._payload(c, g, batched.get(c))
            progress.update(worker=c % n, nbytes=b)
            with self.shared_link.transfer(b):
                self._conns[c % n].send(("grads", step, {c: part}))
            del part, g, item
            progress.update(worker=None, at=time.monotonic())
            sent += b
        return sent

    def _collect(self, step: int, on_param=None, sending=None, progress=None, on_params_in=None):
        """Receive every worker's updated params, streamed chunk by chunk as each is updated (the
        shared link carries them while the workers still read and write their state), then its
        "prepared"; ``on_param(c, bits)`` takes each chunk's bf16 bits instead of keeping them.
        ``sending``: the future of :meth:`_send_grads` (a failed or stalled send is a failure).
        ``on_params_in()`` is called once every chunk's params are back (the writes and the
        commit may still be under way).
        Returns ``(params, storage_bytes, received_bytes, failure)``; ``failure`` is the first
        :class:`StorageError` (a worker's error, death or silence past ``timeout_s``). The
        directories' bytes read and written go into ``progress["read"]`` / ``["written"]``."""
        from multiprocessing.connection import wait
        params: dict[int, np.ndarray] = {}
        storage: dict[str, int] = {}
        received, failure, n_in = 0, None, 0
        pending = {self._conns[i]: i for i in range(len(self.dirs))}
        deadline = time.monotonic() + self.timeout_s
        doing = f"updating and writing the chunks of step {step}"
        self._waiting = {i: doing for i in range(len(self.dirs))}
        while pending and not self._broken:
            ready = wait(list(pending), timeout=0.05)
            if self._stop_reason and failure is None:
                failure = self._fail(self._stop_reason)
                break
            if sending is not None and sending.done() and sending.exception() is not None and failure is None:
                e = sending.exception()
                i = progress.get("worker")
                if i is not None:
                    self.workers[i].join(0.5)  # a killed worker's pipe may break before it is reaped
                failure = (self._dead(i, f"taking the gradients of step {step}")
                           if i is not None and not self.workers[i].is_alive() else
                           self._fail(f"sending the gradients of step {step}"
                                      + ("" if i is None else f" to near-storage worker {i} ({self.dirs[i]})")
                                      + f" failed ({type(e).__name__}: {e})"))
            if not ready:
                for conn, i in list(pending.items()):
                    if not self.workers[i].is_alive() and not conn.poll(0):
                        failure = failure or self._dead(i, doing)
                if progress is not None:  # a sender waiting for the caller's gradients is no worker's delay
                    deadline = max(deadline, (time.monotonic() if progress.get("idle") else progress.get("at", 0.0))
                                   + self.timeout_s)
                if time.monotonic() > deadline:
                    i = next(iter(pending.values()))
                    if sending is not None and not sending.done() and progress.get("worker") is not None:
                        i = progress["worker"]
                        failure = failure or self._fail(
                            f"near-storage worker {i} (pid {self.workers[i].pid}, {self.dirs[i]}) took no message "
                            f"within {self.timeout_s} s while taking the gradients of step {step} "
                            f"({progress['nbytes']} bytes)")
                    failure = failure or self._fail(f"near-storage worker {i} (pid {self.workers[i].pid}, "
                                                    f"{self.dirs[i]}) gave no reply within {self.timeout_s} s "
                                                    f"while {doing}")
                continue
            for conn in ready:
                i = pending.get(conn)
                if i is None:
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    failure = failure or self._dead(i, doing)
                    break
                if msg[0] == "param":
                    with self.shared_link.transfer(msg[2].nbytes):
                        if on_param is not None:
                            on_param(msg[1], msg[2])
                        else:
                            params[msg[1]] = msg[2].view(BF16) if msg[2].dtype == np.uint16 else msg[2]
                    received += msg[2].nbytes
                    deadline = time.monotonic() + self.timeout_s
                    n_in += 1
                    if n_in == len(self.chunk_sizes) and on_params_in is not None:
                        on_params_in()
                elif msg[0] == "prepared":
                    storage.update({d: msg[2][d] + msg[3][d] for d in msg[2]})
                    if progress is not None:
                        progress["ahead"] = progress.get("ahead", 0) + msg[4]
                        progress.setdefault("read", {}).update(msg[2])
                        progress.setdefault("written", {}).update(msg[3])
                    del pending[conn]
                    self._waiting.pop(i, None)
                elif msg[0] in ("skipped", "aborted") and progress is not None and progress.get("skipped"):
                    progress.setdefault("stopped", set()).add(i)
                    del pending[conn]
                elif msg[0] == "error":
                    failure = failure or self._worker_error(i, doing, msg[1])
                    del pending[conn]
                else:
                    failure = failure or self._fail(f"near-storage worker {i} answered {msg[0]!r}, "
                                                    f"expected 'param' or 'prepared' while {doing}")
        self._waiting = {}
        return params, storage, received, failure

    def _stop_step(self, step: int, kind: str) -> None:
        """Send ``kind`` ("skip" or "abort") of ``step`` to every worker and take each one's answer
        (params and "prepared" of a worker that finished first are dropped)."""
        for i in range(len(self.dirs)):
            self._send(i, (kind, step), f"ending step {step} unwritten")
        for i in range(len(self.dirs)):
            while True:
                msg = self._expect_any(i, f"ending step {step} unwritten")
                if msg[0] in ("skipped", "aborted"):
                    break

    def _expect_any(self, i: int, doing: str):
        conn, proc = self._conns[i], self.workers[i]
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(0.05):
            if not proc.is_alive() and not conn.poll(0):
                raise self._dead(i, doing)
            self._check_stop()
            if time.monotonic() > deadline:
                raise self._fail(f"near-storage worker {i} (pid {proc.pid}, {self.dirs[i]}) gave no reply within "
                                 f"{self.timeout_s} s while {doing}")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            raise self._dead(i, doing) from None
        if msg[0] == "error":
            raise self._worker_error(i, doing, msg[1])
        return msg
