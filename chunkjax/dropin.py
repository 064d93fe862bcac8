"""The drop-in optimizer's update: where each offloaded chunk is updated, and one step's pipeline.

:class:`chunkjax.ChunkedOptimizer` keeps a chunk's float32 master params and optimizer state on
the device while they fit its budget (ZeRO-Offload's split, :func:`chunkjax.plan_schedule`'s
``"optimizer_only"`` policy); the other chunks' state lives in pinned host memory and is updated
at one of PatrickStar's update locations (Fang et al., arXiv 2108.05818, section 5):

* **streamed** (the device): master + state move to the device, the chunk is updated there by
  the unchanged optax transformation (:func:`chunkjax.optim.update_chunk`) and moves back;
* **host**: the numba kernel (:func:`chunkjax.updaters.host_updater`, arithmetic of
  :mod:`chunkjax.kernels`) updates master and moments in place; only the gradient goes to the
  host and the new compute params come back. Only for a host kernel spec
  (``chunkjax.host_update.AdamW / Lion / SGDMomentum``) given as ``tx``.

:func:`split_offloaded` divides the offloaded chunks between the two by rate
(:func:`predict_update_s`: the PCIe bytes of each direction against the host kernel's time,
the two running in parallel, ZeRO-Offload++ / ZenFlow's GPU-CPU split).

One step (:func:`stream_chunks`): the streamed chunks run through a pipeline of ``depth`` chunks
of state on the device at once: a fetch thread moves chunk k+1's state to the device while the
update program of chunk k runs and a write-back thread moves chunk k-1's back, so both PCIe
directions are in flight (eager transfers from two threads reached 94 GB/s together on the H200,
against 57 GB/s for both directions inside one program: ``gpu_facts.md``, "Ceilings"). The call
returns when the last update is dispatched; the write-backs of the last chunks continue behind
the caller's next program and are joined by :meth:`StreamedWork.join`.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from chunkjax.cost import Rates

#: Default number of streamed chunks whose state may be on the device at once (fetching k+1,
#: updating k, writing back k-1).
DEFAULT_PIPELINE_DEPTH = 3

_MSG_HOST_CHUNKS = ("host_chunks={n} but {have} chunk(s) have their state in pinned host memory: "
                    "use 0 <= host_chunks <= {have}")


def predict_update_s(n_streamed: int, n_host: int, chunk_size: int, state_bytes: int, grad_bytes: int,
                     param_bytes: int, rates: Rates) -> float:
    """Predicted seconds of the offloaded part of one update: the PCIe time of the busier
    direction (streamed chunks move ``state_bytes`` each way; host chunks send ``grad_bytes``
    down and get ``param_bytes`` back) against the host kernel's time (``chunk_size`` elements
    per host chunk at ``rates.host_update_s_per_param``); the two run in parallel.

    Args:
      n_streamed, n_host: chunks at each location.
      chunk_size: elements per chunk.
      state_bytes: one chunk's float32 master params + optimizer state (bytes).
      grad_bytes, param_bytes: one chunk's gradient and compute params (bytes).
      rates: :class:`chunkjax.cost.Rates`.
    """
    h2d = n_streamed * state_bytes + n_host * param_bytes
    d2h = n_streamed * state_bytes + n_host * grad_bytes
    pcie = max(h2d / rates.h2d_bytes_per_s, d2h / rates.d2h_bytes_per_s)
    return max(pcie, n_host * chunk_size * rates.host_update_s_per_param)


def split_offloaded(offloaded: Sequence[int], chunk_size: int, state_bytes: int, grad_bytes: int,
                    param_bytes: int, rates: Rates | None = None,
                    host_chunks: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Divide the chunks whose state is in pinned host memory between the streamed update and
    the host kernel.

    Args:
      offloaded: chunk ids (layout order).
      chunk_size, state_bytes, grad_bytes, param_bytes: as :func:`predict_update_s`.
      rates: measured rates (default :class:`chunkjax.cost.Rates`, the H200's).
      host_chunks: how many chunks the host kernel updates; None picks the count with the
        least :func:`predict_update_s` (the fewest on a tie).

    Returns:
      ``(streamed, host)``: chunk ids; the host takes the last ``host_chunks`` of ``offloaded``
      (the streamed ones go first: their update programs start while the host gradients travel).

    Raises:
      ValueError: ``host_chunks`` outside ``[0, len(offloaded)]``.
    """
    rates = rates or Rates()
    n = len(offloaded)
    if host_chunks is None:
        host_chunks = min(range(n + 1), key=lambda h: (predict_update_s(
            n - h, h, chunk_size, state_bytes, grad_bytes, param_bytes, rates), h))
    elif isinstance(host_chunks, bool) or not isinstance(host_chunks, int) or not 0 <= host_chunks <= n:
        raise ValueError(_MSG_HOST_CHUNKS.format(n=host_chunks, have=n))
    return tuple(offloaded[:n - host_chunks]), tuple(offloaded[n - host_chunks:])


class StreamedWork:
    """The write-backs of one step's streamed chunks still in flight after
    :func:`stream_chunks` returned; :meth:`join` waits for them (re-raising a failure)."""

    def __init__(self, threads: list[threading.Thread], errors: list[BaseException]):
        self._threads = threads
        self._errors = errors

    def join(self) -> None:
        for t in self._threads:
            t.join()
        self._threads = []
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err


def stream_chunks(chunks: Sequence[int], depth: int, fetch: Callable, update: Callable,
                  store: Callable) -> StreamedWork:
    """Update ``chunks`` through the device with at most ``depth`` chunks of state there at once.

    Args:
      chunks: chunk ids in update order.
      depth: >= 1; 1 runs fetch, update and write-back of a chunk one after the other, 3 keeps
        both directions busy (fetch of k+1, write-back of k-1 while k updates).
      fetch: ``fetch(c) -> (master, state)`` on the device (dispatched on the fetch thread).
      update: ``update(c, master, state) -> (master, state)``: dispatches chunk ``c``'s update
        program (on the calling thread, in ``chunks`` order).
      store: ``store(c, master, state)``: moves the updated state back to pinned host memory and
        blocks until it is there (on the write-back thread); the device copies are then dropped
        and the next fetch may start.

    Returns:
      :class:`StreamedWork`, after every update is dispatched.

    Raises:
      whatever ``fetch`` or ``update`` raise (the threads are stopped first).
    """
    if not chunks:
        return StreamedWork([], [])
    slots = threading.Semaphore(max(1, depth))
    fetched: queue.SimpleQueue = queue.SimpleQueue()
    back: queue.SimpleQueue = queue.SimpleQueue()
    errors: list[BaseException] = []
    stop = threading.Event()

    def fetcher():
        for c in chunks:
            slots.acquire()
            if stop.is_set():
                return
            try:
                fetched.put((c, fetch(c)))
            except BaseException as e:  # handed to the caller
                fetched.put(e)
                return

    def writer():
        while (item := back.get()) is not None:
            try:
                store(*item)
            except BaseException as e:  # handed to join()
                errors.append(e)
            finally:
                del item
                slots.release()

    # not daemons: the interpreter joins them before it tears the runtime down (a write-back cut
    # off at exit aborts the process); both end once every chunk is through
    threads = [threading.Thread(target=f, name=f"chunkjax-dropin-{f.__name__}") for f in (fetcher, writer)]
    for t in threads:
        t.start()
    try:
        for _ in chunks:
            item = fetched.get()
            if isinstance(item, BaseException):
                raise item
            c, (master, state) = item
            del item
            back.put((c, *update(c, master, state)))
            del master, state
    except BaseException:
        stop.set()
        for _ in range(len(chunks) + depth):  # a fetcher waiting for a slot sees the stop
            slots.release()
        back.put(None)
        for t in threads:
            t.join()
        raise
    back.put(None)
    return StreamedWork(threads, errors)
