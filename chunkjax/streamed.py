"""The streamed update location: a chunk's state moves to the device, is updated there and moves
back, both PCIe directions in flight (PatrickStar's device-side update of a host chunk, arXiv
2108.05818 section 5; ZeRO-Offload++ / ZenFlow update part of the offloaded state on the GPU).

One pipeline (:class:`Pipeline`) serves the chunked step (:class:`StepStream`, per step call; the
drop-in optimizers run their streamed and host chunks together on :mod:`chunkjax.duplex`). Three
threads, at most ``depth`` chunks' state on the device at once:

* a **fetch** thread moves chunk k+1's float32 master params, optimizer state (and, in the
  step, its gradient) from pinned host memory to the device by eager ``jax.device_put`` and waits
  until it is there;
* a **dispatch** thread dispatches chunk k's update program (device only, master and state
  donated);
* a **write-back** thread moves chunk k-1's new state (and compute params) back to pinned host
  memory and waits until it is there; then a slot frees for the next fetch.

Eager transfers from two threads reached 94 GB/s together on the H200, against 57 GB/s for both
directions inside one program (``gpu_facts.md``, "Ceilings"): :class:`chunkjax.cost.Rates`'s
``duplex_bytes_per_s``.

In the step, a streamed chunk is handed to the pipeline right after the program in which its
gradient becomes final (its last backward read), so its transfers run while later programs
compute, when the schedule says so (``Schedule.streamed_early``: the planner found it faster,
its pipeline's bytes on the device during the backward) and the update does not depend on the
global gradient norm (:func:`starts_early`: no non-finite skip, no loss scaling, one
micro-batch, one device, and an optax chain whose chunk result has no data path from the norm,
checked exactly on its jaxpr). Otherwise (``clip_by_global_norm``, ``nonfinite="skip"``, loss
scaling, micro-batches) every streamed chunk waits for the norm at the end of the backward and
runs there through the same pipeline, at the same time as the host thread's tail: exact, no
backup. The update programs run on the device's one compute stream, so an early chunk's update
waits for the program running when its fetch completes (the cost model times this:
:func:`chunkjax.cost.streamed_pipeline_end`).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import optim
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.predict import STREAMED_PIPELINE_DEPTH


class StreamedWork:
    """The write-backs still in flight after a pipeline's :meth:`Pipeline.close`; :meth:`join`
    waits for them and re-raises a failure of the write-back thread."""

    def __init__(self, threads: Sequence[threading.Thread] = (), errors: list | None = None):
        self._threads = list(threads)
        self._errors = [] if errors is None else errors

    def join(self) -> None:
        for t in self._threads:
            t.join()
        self._threads = []
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err


class Pipeline:
    """Streams chunks through the device, ``depth`` at a time (module docstring).

    Args:
      depth: >= 1 chunks whose state may be on the device at once (1: fetch, update and
        write-back of a chunk one after the other).
      fetch: ``fetch(c) -> tuple`` of device arrays (fetch thread; should return once they are
        on the device, so an update program never waits for a transfer on the compute stream).
      update: ``update(c, *fetched) -> tuple``: dispatches chunk ``c``'s update program (dispatch
        thread, in submission order).
      store: ``store(c, *updated)``: moves the update's results back to pinned host memory and
        returns once they are there (write-back thread); the chunk's slot then frees.

    Chunks are handed over by :meth:`submit` (any number of calls) and :meth:`close` returns once
    every update is dispatched. Errors of ``fetch`` or ``update`` are raised by :meth:`close`
    (the threads stopped first); of ``store`` by the returned :class:`StreamedWork`.

    ``threads=False`` runs fetch, update and store of each chunk in order on the thread that calls
    :meth:`close` (a mesh across processes: every process dispatches the same programs in the
    same order).
    """

    def __init__(self, depth: int, fetch: Callable, update: Callable, store: Callable,
                 name: str = "chunkjax-streamed", threads: bool = True):
        self._slots = threading.Semaphore(max(1, int(depth)))
        self._depth = max(1, int(depth))
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._fetched: queue.SimpleQueue = queue.SimpleQueue()
        self._back: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._failed: list[BaseException] = []
        self._store_errors: list[BaseException] = []
        self._fetch, self._update, self._store = fetch, update, store
        self.submitted = 0
        self._inline: list | None = None if threads else []
        if not threads:
            self._threads = []
            return
        # not daemons: the interpreter joins them before it tears the runtime down (a write-back
        # cut off at exit aborts the process); each ends once its queue's end mark arrives
        self._threads = [threading.Thread(target=f, name=f"{name}-{f.__name__.strip('_')}")
                         for f in (self._fetcher, self._dispatcher, self._writer)]
        try:
            for t in self._threads:
                t.start()
        except BaseException:  # Ctrl-C while starting: end marks for whichever threads run, or exit hangs
            self._end_threads()
            raise

    def _end_threads(self) -> None:
        """Stop without joining: every queue gets its end mark and every slot is released, so each
        thread that runs returns (an interrupted start may leave any subset running)."""
        self._stop.set()
        for _ in range(self.submitted + self._depth + 1):
            self._slots.release()
        for q in (self._todo, self._fetched, self._back):
            q.put(None)

    def _fail(self, e: BaseException) -> None:
        self._failed.append(e)
        self._stop.set()
        for _ in range(self.submitted + self._depth + 1):  # a fetcher waiting for a slot sees the stop
            self._slots.release()

    def _fetcher(self):
        try:
            while (c := self._todo.get()) is not None:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                try:
                    self._fetched.put((c, self._fetch(c)))
                except BaseException as e:  # handed to close()
                    self._fail(e)
                    return
        finally:
            self._fetched.put(None)

    def _dispatcher(self):
        try:
            while (item := self._fetched.get()) is not None:
                if self._stop.is_set():
                    continue  # drain until the fetcher's end mark
                c, args = item
                del item
                try:
                    self._back.put((c, *self._update(c, *args)))
                except BaseException as e:  # handed to close()
                    self._fail(e)
                del args
        finally:
            self._back.put(None)

    def _writer(self):
        while (item := self._back.get()) is not None:
            try:
                self._store(*item)
            except BaseException as e:  # handed to StreamedWork.join()
                self._store_errors.append(e)
            finally:
                del item
                self._slots.release()

    @property
    def store_failed(self) -> bool:
        """Whether a write-back (``store``) has failed (:meth:`StreamedWork.join` raises it)."""
        return bool(self._store_errors)

    def submit(self, chunks: Iterable[int]) -> None:
        """Hand ``chunks`` over (fetched and updated in this order, after earlier ones)."""
        for c in chunks:
            self.submitted += 1
            if self._inline is not None:
                self._inline.append(c)
            else:
                self._todo.put(c)

    def close(self) -> StreamedWork:
        """No more chunks: returns once every update is dispatched (write-backs may still run).

        Raises:
          whatever ``fetch`` or ``update`` raised (every thread is joined first).
        """
        if self._inline is not None:
            for c in self._inline:
                self._store(c, *self._update(c, *self._fetch(c)))
            self._inline = []
            return StreamedWork()
        self._todo.put(None)
        self._threads[0].join()
        self._threads[1].join()
        if self._failed:
            self._threads[2].join()
            raise self._failed[0]
        return StreamedWork(self._threads[2:], self._store_errors)

    def abort(self) -> None:
        """Stop early (the caller failed): joins every thread, drops the rest of the work."""
        if self._inline is not None:
            self._inline = []
            return
        self._stop.set()
        for _ in range(self.submitted + self._depth + 1):
            self._slots.release()
        self._todo.put(None)
        for t in self._threads:
            t.join()


# ---- does a chunk's update depend on the global norm? -------------------------------------------

def _tainted_outputs(closed, sources: set[int]) -> list[bool]:
    """For each output of a closed jaxpr: does it depend on the inputs numbered in ``sources``?
    Conservative: every output of an equation with a dependent input depends (sub-jaxprs,
    control flow and custom rules included)."""
    jaxpr = closed.jaxpr
    tainted = {v for i, v in enumerate(jaxpr.invars) if i in sources}
    for eqn in jaxpr.eqns:
        if any((not hasattr(v, "val")) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [(not hasattr(v, "val")) and v in tainted for v in jaxpr.outvars]


def needs_global_norm(tx, probe_size: int = 8) -> bool:
    """Whether ``tx`` (an elementwise optax transformation) gives a chunk a result that depends on
    the global gradient norm: True when any data path leads from the rest-of-model leaf
    (:func:`chunkjax.optim.update_chunk`) to the chunk's update or to its chunk-shaped optimizer
    state, directly or through optimizer state carried to later steps (``clip_by_global_norm``);
    False for Adam, AdamW, Lion, SGD and their schedules. Exact in the direction used: False is
    a proof (no data path in the traced program), True may be conservative."""
    n = probe_size
    master = jax.ShapeDtypeStruct((n,), optim.MASTER_DTYPE)
    state = jax.eval_shape(lambda m: optim.init_chunk_state(tx, m), master)
    leaves, treedef = jax.tree.flatten(state)
    zero = jnp.zeros((), optim.MASTER_DTYPE)

    def step(g, rest, m, *st):
        upd, new = tx.update([g, rest], jax.tree.unflatten(treedef, st), [m, zero])
        return (upd[0], *jax.tree.leaves(new))

    closed = jax.make_jaxpr(step)(master, jax.ShapeDtypeStruct((), optim.MASTER_DTYPE), master, *leaves)
    n_state = len(leaves)
    sources = {1}
    while True:  # state leaves fed by the norm are sources in the next step
        out = _tainted_outputs(closed, sources)
        grown = sources | {3 + i for i in range(n_state) if out[1 + i]}
        if grown == sources:
            break
        sources = grown
    chunk_out = [out[0]] + [t for t, leaf in zip(out[1:], leaves) if tuple(leaf.shape) == (n,)]
    return any(chunk_out)


def starts_early(tx, *, skip: bool = False, loss_scaling: bool = False, micro_batches: int = 1,
                 n_ranks: int = 1) -> bool:
    """Whether the step's streamed updates start as their gradients become final (before the
    global norm is known): one device, one micro-batch, no non-finite skip or loss scaling, and
    ``tx`` not :func:`needs_global_norm`."""
    return (n_ranks == 1 and micro_batches == 1 and not skip and not loss_scaling
            and not needs_global_norm(tx))


# ---- the step's streamed updates ---------------------------------------------------------------

class StreamSpec(NamedTuple):
    """What :class:`StepStream` needs of a step (built once per step:
    :attr:`chunkjax.ChunkedStep.stream_spec`); the stream reads nothing else of the step.

    Attributes:
      chunks: the streamed chunk ids (update location ``streamed``), in layout order.
      param_kinds: per chunk of the layout, its compute params' memory kind.
      update: ``update(param_kind) -> jitted program`` of the streamed location
        (:func:`chunkjax.updaters.device_updater` with ``state_kind=PINNED_HOST``).
      topology: the step's :class:`~chunkjax.topology.SingleDevice` / ``DataMesh`` (shardings;
        on a mesh the chunks run in order on the calling thread).
      state_template: one chunk's abstract optax state (:func:`chunkjax.updaters.state_template`).
      early: updates start as their gradients become final (the schedule's ``streamed_early``
        where :func:`starts_early` allows it), else after the global norm is known.
    """

    chunks: tuple[int, ...]
    param_kinds: tuple[str, ...]
    update: Callable
    topology: Any
    state_template: Any
    early: bool


class StepStream:
    """One step call's streamed updates (:class:`Pipeline` of :data:`STREAMED_PIPELINE_DEPTH`).

    :meth:`on_program` is called after each program with the gradients it completed: with
    ``early`` the streamed ones go to the pipeline at once, and the main thread waits for the
    program before the last one, so the update programs are dispatched between the backward's
    programs rather than after all of them. :meth:`set_grad_sq` gives the global squared norms;
    :meth:`finish` hands over the rest, releases the updates of a norm-dependent step (after the
    step's device updates are dispatched), waits until every chunk's results exist and writes
    them into the state lists. On a mesh the chunks run in order on the calling thread.

    Without streamed chunks every method does nothing (no threads are started).

    Args:
      spec: the step's :class:`StreamSpec`.
      state: the step's input state (its ``params``, ``master`` and ``opt_state`` chunk lists).
      inv: () float32 1 / loss scale.

    Attributes:
      chunks: the step's streamed chunks (``spec.chunks``).
      early: ``spec.early``.
    """

    def __init__(self, spec: StreamSpec, state, inv):
        self.spec, self.state, self.inv = spec, state, inv
        self.chunks = tuple(spec.chunks)
        self.early = bool(spec.early) and bool(self.chunks)
        if not self.chunks:
            return
        self._mine = set(self.chunks)
        self._grads: dict = {}
        self._sent: set = set()
        self._grad_sq = None
        self._norm = threading.Event()
        self._out: dict = {}
        self._published = threading.Condition()
        self._last_q = None
        topo, template = spec.topology, spec.state_template
        self._dev = (topo.shard_sharding(DEVICE), topo.shard_sharding(DEVICE), topo.state_shardings(template, DEVICE))
        self._host = (topo.shard_sharding(PINNED_HOST), topo.state_shardings(template, PINNED_HOST))
        # a norm-free update sees no rest-of-model norm (its chunk result does not read it, so the
        # bits are those of any norm; its rest-leaf state stays the same in every run)
        self._zero_sq = (topo.put(np.zeros((len(spec.param_kinds),), np.float32), topo.scalar_sharding())
                         if self.early else None)
        # a mesh: in order on the calling thread (processes must dispatch programs in one order)
        self._threads = topo.mesh is None
        self.pipe = Pipeline(STREAMED_PIPELINE_DEPTH, self._fetch, self._update, self._store, "chunkjax-streamed",
                             threads=self._threads)

    def _fetch(self, c: int):
        g_sh, m_sh, s_sh = self._dev
        out = jax.device_put((self._grads[c], self.state.master[c], self.state.opt_state[c]), (g_sh, m_sh, s_sh),
                             may_alias=False)
        return jax.block_until_ready(out) if self._threads else out

    def _update(self, c: int, grad, master, opt):
        if self.early:
            grad_sq = self._zero_sq
        else:  # released by finish(): after the device updates are dispatched
            self._norm.wait()
            if self._grad_sq is None:
                raise RuntimeError("the step failed before its global norm was known")
            grad_sq = self._grad_sq
        pk = self.spec.param_kinds[c]
        fn = self.spec.update(pk)
        return fn(grad, master, opt, grad_sq, jnp.asarray(c, jnp.int32),
                  self.state.params[c] if pk == DEVICE else None, self.inv)

    def _store(self, c: int, params, master, opt) -> None:
        pk = self.spec.param_kinds[c]
        m_sh, s_sh = self._host
        if pk != DEVICE:
            params = jax.device_put(params, self.spec.topology.param_sharding(pk), may_alias=False)
        master, opt = jax.device_put((master, opt), (m_sh, s_sh), may_alias=False)
        with self._published:
            self._out[c] = (params, master, opt)
            self._published.notify_all()
        if self._threads:
            jax.block_until_ready((params, master, opt))

    def on_program(self, grads: dict, sq: dict) -> None:
        """After a program: its completed gradients ``{c: gradient}`` and squared norms."""
        if not self.chunks:
            return
        mine = [c for c in grads if c in self._mine]
        self._grads.update({c: grads[c] for c in mine})
        if not self.early:
            return
        self.pipe.submit(c for c in mine if c not in self._sent)
        self._sent.update(mine)
        if self._sent and self._last_q is not None:  # at most one backward program queued ahead
            jax.block_until_ready(self._last_q)
        self._last_q = next(iter(sq.values()), self._last_q)

    def set_grad_sq(self, grad_sq) -> None:
        """The (n_chunks,) squared norms of the step's gradients (None: the step failed, the
        pipeline is stopped)."""
        if not self.chunks:
            return
        self._grad_sq = grad_sq
        if grad_sq is None:
            self._norm.set()
            self.pipe.abort()

    def finish(self, grads: dict, params: list, master: list, opt: list):
        """Hand over every streamed chunk not sent yet (gradients ``grads``), wait until each
        chunk's results exist and put them into ``params``, ``master``, ``opt``. Returns
        ``join() -> 0.0`` for :meth:`chunkjax.updaters.HostWork.submit`: it waits for the
        write-backs still in flight (no kernel seconds)."""
        for c in self.chunks:
            self._grads.setdefault(c, grads[c])
        self.pipe.submit(c for c in self.chunks if c not in self._sent)
        self._sent.update(self.chunks)
        self._norm.set()
        work = self.pipe.close()
        with self._published:
            while len(self._out) < len(self.chunks) and not self.pipe.store_failed:
                self._published.wait(timeout=1.0)
        if self.pipe.store_failed:
            work.join()
        for c, (p, m, o) in self._out.items():
            params[c], master[c], opt[c] = p, m, o
        # nothing of this step stays referenced here: the join below (held by the returned state's
        # pending work) must not keep this step's results or inputs alive into later steps
        self.state = self._grads = self._grad_sq = None
        self._out = {}

        def join() -> float:
            work.join()
            return 0.0
        return join
