"""One update of the drop-in optimizer's offloaded chunks on three threads: one per PCIe
direction and one for the host kernel, with a per-update breakdown of where the time went.

The two update locations of an offloaded chunk (PatrickStar, arXiv 2108.05818, section 5; the
GPU-CPU split of ZeRO-Offload++ / ZenFlow), as :class:`chunkjax.ChunkedOptimizer` runs them:

* a **streamed** chunk ``c``: ``fetch(c)`` moves its float32 master params and optimizer state
  to the device (the **up** thread), ``update(c, *fetched)`` dispatches its update program (the
  calling thread), ``store(c, *updated)`` moves the new state back (the **down** thread); at
  most ``depth`` chunks are between their fetch and the end of their store;
* a **host** chunk ``c``: ``send_grads(c)`` moves its gradient to pinned host memory (down),
  ``kernel(c, grads)`` updates master and moments in place (the **kernel** thread, numba on
  the optimizer's ``host_threads``: cores left for the transfer threads), ``send_params(c)``
  moves its new params to the device (up).

Each direction has one thread that issues one transfer at a time and waits for it: eager
transfers from two threads reached 94 GB/s together on the H200, both directions inside one
program only 57 (``gpu_facts.md``, "Ceilings"). The host path and the streamed path share the
two threads, so both directions stay in flight together and every transfer is timed. Order:

* down: the next host chunk's gradient while fewer than ``lookahead`` gradients wait for the
  kernel (the kernel never starves), else a streamed write-back (it frees a pipeline slot for
  the next fetch), else more gradients;
* up: a host chunk's params as soon as its kernel is done, else the next fetch when a slot is
  free. Fetches need no gradient, so the first ``depth`` start at once, while the user's
  backward may still be running; the down thread first waits for the gradients (``ready``).

:meth:`DuplexUpdate.run` returns once every streamed update is dispatched and every host chunk's
params are sent; the write-backs of the last streamed chunks may continue behind the caller's
next program (:meth:`DuplexUpdate.join`). :func:`breakdown` turns the timed events into the
measured side of :func:`chunkjax.dropin.predict_update_s`.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

#: Host gradients the down thread keeps landed ahead of the kernel before it prefers write-backs.
LOOKAHEAD = 2
#: The drop-in's default pipeline depth (fetching k+1, updating k, writing back k-1).
DEFAULT_PIPELINE_DEPTH = 3


class Event(NamedTuple):
    """One timed piece of work: ``kind`` is ``"fetch"`` / ``"params"`` (up), ``"ready"`` /
    ``"grads"`` / ``"store"`` (down) or ``"kernel"``; ``nbytes`` moved (0 for the kernel and
    ``ready``); ``start_s`` / ``end_s`` in seconds since the update began."""

    kind: str
    chunk: int
    nbytes: int
    start_s: float
    end_s: float


UP_KINDS, DOWN_KINDS = ("fetch", "params"), ("grads", "store")


def nbytes_of(tree) -> int:
    """Bytes of the arrays in ``tree`` (leaves without ``nbytes`` count 0)."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


class DuplexUpdate:
    """The offloaded chunks of one update (module docstring).

    Args:
      streamed: chunk ids updated through the device, in this order.
      host: chunk ids updated by the host kernel, in this order.
      depth: >= 1 streamed chunks between fetch and the end of their store.
      fetch: ``fetch(c) -> tuple`` of device arrays; returns once they are on the device.
      update: ``update(c, *fetched) -> tuple``: dispatches chunk ``c``'s update program.
      store: ``store(c, *updated)``: returns once the new state is in host memory.
      send_grads: ``send_grads(c) -> grads``: returns once chunk ``c``'s gradient is in host memory.
      kernel: ``kernel(c, grads)``: the host kernel's step of chunk ``c``.
      send_params: ``send_params(c) -> arrays``: sends chunk ``c``'s new params to the device and
        returns once they are there (the arrays count as its bytes).
      ready: ``ready()``: returns once the gradients exist (the down thread's first call).
      lookahead: see :data:`LOOKAHEAD`.

    Attributes:
      events: the :class:`Event` s so far (complete after :meth:`join`).
      return_s: when :meth:`run` returned (seconds since the update began).

    Errors of ``fetch``, ``update``, ``send_grads``, ``kernel``, ``send_params`` are raised by
    :meth:`run` (every thread stopped and joined first); of ``store`` after :meth:`run` returned,
    by :meth:`join`.
    """

    def __init__(self, streamed: Sequence[int], host: Sequence[int], depth: int, *, fetch: Callable,
                 update: Callable, store: Callable, send_grads: Callable, kernel: Callable, send_params: Callable,
                 ready: Callable = lambda: None, lookahead: int = LOOKAHEAD, name: str = "chunkjax-dropin"):
        self.t0 = time.perf_counter()
        self.streamed, self.host = tuple(streamed), tuple(host)
        self._fetch, self._update, self._store = fetch, update, store
        self._send_grads, self._kernel, self._send_params, self._ready = send_grads, kernel, send_params, ready
        self.lookahead = max(1, int(lookahead))
        self.events: list[Event] = []
        self.return_s: float | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._errors: list[BaseException] = []
        self._raised = 0
        self._free = max(1, int(depth))
        self._next_fetch = self._stored = 0
        self._writebacks: collections.deque = collections.deque()
        self._grads_next = self._grads_landed = self._kernels_started = self._params_sent = 0
        self._params_ready: collections.deque = collections.deque()
        self._fetched: queue.SimpleQueue = queue.SimpleQueue()
        self._landed: queue.SimpleQueue = queue.SimpleQueue()
        roles = [("up", self._up)] if (self.streamed or self.host) else []
        roles += [("down", self._down)] if (self.streamed or self.host) else []
        roles += [("kernel", self._kernels)] if self.host else []
        # not daemons: the interpreter joins them before it tears the runtime down (a transfer cut
        # off at exit aborts the process); each ends once its work is done or the stop is set
        self._threads = {r: threading.Thread(target=f, name=f"{name}-{r}") for r, f in roles}
        self._started: list[threading.Thread] = []

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _event(self, kind: str, c: int, nbytes: int, start: float) -> None:
        self.events.append(Event(kind, c, int(nbytes), start, self._now()))

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            self._errors.append(e)
            self._stop = True
            self._cv.notify_all()
        self._fetched.put(None)  # wake the dispatching caller and the kernel thread
        self._landed.put(None)

    # ---- the threads ---------------------------------------------------------------------------
    def _up(self) -> None:
        try:
            while True:
                with self._cv:
                    while True:
                        if self._stop:
                            return
                        if self._params_ready:
                            kind, c = "params", self._params_ready.popleft()
                            break
                        if self._next_fetch < len(self.streamed) and self._free > 0:
                            kind, c = "fetch", self.streamed[self._next_fetch]
                            self._next_fetch += 1
                            self._free -= 1
                            break
                        if self._next_fetch == len(self.streamed) and self._params_sent == len(self.host):
                            return
                        self._cv.wait()
                t = self._now()
                if kind == "fetch":
                    out = self._fetch(c)
                    self._event(kind, c, nbytes_of(out), t)
                    self._fetched.put((c, out))
                    del out
                else:
                    self._event(kind, c, nbytes_of(self._send_params(c)), t)
                    with self._cv:
                        self._params_sent += 1
        except BaseException as e:  # handed to run()
            self._fail(e)

    def _down(self) -> None:
        try:
            t = self._now()
            self._ready()
            self._event("ready", -1, 0, t)
            while True:
                with self._cv:
                    while True:
                        if self._stop:
                            return
                        more = self._grads_next < len(self.host)
                        waiting = self._grads_landed - self._kernels_started
                        if more and (waiting < self.lookahead or not self._writebacks):
                            kind, item = "grads", self.host[self._grads_next]
                            self._grads_next += 1
                            break
                        if self._writebacks:
                            kind, item = "store", self._writebacks.popleft()
                            break
                        if not more and self._stored == len(self.streamed):
                            return
                        self._cv.wait()
                t = self._now()
                if kind == "grads":
                    g = self._send_grads(item)
                    self._event(kind, item, nbytes_of(g), t)
                    self._landed.put((item, g))
                    del g
                    with self._cv:
                        self._grads_landed += 1
                else:
                    c, updated = item
                    del item
                    self._store(c, *updated)
                    self._event(kind, c, nbytes_of(updated), t)
                    del updated
                    with self._cv:
                        self._stored += 1
                        self._free += 1
                        self._cv.notify_all()
        except BaseException as e:  # handed to run() or join()
            self._fail(e)

    def _kernels(self) -> None:
        try:
            for _ in self.host:
                item = self._landed.get()
                if item is None:
                    return
                c, g = item
                del item
                with self._cv:
                    self._kernels_started += 1
                    self._cv.notify_all()
                t = self._now()
                self._kernel(c, g)
                del g
                self._event("kernel", c, 0, t)
                with self._cv:
                    self._params_ready.append(c)
                    self._cv.notify_all()
        except BaseException as e:  # handed to run()
            self._fail(e)

    # ---- the caller's side -----------------------------------------------------------------------
    def start(self) -> "DuplexUpdate":
        """Start the threads (fetches begin at once)."""
        try:
            for t in self._threads.values():
                t.start()
                self._started.append(t)
        except BaseException:  # Ctrl-C while starting: stop whichever threads run, or exit hangs
            self.abort()
            raise
        return self

    def run(self) -> "DuplexUpdate":
        """Dispatch every streamed chunk's update as its fetch lands; return once all are
        dispatched and every host chunk's params are sent (the down thread may still be writing
        back). Starts the threads if :meth:`start` was not called.

        Raises:
          whatever ``fetch``, ``update``, ``send_grads``, ``kernel``, ``send_params`` or an
          earlier ``store`` raised (every thread stopped and joined first).
        """
        if not self._started:
            self.start()
        try:
            for _ in self.streamed:
                item = self._fetched.get()
                if item is None:  # a thread failed
                    break
                c, fetched = item
                del item
                updated = self._update(c, *fetched)
                del fetched
                with self._cv:
                    self._writebacks.append((c, updated))
                    self._cv.notify_all()
                del updated
            for r in ("up", "kernel"):
                if r in self._threads:
                    self._threads[r].join()
        except BaseException:
            self.abort()
            raise
        self.return_s = self._now()
        if self._errors:
            self.abort()
            self._raised = len(self._errors)
            raise self._errors[0]
        return self

    def abort(self) -> None:
        """Stop early (the caller failed): every thread is told to stop and joined."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._fetched.put(None)
        self._landed.put(None)
        for t in self._started:
            t.join()

    def join(self) -> None:
        """Wait for the write-backs still in flight; re-raises a failure not raised yet."""
        for t in self._started:
            t.join()
        if len(self._errors) > self._raised:
            err = self._errors[self._raised]
            self._raised = len(self._errors)
            raise err


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in x for c, d in y)


@dataclasses.dataclass(frozen=True)
class UpdateBreakdown:
    """Where one drop-in update's time went, measured, beside its prediction
    (:func:`chunkjax.dropin.predict_update_parts`). Seconds since ``update()`` was called.

    Attributes:
      step: the update's index (0 for the first).
      n_device, n_streamed, n_host: chunks at each update location.
      predicted_s, predicted_h2d_s, predicted_d2h_s, predicted_kernel_s: the cost model's
        update seconds and three of its parts (each direction's PCIe time, the kernel's time);
        ``predicted_host_memory_s`` (with the caller's fields below) the fourth, the host memory's
        time that the kernel and the DMA share.
      backward_wait_s: until the gradients existed (the user's backward still running when
        ``update()`` is called right after dispatching it).
      update_s: from the gradients' existence until ``update()`` returned: what ``predicted_s``
        predicts (plus the dispatch of the device chunks' updates).
      tail_s: write-backs after the return (they run behind the caller's next program).
      h2d_bytes, d2h_bytes: bytes moved each way (fetches + host params; write-backs + host grads).
      h2d_busy_s, d2h_busy_s: seconds with a transfer of that direction in flight.
      both_busy_s: seconds with both directions in flight at once.
      h2d_gb_per_s, d2h_gb_per_s: bytes over busy seconds (0 when nothing moved).
      kernel_s: host kernel seconds; kernel_idle_s: its thread's wait for gradients between its
        first start and its last end.
      events: the timed :class:`Event` s (a timeline).

    The caller's side of the step (:class:`StepPhases`; seconds, None where not measured): the
    period from the previous ``update()``'s return to this one's is ``outside_s + setup_s +
    backward_wait_s + update_s + finish_s + model_update_s`` (``step_s``):

      outside_s: from the previous update's return to this call (the user's loop: its jitted
        gradient step's dispatch, reading the loss, the data); None for the first update.
      setup_s: from the call until the update began: checking and flattening the gradients,
        joining the previous update's write-backs (``tail_s`` longer than ``outside_s``).
      dispatch_s: the calling thread's dispatch of the gradient preparation, the device-resident
        chunks' update programs and the offloaded run's start (inside ``backward_wait_s`` /
        ``update_s``: beside the transfer threads).
      finish_s: from the offloaded run's return until the new params pytree was returned
        (the host chunks' params put in place, the leaves spanning chunks joined, unflattened).
      model_update_s: writing the new params into the model (``NnxOptimizer``: ``nnx.update``;
        0 for ``ChunkedOptimizer``).
      step_s: the sum above (None when ``outside_s`` is).
      grads_ready_s: ``outside_s + setup_s + backward_wait_s``: from the previous return until
        the gradients existed (the user's gradient step as the loop sees it).
    """

    step: int
    n_device: int
    n_streamed: int
    n_host: int
    predicted_s: float
    predicted_h2d_s: float
    predicted_d2h_s: float
    predicted_kernel_s: float
    backward_wait_s: float
    update_s: float
    tail_s: float
    h2d_bytes: int
    d2h_bytes: int
    h2d_busy_s: float
    d2h_busy_s: float
    both_busy_s: float
    h2d_gb_per_s: float
    d2h_gb_per_s: float
    kernel_s: float
    kernel_idle_s: float
    events: tuple[Event, ...] = ()
    outside_s: float | None = None
    setup_s: float | None = None
    dispatch_s: float | None = None
    finish_s: float | None = None
    model_update_s: float | None = None
    step_s: float | None = None
    grads_ready_s: float | None = None
    predicted_host_memory_s: float | None = None

    def __repr__(self) -> str:
        """One short line (the events counted, not listed: :meth:`as_dict` has every field)."""
        return (f"UpdateBreakdown(step={self.step}, chunks device/streamed/host={self.n_device}/{self.n_streamed}/"
                f"{self.n_host}, update_s={self.update_s:.4g} (predicted {self.predicted_s:.4g}), tail_s="
                f"{self.tail_s:.4g}, h2d={self.h2d_bytes} B at {self.h2d_gb_per_s:.3g} GB/s, d2h={self.d2h_bytes} B at "
                f"{self.d2h_gb_per_s:.3g} GB/s, kernel_s={self.kernel_s:.4g}, events={len(self.events)})")

    def as_dict(self, events: bool = False) -> dict[str, Any]:
        """The fields as a JSON-ready dict (the events as lists only if ``events``)."""
        d = dataclasses.asdict(self)
        d["events"] = [list(e) for e in self.events] if events else len(self.events)
        return d


class StepPhases:
    """The calling thread's clock of one ``update()`` call (:class:`UpdateBreakdown`'s caller
    fields), filled as the call goes: ``mark(name)`` stores the seconds since the previous mark
    under ``name``; ``now()`` is ``time.perf_counter()``.

    Args:
      called: ``perf_counter()`` when ``update()`` was called.
      last_return: ``perf_counter()`` when the previous ``update()`` returned (None: none did).
    """

    def __init__(self, called: float, last_return: float | None):
        self.parts: dict[str, float] = {}
        self.outside_s = None if last_return is None else called - last_return
        self._last = called

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def mark(self, name: str, at: float | None = None) -> float:
        """Store the seconds since the previous mark (or the call) as ``name``; returns the time."""
        t = time.perf_counter() if at is None else at
        self.parts[name] = self.parts.get(name, 0.0) + t - self._last
        self._last = t
        return t


def breakdown(run: DuplexUpdate, *, step: int, n_device: int, predicted,
              phases: StepPhases | None = None) -> UpdateBreakdown:
    """The :class:`UpdateBreakdown` of a joined ``run``; ``predicted`` is a
    :class:`chunkjax.dropin.UpdateTime`; ``phases`` the call's :class:`StepPhases` (marks
    ``setup``, ``dispatch``, ``finish`` and optionally ``model_update``) or None."""
    ev = list(run.events)
    ready = next((e.end_s for e in ev if e.kind == "ready"), 0.0)
    ret = run.return_s if run.return_s is not None else ready
    end = max([e.end_s for e in ev] + [ret])
    up = _union([(e.start_s, e.end_s) for e in ev if e.kind in UP_KINDS])
    down = _union([(e.start_s, e.end_s) for e in ev if e.kind in DOWN_KINDS])
    busy = lambda spans: sum(b - a for a, b in spans)  # noqa: E731
    nb = lambda kinds: sum(e.nbytes for e in ev if e.kind in kinds)  # noqa: E731
    ks = [e for e in ev if e.kind == "kernel"]
    kernel_s = sum(e.end_s - e.start_s for e in ks)
    span = (max(e.end_s for e in ks) - min(e.start_s for e in ks)) if ks else 0.0
    h2d_b, d2h_b, h2d_s, d2h_s = nb(UP_KINDS), nb(DOWN_KINDS), busy(up), busy(down)
    caller: dict[str, Any] = {}
    if phases is not None:
        p = phases.parts
        caller = dict(outside_s=phases.outside_s, setup_s=p.get("setup"), dispatch_s=p.get("dispatch"),
                      finish_s=p.get("finish"), model_update_s=p.get("model_update", 0.0))
        if phases.outside_s is not None and None not in (caller["setup_s"], caller["finish_s"]):
            caller["grads_ready_s"] = phases.outside_s + caller["setup_s"] + ready
            caller["step_s"] = caller["grads_ready_s"] + max(0.0, ret - ready) + caller["finish_s"] + \
                caller["model_update_s"]
    return UpdateBreakdown(
        step=step, n_device=n_device, n_streamed=len(run.streamed), n_host=len(run.host),
        predicted_s=predicted.total_s, predicted_h2d_s=predicted.h2d_s, predicted_d2h_s=predicted.d2h_s,
        predicted_kernel_s=predicted.kernel_s, backward_wait_s=ready, update_s=max(0.0, ret - ready),
        tail_s=max(0.0, end - ret), h2d_bytes=h2d_b, d2h_bytes=d2h_b, h2d_busy_s=h2d_s, d2h_busy_s=d2h_s,
        both_busy_s=_overlap(up, down), h2d_gb_per_s=h2d_b / h2d_s / 1e9 if h2d_s > 0 else 0.0,
        d2h_gb_per_s=d2h_b / d2h_s / 1e9 if d2h_s > 0 else 0.0, kernel_s=kernel_s,
        kernel_idle_s=max(0.0, span - kernel_s), events=tuple(ev),
        predicted_host_memory_s=getattr(predicted, "host_memory_s", None), **caller)
