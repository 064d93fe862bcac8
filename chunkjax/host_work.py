"""The host thread's pending work of one step (:class:`HostWork`): the host chunks it updates in
place while the device runs the rest of the backward, and when each of them is *final*.

A step's host work runs on one daemon thread of its own. Gradients are handed over per program
(:meth:`HostWork.hand_over`) and updated one chunk at a time; the speculation's validation
(:meth:`HostWork.validate`), the streamed chunks' write-backs and the storage workers' results
come after them (:meth:`HostWork.submit`, in submission order).

Cross-step overlap (``ChunkedStep(cross_step=True)``, :mod:`chunkjax.cross_step`): the next
step does not join this work when it starts. Before dispatching a program it waits only for the
host chunks that program takes (:meth:`HostWork.wait_chunks`): a chunk is final once its update
ran with the right factor, or once the validation has kept or redone it when it was updated
speculatively (:mod:`chunkjax.speculate`). For that to pay, the thread takes, among the chunks
whose gradient is there, the one the *next* step takes first (``need``), not the oldest; the
gradient window (:meth:`HostWork.hand_over`) then bounds how many chunk updates are pending, not
which, so the chunks left when the backward ends are those the next forward reads last; the
validation runs as soon as the global norm is known. Nothing is stale: the next step reads every
chunk after its final update, as if it had joined the whole step.

PatrickStar (arXiv 2108.05818) section 5 (the CPU update of chunks overlapping the GPU's
work); SuperOffload (ASPLOS'26), "speculation-then-validation" of the CPU optimizer step (a
speculated chunk is final only after its validation).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import math
import sys
import threading
import time

import jax

from chunkjax.cost import GRAD_WINDOW_PROGRAMS

#: The host thread's deadline is at least this many seconds ...
HOST_DEADLINE_MIN_S = 300.0
#: ... and at least this many predicted step times (a host update waits for its gradients, so a
#: slow device step delays it too).
HOST_DEADLINE_STEPS = 50.0

_MSG_HOST_DEADLINE = ("the host-update thread did not finish {what} within {deadline:.3g} s ({done} of {n} batches "
                      "of chunk updates done): the host is stalled or far slower than planned; the state "
                      "after the last completed step is in the last checkpoint (resume from it)")


#: seconds between the watch polls of :meth:`HostWork.join` (only while it has watches)
WATCH_POLL_S = 0.5
#: seconds :meth:`HostWork.join` waits for the failing work to raise its own error once a watch
#: has named a failure (else it raises the watch's line)
WATCH_GRACE_S = 10.0


class HostDeadlineError(TimeoutError):
    """The host-update thread missed its deadline (:data:`HOST_DEADLINE_MIN_S`)."""


def host_deadline_s(predicted_step_s: float | None) -> float:
    """The host thread's deadline for one step's updates (seconds): the larger of
    :data:`HOST_DEADLINE_MIN_S` and :data:`HOST_DEADLINE_STEPS` predicted step times."""
    return max(HOST_DEADLINE_MIN_S, HOST_DEADLINE_STEPS * float(predicted_step_s or 0.0))


def _ready(g) -> bool:
    """Whether a handed-over gradient (a ``jax.Array``, a Future of ``(gradient, sq)`` or numpy) is there."""
    if isinstance(g, concurrent.futures.Future):
        return g.done()
    if isinstance(g, jax.Array):
        return g.is_ready()
    return True


class _Item:
    __slots__ = ("seq", "chunk", "priority", "grad", "fut", "fn", "args", "jump")

    def __init__(self, seq, chunk, priority, grad, fut, fn, args, jump=None):
        self.seq, self.chunk, self.priority, self.grad = seq, chunk, priority, grad
        self.fut, self.fn, self.args, self.jump = fut, fn, args, jump


class _Queue:
    """The thread's queue: generic items in submission order; the chunk items before the first
    generic one taken in order, or by priority among the ready ones when ``ordered`` (the oldest
    when none is ready); a generic item with ``jump`` goes before them once ``jump()`` holds.
    Holds no reference to the :class:`HostWork` (an abandoned work's thread keeps nothing of its
    step alive)."""

    def __init__(self, ordered: bool):
        self.cv = threading.Condition()
        self.items: list[_Item] = []
        self.ordered = ordered
        self.stop = False

    def put(self, item: _Item) -> None:
        with self.cv:
            self.items.append(item)
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify()

    def abandon(self, error: BaseException) -> None:
        """Stop taking work (a join past its deadline): the items not started fail with
        ``error`` and are dropped; the thread ends once the item it runs, if any, returns."""
        with self.cv:
            items, self.items = self.items, []
            self.stop = True
            self.cv.notify()
        for it in items:
            if it.fut.set_running_or_notify_cancel():
                it.fut.set_exception(error)

    def take(self) -> _Item | None:
        with self.cv:
            while not self.items and not self.stop:
                self.cv.wait()
            if not self.items:
                return None
            pick = self.items[0]
            if pick.chunk is not None:
                run = list(itertools.takewhile(lambda it: it.chunk is not None, self.items))
                after = self.items[len(run)] if len(run) < len(self.items) else None
                if after is not None and after.jump is not None and after.jump():
                    pick = after
                elif self.ordered:
                    ready = [it for it in run if _ready(it.grad)]
                    if ready:
                        pick = min(ready, key=lambda it: (it.priority, it.seq))
            self.items.remove(pick)
            pick.grad = None
            return pick

    def serve(self) -> None:
        while True:
            item = self.take()
            if item is None:
                return
            fut, fn, args = item.fut, item.fn, item.args
            item.fn = item.args = None
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # handed to join() and to the chunk's final
                    fut.set_exception(e)
            fut = fn = args = None


class HostWork:
    """The host thread's pending work of one step: the chunks it updates in place while the
    device runs the rest of the backward. Carried in the returned state (``TrainState.pending``);
    :meth:`join` (``step.wait(state)``, or the next step) waits for it and returns the seconds the
    thread spent in the kernels; with cross-step overlap the next step waits per chunk first
    (:meth:`wait_chunks`).

    The work runs on one daemon thread, so a stalled update can neither hang the caller past
    ``deadline_s`` nor keep the process alive at exit; :meth:`join` ends and joins it (and the
    backup pool's copy threads), and work nobody joined is finished at exit, within its
    ``deadline_s`` (:func:`join_at_exit`). Chunk updates run in the order they are
    handed over, or with ``need`` by priority among those whose gradient is there: the chunk the
    next step reads first goes first (module docstring); the others wait, within the gradient
    window's bound (:meth:`hand_over`).

    Registered as a pytree node without leaves (it is not array data: ``jax.tree`` functions
    over a state pass it through unchanged).

    Args:
      deadline_s: seconds :meth:`join` (and each :meth:`wait_chunks`) waits at most (None: forever).
      backups: the :class:`chunkjax.speculate.BackupPool` of speculative host updates, handed on
        from step to step (None: none yet).
      window: the gradient window (``Schedule.grad_window``, >= 1 programs): :meth:`hand_over`
        lets at most this many programs' host gradients exist at once.
      need: ``{chunk: the next step's first program taking it}`` (cross-step overlap,
        :func:`chunkjax.cross_step.host_need`; chunks not listed go last); None: arrival order.

    Attributes:
      speculation: the step's :class:`chunkjax.speculate.Speculation` (None without host chunks):
        after :meth:`join`, its ``speculated`` and ``redone`` chunk counts.
      order_log: chunk ids in the order the thread started their updates (tests, profiles).

    Raises:
      ValueError: ``window`` < 1.
    """

    def __init__(self, deadline_s: float | None = None, backups=None, window: int = GRAD_WINDOW_PROGRAMS,
                 need: dict | None = None):
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 program, got {window}")
        self.window = int(window)
        self.need = need
        self._queue: _Queue | None = None
        self._seq = itertools.count()
        self._futures: list = []
        self._handoffs: list[int] = []  # chunks per hand-off
        self._alive = 0  # chunk updates handed over and not done (their gradients exist)
        self._cv = threading.Condition()
        self._final: dict[int, concurrent.futures.Future] = {}
        self._held: set[int] = set()  # chunks updated speculatively: final after the validation
        self._waking = None  # the speculation's stalled future whose end wakes hand_over's wait
        self.deadline_s = deadline_s
        self.seconds: float | None = None
        self.backups = backups
        self.speculation = None
        self.order_log: list[int] = []
        self._watches: list = []
        self._thread: threading.Thread | None = None

    def watch(self, fn) -> None:
        """Poll ``fn(final: bool) -> str | None`` every :data:`WATCH_POLL_S` while :meth:`join`
        waits: a line it returns names a failure of what the work waits on (a near-storage worker
        that died or is stopped: :meth:`chunkjax.storage.pool.WorkerPool.watch`); the work's own
        error is then raised at once instead of at the deadline. At the deadline it is called with
        ``final=True`` and its line joins the :class:`HostDeadlineError`'s."""
        self._watches.append(fn)

    def _watched(self, final: bool) -> str | None:
        for fn in self._watches:
            line = fn(final)
            if line:
                return line
        return None

    def _wait_one(self, f, end, done: int) -> None:
        """Wait for future ``f`` until ``end`` (monotonic s; None: forever), polling the watches.

        Raises:
          HostDeadlineError: ``f`` not done by ``end``, or a watch named a failure and ``f`` did not
            end within :data:`WATCH_GRACE_S` (one line)."""
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            poll = left if not self._watches else WATCH_POLL_S if left is None else min(left, WATCH_POLL_S)
            concurrent.futures.wait([f], timeout=poll)
            if f.done():
                return
            final = left is not None and left <= poll
            line = self._watched(final=final) if self._watches else None
            if line and not final:  # the work raises its own error now
                concurrent.futures.wait([f], timeout=WATCH_GRACE_S)
                if f.done():
                    return
                raise HostDeadlineError(f"{line}; the step's host updates wait on it") from None
            if final:
                raise HostDeadlineError(_MSG_HOST_DEADLINE.format(
                    what="this step's host updates", deadline=self.deadline_s, done=done,
                    n=len(self._futures)) + (f"; {line}" if line else "")) from None

    def _put(self, chunk, grad, fn, args, jump=None) -> concurrent.futures.Future:
        if self._queue is None:
            self._queue = _Queue(self.need is not None)
            self._thread = _start(self._queue, self.deadline_s)
        fut = concurrent.futures.Future()
        self._futures.append(fut)
        prio = math.inf if self.need is None or chunk is None else self.need.get(chunk, math.inf)
        self._queue.put(_Item(next(self._seq), chunk, prio, grad, fut, fn, args, jump))
        return fut

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args) -> seconds`` on this step's host thread after everything submitted
        before it; returns its future."""
        return self._put(None, None, fn, args)

    def validate(self, fn, *args, ready=None) -> concurrent.futures.Future:
        """:meth:`submit` the speculation's validation ``fn(*args)`` after every hand-over; with
        ``need``, it runs before the chunk updates still queued as soon as ``ready()`` holds (the
        global norm is known: the updates after it use the right factor). Once it ends, every
        chunk handed over is final, or failed with its error."""
        fut = self._put(None, None, fn, args, ready if self.need is not None else None)
        held, final = self._held, self._final

        def settle(f):  # the chunks the speculation kept: final now (the others were at their update)
            e = f.exception()
            for c in list(held):
                if not final[c].done():
                    final[c].set_exception(e) if e is not None else final[c].set_result(None)
        fut.add_done_callback(settle)
        return fut

    def _done_one(self, _) -> None:
        with self._cv:
            self._alive -= 1
            self._cv.notify_all()

    def _notify(self, _=None) -> None:
        with self._cv:
            self._cv.notify_all()

    def hand_over(self, fn, *args) -> None:
        """Hand one program's host gradients over: ``fn(state, {c: gradient})`` (``args`` is
        ``(state, grads)``) runs once per chunk on the host thread; then wait until no more chunk
        updates are pending than the ``window - 1`` latest hand-offs hold: the caller dispatches
        the next program only then, so at most the host gradients of ``window`` programs exist
        at once (the gradient working set, :func:`chunkjax.predict.grad_window_bytes`; the
        device's stall it causes: :func:`chunkjax.cost.program_timeline`), whichever chunks
        they are. The wait ends early when the step's speculation has stalled for the global
        norm (its bound is full or its policy waits: the norm comes only after the last program)
        or after ``deadline_s`` (:meth:`join` then raises). A chunk is final
        (:meth:`wait_chunks`) once its update ran, unless the speculation kept it for its
        validation (:meth:`validate`)."""
        state, grads = args
        spec = self.speculation
        n = len(grads)
        with self._cv:
            self._alive += n
        for c in list(grads):
            fin = self._final.setdefault(c, concurrent.futures.Future())
            g = grads.pop(c)
            self._put(c, g, self._one_chunk, (fn, state, c, [g], fin, spec, self.order_log, self._held)).add_done_callback(
                self._done_one)
        g = grads = None
        self._handoffs.append(n)
        keep = sum(self._handoffs[max(0, len(self._handoffs) - self.window + 1):]) if self.window > 1 else 0
        stalled = getattr(spec, "stalled", None)
        if stalled is not None and self._waking is not stalled:
            self._waking = stalled
            stalled.add_done_callback(self._notify)
        with self._cv:
            self._cv.wait_for(lambda: self._alive <= keep or (stalled is not None and stalled.done()),
                              timeout=self.deadline_s)

    @staticmethod
    def _one_chunk(fn, state, c, box, fin, spec, log, held) -> float:
        log.append(c)
        try:
            out = fn(state, {c: box.pop()})
        except BaseException as e:
            if not fin.done():
                fin.set_exception(e)
            raise
        if spec is not None and spec.holds(c):
            held.add(c)
        elif not fin.done():
            fin.set_result(None)
        return out

    def wait_chunks(self, chunks) -> None:
        """Block until each of ``chunks`` (host chunk ids) is final: updated with the right
        factor, validated, or never handed over. Re-raises the failure of a chunk's update.

        Raises:
          HostDeadlineError: a chunk not final within ``deadline_s`` (one line).
        """
        waits = [(c, self._final[c]) for c in chunks if c in self._final]
        end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        for i, (c, f) in enumerate(waits):
            left = None if end is None else max(0.0, end - time.monotonic())
            concurrent.futures.wait([f], timeout=left)
            if not f.done():
                raise HostDeadlineError(_MSG_HOST_DEADLINE.format(
                    what=f"the previous step's update of host chunk {c}", deadline=self.deadline_s, done=i,
                    n=len(waits)))
            f.result()

    def join(self) -> float | None:
        """Wait for every update submitted; re-raises a failure of the host thread. Returns the
        kernel seconds (None when nothing was submitted). Every chunk is final afterwards.

        Raises:
          HostDeadlineError: the work did not finish within ``deadline_s`` (one line; the thread
            is abandoned: the updates it had not started fail with this error and it ends once
            the one it runs returns; the state that held this work must not be used).
        """
        if self._futures:
            end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
            spent, failed = [], None
            for i, f in enumerate(self._futures):
                try:
                    self._wait_one(f, end, i)
                except HostDeadlineError as e:
                    _give_up(self._thread)  # abandoned: not waited for again at exit
                    if self._queue is not None:  # ... and ends once its stalled item returns: nothing left idle
                        self._queue.abandon(HostDeadlineError(str(e)))
                        self._queue = None
                    raise
                if f.exception() is not None and failed is None:
                    failed = f.exception()
                elif f.exception() is None:
                    spent.append(f.result())
            self._settle(failed)
            if failed is not None:
                self._close()
                raise failed
            self._futures, self._handoffs = [], []
            self.seconds = float(sum(s or 0.0 for s in spent)) + (self.seconds or 0.0)
        self._settle(None)
        self._close()
        return self.seconds

    def _close(self) -> None:
        """After every update ended: stop the host thread and join it, and release the backup
        pool's copy threads (the next step starts its own): no thread of this work outlives
        :meth:`join`."""
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join()  # its queue is empty and closed: it returns at once
            self._thread = None
        if self.backups is not None:
            self.backups.close()

    def _settle(self, error) -> None:
        for fin in self._final.values():
            if not fin.done():
                fin.set_exception(error) if error is not None else fin.set_result(None)


#: The host threads started and not yet ended: ``{thread: (its queue, seconds to wait for it at exit)}``.
_LIVE: dict = {}
_LIVE_LOCK = threading.Lock()
_MSG_AT_EXIT = ("chunkjax: {n} host-update thread(s) still running at exit after {s:.3g} s (an update stalled "
                "past its deadline, or host work nobody joined: call step.wait(state) on the last state before "
                "exiting); a daemon thread inside a kernel or a JAX call at finalization can abort the process")


def _start(queue: _Queue, deadline_s: float | None) -> threading.Thread:
    """Start the daemon thread serving ``queue``, registered for :func:`join_at_exit` until it ends."""
    t = threading.Thread(target=_serve, args=(queue,), name="chunkjax-host-update", daemon=True)
    with _LIVE_LOCK:
        _LIVE[t] = (queue, HOST_DEADLINE_MIN_S if deadline_s is None else float(deadline_s))
    t.start()
    return t


def _give_up(t: threading.Thread | None) -> None:
    """A thread whose work missed its deadline: :func:`join_at_exit` does not wait for it."""
    with _LIVE_LOCK:
        if t in _LIVE:
            _LIVE[t] = (_LIVE[t][0], 0.0)


def _serve(queue: _Queue) -> None:
    try:
        queue.serve()
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(threading.current_thread(), None)


def live_threads() -> list[threading.Thread]:
    """The host-update threads of :class:`HostWork` s still running (none after their
    :meth:`HostWork.join`; tests, diagnostics)."""
    with _LIVE_LOCK:
        return [t for t in _LIVE if t.is_alive()]


def join_at_exit() -> int:
    """Finish the host work nobody joined (the last step of a program that exits without
    ``step.wait(state)``): close each live thread's queue, so that it runs what was handed over
    and ends, and wait for it, at most its work's ``deadline_s`` (:data:`HOST_DEADLINE_MIN_S`
    without one). Registered with :mod:`atexit`: the daemon threads would otherwise still run
    kernels or JAX calls when the interpreter finalizes, which aborts the process
    ("FATAL: exception not rethrown"). Prints one line to stderr for threads still running after
    the wait. Returns how many are left running."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for _, (queue, _) in live:
        queue.close()
    waited = 0.0
    for t, (_, wait_s) in live:
        t0 = time.monotonic()
        t.join(wait_s)
        waited += time.monotonic() - t0
    left = sum(t.is_alive() for t, _ in live)
    if left:
        print(_MSG_AT_EXIT.format(n=left, s=waited), file=sys.stderr)
    return left


atexit.register(join_at_exit)


jax.tree_util.register_pytree_node(HostWork, lambda h: ((), h), lambda h, _: h)
