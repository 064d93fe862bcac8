"""The step's ``storage`` update location: Smart-Infinity's near-storage update as an updater.

A chunk planned ``storage`` (:mod:`chunkjax.plan_disk`) keeps its float32 master params and AdamW
moments in chunk files on the storage directories (:mod:`chunkjax.storage.files`: checksums and
the two-phase commit), owned by one near-storage worker process per directory
(:mod:`chunkjax.storage.worker`), through one
:class:`~chunkjax.storage.near.NearStorageOptimizer` shared by all storage chunks of the step (the
bench's optimizer, not a second copy). Its compute params live in pinned host memory like a host
chunk's, and its gradient leaves the device like a host chunk's. Once the step's global gradient
norm is known (clipping is exact: the norm of the whole model, not of the storage chunks), a
thread sends each storage chunk's gradient to its worker, which reads the chunk's state, runs the
host tier's AdamW kernel next to the disk (:mod:`chunkjax.kernels`: the same bits as a ``host``
chunk) and writes the new state, streaming the new bf16 params back; they are written straight
into the chunk's pinned params buffer, before the next step fetches it (the next step, or
:meth:`chunkjax.ChunkedStep.wait`, joins this work). Every worker then commits the step.

Faults: a worker that dies, stops or fails (a full disk) makes the step's pending work raise
:class:`~chunkjax.storage.files.StorageError` (one line naming the worker, its directory and the
last committed step) from ``step.wait`` or the next step; the files stay at the last committed
step (no corrupted state). A checkpoint (:mod:`chunkjax.step_checkpoint`) reads each storage
chunk's master and moments from its files, and a restore streams them back into the directories.

The storage directories are the step's working memory: :meth:`init` and a restore replace a
previous run's chunk files there (only chunkjax's own files: manifest and chunk files).

Reference: Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664), SmartUpdate; top-k
gradient compression is optional (``compression="topk"``), off by default (results then equal
optax to float32 rounding).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import threading
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.kernels import AdamW
from chunkjax.predict import STORAGE_STAGING_BUFFERS
from chunkjax.schedule import STORAGE_UPDATE
from chunkjax.storage.files import _CHUNK_RE, clear_run
from chunkjax.storage.pool import SKIP_STEP
from chunkjax.storage.trainer import validate_storage_dirs
from chunkjax.storage.worker import exit_if_spawned_import
from chunkjax.updaters import Updater

__all__ = ["DiskState", "StorageOptions", "StorageRun", "check_step", "check_storage_inputs", "close_storage",
           "disk_capacity", "gradient_order", "storage_chunks", "storage_options", "storage_updater", "updates_early",
           "updaters_of", "wait_tail"]


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """The disk tier of a step.

    Attributes:
      dirs: one directory per storage device (created if missing); storage chunk ``k`` (the k-th
        storage chunk in id order) lives in ``dirs[k % len(dirs)]``.
      compression: None (dense bf16 gradients to the workers) or ``"topk"`` (Smart-Infinity's
        top-k compression: results then differ from optax).
      topk_ratio: fraction of each chunk's gradient entries sent with ``"topk"``.
      timeout_s: longest wait on one worker, seconds (a worker silent longer is stopped and the
        step fails with :class:`~chunkjax.storage.files.StorageError`).
      io_mode: ``"auto"`` (O_DIRECT where the filesystem allows), ``"direct"`` or ``"buffered"``.
      fsync: fsync files and manifests at each commit.
      keep_previous: keep the last committed step's files until the next step commits (a failed
        step leaves the directories at the last committed step; twice the state on disk during a
        step). False: half the disk (each chunk's old file goes once its new one is written), but a
        failed step leaves the directories at no complete step: resume from a step checkpoint.
      staging_buffers: staging buffers per worker (>= 3), each one chunk file (master, m, v:
        :func:`chunkjax.predict.disk_file_bytes`): the bound of the read-ahead. A worker reads
        ``staging_buffers - 1`` chunks before the step's gradients and norm exist, the rest as
        the update frees buffers. Host memory: ``n_dirs * staging_buffers`` chunk files (the
        plan counts :data:`chunkjax.predict.STORAGE_STAGING_BUFFERS`).
      early_updates: on a norm-free step (:func:`updates_early`) send each chunk's gradient as
        the program completing it ends (else after the backward, as a clipped step does).

    Raises:
      ValueError: no directory, one given twice, a file, or not writable (one line).
    """

    dirs: tuple[str, ...]
    compression: str | None = None
    topk_ratio: float = 0.01
    timeout_s: float = 300.0
    io_mode: str = "auto"
    fsync: bool = True
    keep_previous: bool = True
    staging_buffers: int = STORAGE_STAGING_BUFFERS
    early_updates: bool = True

    @property
    def disk_versions(self) -> int:
        """Versions of each chunk file on disk during a step (the planner's disk bound)."""
        return 2 if self.keep_previous else 1

    def __post_init__(self):
        validate_storage_dirs(list(self.dirs))
        object.__setattr__(self, "dirs", tuple(os.fspath(d) for d in self.dirs))
        if self.compression not in (None, "topk"):
            raise ValueError(f"compression must be None or 'topk', got {self.compression!r}")
        if int(self.staging_buffers) < 3:
            raise ValueError(f"staging_buffers={self.staging_buffers}: a worker needs >= 3 (read k+1, update k, "
                             "write k-1)")


def storage_options(storage) -> StorageOptions | None:
    """``storage`` as :class:`StorageOptions`: None, a :class:`StorageOptions`, a comma-separated
    string of directories (``"/nvme0/cj,/nvme1/cj"``) or a sequence of directories. In a
    spawned process still importing the main script (no ``__main__`` guard: the workers'
    processes) this exits quietly (:func:`chunkjax.storage.worker.exit_if_spawned_import`)."""
    if storage is not None:
        exit_if_spawned_import()
    if storage is None or isinstance(storage, StorageOptions):
        return storage
    if isinstance(storage, (str, os.PathLike)):
        storage = [d for d in os.fspath(storage).split(",") if d]
    return StorageOptions(tuple(storage))


def check_storage_inputs(storage: StorageOptions | None, host_optimizer, host_budget, n_ranks: int) -> None:
    """What the disk tier needs of a fit (:func:`chunkjax.fit.prepare`), in the caller's terms:
    a host optimizer (the storage chunks update on the host's kernels), a host budget (the
    planner moves chunks to disk until the host fits it) and one device.

    Raises:
      ValueError: one line saying what to pass.
    """
    if storage is None:
        return
    if host_optimizer is None:
        raise ValueError("the disk tier updates on the host: pass a host optimizer such as "
                         "chunkjax.host_update.AdamW(...) as tx, and a host_budget")
    if n_ranks != 1:
        raise ValueError("the disk tier plans one device: pass no mesh (or no storage)")
    if host_budget is None:
        raise ValueError("the disk tier needs a host budget: pass host_budget='64GiB' (what the host may hold) "
                         "or host_budget='auto'")


def disk_capacity(options: StorageOptions) -> tuple[int, int]:
    """``(storage devices, bytes they may hold)`` of the directories: distinct filesystems
    (``st_dev`` of each directory, or of its nearest existing parent) and their free bytes
    (``statvfs``) plus the bytes of a previous run's files there (:meth:`DiskState` replaces them)."""
    devs: dict[int, int] = {}
    old = 0
    for d in options.dirs:
        probe = os.path.abspath(d)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        st = os.statvfs(probe)
        devs[os.stat(probe).st_dev] = st.f_bavail * st.f_frsize
        if os.path.isdir(d):
            old += sum(e.stat().st_size for e in os.scandir(d) if _CHUNK_RE.match(e.name))
    return len(devs), int(sum(devs.values()) + old)


class DiskState:
    """The master params and AdamW moments of a step's storage chunks: a
    :class:`~chunkjax.storage.near.NearStorageOptimizer` over the storage directories, held in
    ``TrainState.master[c]`` of every storage chunk ``c`` (its ``opt_state[c]`` is None).
    A pytree node without leaves (not array data).

    Attributes:
      opt: the optimizer (its workers own the chunk files).
      chunk_ids: the step's storage chunks, in id order (the optimizer's chunk k is ``chunk_ids[k]``).
      last: the :class:`~chunkjax.storage.trainer.StepResult` of the last committed update (disk
        bytes per directory, shared-link bytes, seconds), None before.
      history: every committed update's :class:`~chunkjax.storage.trainer.StepResult`, in order.
      tail: the future of the last step's disk work (its last writes and the commit run on
        while the next step's forward runs); :meth:`wait` joins it.
      sent_before_norm: chunks of the last step whose gradients went to the workers before the
        global norm was known (the norm-free early path; 0 otherwise).
      exposed_s: per committed step, seconds from the moment every gradient and the norm were
        handed over to the moment the last new params were back (what the next step waits for:
        :attr:`chunkjax.cost.PipelinedStepTime.storage_exposed_s`).
      closed: :meth:`close` stopped the workers; a step or a read then raises StorageError.
    """

    def __init__(self, opt, chunk_ids: Sequence[int]):
        self.opt, self.chunk_ids = opt, tuple(chunk_ids)
        self.local = {c: k for k, c in enumerate(self.chunk_ids)}
        self.last = None
        self.history: list = []
        self.tail: concurrent.futures.Future | None = None
        self.sent_before_norm = 0
        self.exposed_s: list[float] = []
        self.closed = False

    def check_open(self) -> None:
        """StorageError (one line, :data:`CLOSED`) once :meth:`close` stopped the workers."""
        if self.closed:
            from chunkjax.storage.files import StorageError
            raise StorageError(CLOSED)

    def wait(self) -> None:
        """Wait for the last step's disk work (writes, commit); re-raise its
        :class:`~chunkjax.storage.files.StorageError`."""
        if self.tail is not None:
            self.tail.result()

    @property
    def committed_step(self) -> int:
        """The last step every worker committed (= the AdamW step count); waits for the last step."""
        self.wait()
        return self.opt.committed_step

    def read(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``c``'s (master, m, v), (chunk_size,) float32 copies at the committed step (after
        the last step's disk work). Raises StorageError once closed."""
        self.check_open()
        self.wait()
        return self.opt.read_chunk(self.local[c])

    def close(self) -> None:
        """Stop the workers (the committed state stays in the files); a failed last step's error
        is not raised here.

        The last step's disk work (:attr:`tail`) is waited for at most the optimizer's
        ``timeout_s`` (:attr:`StorageOptions.timeout_s`, the tier's bound on every wait). Work
        still running then (a hung worker, or a step that failed before handing over its
        gradients) is not waited for again: the workers are killed, so that nothing hangs the
        process at exit, and a :class:`RuntimeWarning` says so in one line (the directories stay
        at the last committed step)."""
        if self.tail is not None and not concurrent.futures.wait([self.tail], timeout=self.opt.timeout_s).done:
            err = self.opt.stop(_MSG_CLOSE_HUNG.format(s=self.opt.timeout_s, pids=self.opt.worker_pids))
            warnings.warn(f"chunkjax: {err}", RuntimeWarning, stacklevel=2)
        self.closed = True
        self.opt.close()


#: :meth:`DiskState.close`'s warning (then the pool's last committed step and resume advice).
_MSG_CLOSE_HUNG = ("DiskState.close: the last step's disk work (its gradients, writes and commit) did not end "
                   "within timeout_s={s:g} s, so its near-storage workers (pids {pids}) were killed "
                   "(StorageOptions(timeout_s=...) raises the bound for slow disks)")


jax.tree_util.register_pytree_node(DiskState, lambda d: ((), d), lambda d, _: d)


def storage_chunks(step) -> tuple[int, ...]:
    """The chunks a :class:`chunkjax.ChunkedStep`'s schedule updates ``storage``."""
    if step.schedule is None:
        return ()
    return tuple(c for c, u in enumerate(step.schedule.update_locations) if u == STORAGE_UPDATE)


def check_step(step) -> None:
    """Raise ValueError (one line) unless a step with storage chunks can run them: storage
    options given, an AdamW host kernel spec, bf16 compute params, one device, no loss scaling.
    Sets ``step.storage`` to its :class:`StorageOptions` (the step's ``__post_init__``)."""
    object.__setattr__(step, "storage", storage_options(step.storage))
    if not storage_chunks(step):
        return
    why = ("no storage directories: pass storage=[dir, ...]" if step.storage is None else
           "the storage tier runs AdamW: pass host_optimizer=chunkjax.host_update.AdamW(...)"
           if not isinstance(step.host_optimizer, AdamW) else
           "the storage workers return bf16 or float32 params: use compute_dtype=jnp.bfloat16 or jnp.float32"
           if jnp.dtype(step.compute_dtype) not in (jnp.bfloat16, jnp.float32) else
           "the storage tier runs on one device: plan without a mesh" if step.mesh is not None else
           "the storage tier has no fp16 loss scaling: use bf16 without loss_scaling" if step.loss_scaling else None)
    if why:
        raise ValueError(f"the schedule updates {len(storage_chunks(step))} chunk(s) on storage: {why}")


def updaters_of(step) -> dict:
    """``{"storage": the updater}`` of a step with storage chunks, else ``{}``."""
    ids = storage_chunks(step)
    return {STORAGE_UPDATE: storage_updater(step.storage, ids, step.layout.chunk_size, step.host_optimizer,
                                            step.topology, step.compute_dtype)} if ids else {}


def storage_updater(options: StorageOptions, chunk_ids: Sequence[int], chunk_size: int, spec: AdamW,
                    topology, compute_dtype=jnp.bfloat16) -> Updater:
    """The ``storage`` location's :class:`~chunkjax.updaters.Updater`.

    ``init(buf, c, moments=None, count=0) -> (DiskState, None)``: streams chunk ``c``'s (chunk_size,)
    float32 master params ``buf`` (and ``moments = (m, v)``, None: zeros) to its worker; the first
    storage chunk (in id order) first clears the directories of a previous run and starts the
    workers, the last one commits step ``count`` (0: a fresh run; a checkpoint's step count on a
    restore). Chunks must come in id order. ``wait=False``: ``init`` returns as soon as the
    previous chunk's message has gone (one in flight: its file is written while the caller builds
    the next chunk); ``buf`` and the moments must then stay unchanged until the next storage
    chunk's ``init`` (the last one waits for every worker's commit).

    ``update(state, grads, norm) -> seconds``: one AdamW step of every storage chunk with the
    global gradient norm ``norm`` (a () float32 jax array or float: clipping and the non-finite
    skip as the host tier's, :func:`chunkjax.kernels.clip_scale`); ``grads``: ``{c: (chunk_size,)
    gradient}`` (compute dtype; pinned-host jax arrays or numpy); the new params (bf16, or
    float32 for float32 compute params) go into
    ``state.params[c]``'s pinned buffer as each arrives. Returns the update's wall seconds.

    ``init.close()`` stops the workers of the last ``init`` (:meth:`DiskState.close`; nothing when
    none were started): :func:`close_storage`.

    Raises:
      StorageError: a worker died, stopped answering or failed (a full disk); the files stay at
        the last committed step.
    """
    from chunkjax.storage.near import NearStorageOptimizer
    ids = tuple(sorted(chunk_ids))
    f32 = jnp.dtype(compute_dtype) == jnp.float32
    box: dict = {}

    def init(buf, c, moments=None, count: int = 0, wait: bool = True):
        if c == ids[0]:
            old = box.pop("disk", None)
            if old is not None:
                old.close()
            for d in options.dirs:
                clear_run(d)
            opt = NearStorageOptimizer(list(options.dirs), [chunk_size] * len(ids), spec, init_state="stream",
                                       compression=options.compression, topk_ratio=options.topk_ratio,
                                       io_mode=options.io_mode, fsync=options.fsync, timeout_s=options.timeout_s,
                                       param_dtype="float32" if f32 else "bfloat16",
                                       keep_previous=options.keep_previous, n_buffers=int(options.staging_buffers))
            opt.resume_advice = STEP_RESUME
            box["disk"] = DiskState(opt, ids)
            opt.begin_init(int(count))
        disk = box["disk"]
        m, v = (None, None) if moments is None else moments
        disk.opt.init_chunk(disk.local[c], buf, m, v, wait=wait)
        if c == ids[-1]:
            disk.opt.end_init()
        return disk, None

    def update(state):
        """The params writer of one step call: ``on_param(k, bits)`` puts the optimizer's chunk
        ``k``'s new params into ``state.params[chunk_ids[k]]``'s pinned buffer."""
        def on_param(k, bits):
            np.copyto(topology.param_views(state.params[ids[k]], 0, np.float32 if f32 else np.uint16)[0], bits)
        return on_param

    def close() -> None:
        disk = box.pop("disk", None)
        if disk is not None:
            disk.close()

    init.close = close
    return Updater(init, update)


def close_storage(step) -> None:
    """Stop the near-storage workers of ``step``'s storage chunks (a :class:`chunkjax.ChunkedStep`
    or the step :func:`chunkjax.offload` returns; nothing without storage chunks, before its
    ``init`` or when closed already). The committed state stays in the files; the state's
    :class:`DiskState` is then closed: a later step, ``sync``, ``master_params`` or checkpoint save
    raises StorageError (one line, :data:`CLOSED`) until a checkpoint restore (or a new
    ``step.init``) starts new workers. Call it when a run ends, on every path
    (``try``/``finally``), after the last sync or save: the step holds the workers until then, and
    only a later garbage collection would stop them. A failed last step's error is not raised here
    (``step.wait`` raises it)."""
    if not hasattr(step, "updaters") and hasattr(step, "step"):
        step = step.step  # the front door's OffloadedStep: its ChunkedStep
    u = step.updaters.get(STORAGE_UPDATE) if storage_chunks(step) else None
    if u is not None:
        u.init.close()


def gradient_order(step) -> tuple[int, ...]:
    """The step's storage chunks in the order the backward completes their gradients (a chunk's
    gradient is complete once the backward of the first stage reading it is done; the backward
    runs the stages last to first), chunks no stage reads last: the order each worker reads and
    updates its chunks in."""
    first = step.first_reader
    return tuple(sorted(storage_chunks(step), key=lambda c: (0, -first[c], c) if c in first else (1, 0, c)))


def updates_early(step) -> bool:
    """Whether the storage chunks of ``step`` update as their gradients complete, before the global
    norm is known: the update provably does not read it (:func:`chunkjax.streamed.starts_early`:
    one device, one micro-batch, no non-finite skip or loss scaling, ``step.tx`` not
    :func:`chunkjax.streamed.needs_global_norm`), the host spec does not clip, and
    ``StorageOptions.early_updates`` without top-k (which selects over all gradients at once).
    Decided once per step (``step.storage_early``)."""
    return step.storage_early


#: What a storage failure of a :class:`chunkjax.ChunkedStep` (the front door's, a train job's)
#: tells to do: its device and host chunks are already past the step the disk holds, so the
#: step object cannot go on, and the directories alone cannot restart it.
STEP_RESUME = ("this step object cannot continue (its other chunks are past that step; save_checkpoint "
               "raises this too): restore your last checkpoint into a new step (chunkjax.restore_checkpoint; "
               "a train job: resume its run folder)")

#: What a step, sync, read or save of a state whose workers :func:`close_storage` stopped says.
CLOSED = ("the near-storage workers of this step were stopped by chunkjax.storage.updater.close_storage: "
          "call it after the last step, sync and save_checkpoint; to go on, restore a checkpoint into the step "
          "(chunkjax.restore_checkpoint starts new workers)")

_SKIP = object()  # the pairs' end of an abandoned norm-free step


class StorageRun:
    """One call of a step's ``storage`` update: started with the step, on a thread of its own.

    The thread first waits for the previous step's disk work (its last writes and commit ran on
    during this step's forward; a failure there is raised here), then starts the workers' reads
    of every storage chunk's state (read-ahead: each worker fills its staging buffers, in
    :func:`gradient_order`, while the forward and backward run, and with micro-batches the
    accumulation), then, once the global norm is known (:meth:`set_norm`), sends the scalars
    and each chunk's gradient (:meth:`send`); on the norm-free early path
    (:func:`updates_early`) each gradient goes as the program completing it ends
    (:meth:`on_program`). The new params go into the chunks' pinned params buffers as they come
    back; the step's pending work (``step.wait`` or the next step) joins until the last one is
    in, and the last writes and the commit run on (:attr:`DiskState.tail`, joined by
    ``step.wait``, a checkpoint and the next step's read-ahead).

    Without storage chunks every method does nothing (no thread is started).
    """

    def __init__(self, step, state):
        self.ids = storage_chunks(step)
        if not self.ids:
            return
        self.disk: DiskState = state.master[self.ids[0]]
        self.disk.check_open()  # before this step starts anything: the state stays as it was
        self.order = gradient_order(step)
        self.early = updates_early(step)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: set = set()
        self._before_norm = 0
        self._handed = float("inf")
        self._norm: concurrent.futures.Future = concurrent.futures.Future()
        self._params_in: concurrent.futures.Future = concurrent.futures.Future()
        done: concurrent.futures.Future = concurrent.futures.Future()
        prev, self.disk.tail = self.disk.tail, done
        on_param = step.updaters[STORAGE_UPDATE].update(state)
        threading.Thread(target=self._run, args=(prev, done, on_param), name="chunkjax-storage-update",
                         daemon=True).start()

    def _pairs(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item is _SKIP:
                yield SKIP_STEP
                return
            yield self.disk.local[item[0]], item[1]

    def _run(self, prev, done, on_param) -> None:
        params_in = self._params_in
        try:
            if prev is not None:
                prev.result()  # the previous step's writes and commit (the files' next step starts after)
            opt = self.disk.opt
            opt.begin([self.disk.local[c] for c in self.order], norm_free=self.early)
            norm = None
            if not self.early:
                norm = self._norm.result()
                if norm is None:  # the step failed before its norm: nothing of it is written
                    opt.abandon()
                    params_in.set_result(0.0)
                    done.set_result(0.0)
                    return
                norm = float(np.float32(norm))  # waits for the step's norm (clip_scale rounds it in float32)
            t0 = time.perf_counter()
            t_in = []

            def arrived():
                t_in.append(time.perf_counter())
                params_in.set_result(t_in[0] - t0)

            pairs = self._pairs() if opt.compression is None else {c: g for c, g in self._pairs()}  # top-k: all at once
            res = opt.finish(pairs, norm=norm, on_param=on_param, on_params_in=arrived)
            if not res.skipped:
                self.disk.last = res
                self.disk.history.append(res)
                self.disk.exposed_s.append(max(0.0, t_in[0] - max(t0, self._handed)) if t_in else 0.0)
            self.disk.sent_before_norm = self._before_norm
        except BaseException as e:  # handed to the step's pending work and to the tail's joiners
            if not params_in.done():
                params_in.set_exception(e)
            done.set_exception(e)
            return
        if not params_in.done():
            params_in.set_result(float(res.update_s))
        done.set_result(float(res.update_s))

    def sends_early(self, grads: dict) -> bool:
        """Whether :meth:`on_program` would send a gradient of ``grads`` (``{c: gradient}``) now:
        the early path, a storage chunk not sent yet (its worker then updates it before the norm,
        and its new params land in the state's pinned buffer)."""
        return bool(self.ids) and self.early and any(c in grads and c not in self._sent for c in self.ids)

    def on_program(self, grads: dict) -> None:
        """After a program (one micro-batch): on the early path, its completed storage chunks'
        gradients ``{c: gradient}`` go to their workers now."""
        if not self.ids or not self.early:
            return
        for c in self.order:
            if c in grads and c not in self._sent:
                self._sent.add(c)
                self._before_norm += 1
                self._queue.put((c, grads[c]))

    def set_norm(self, norm) -> None:
        """The step's global gradient norm (a () float32 jax array; None: the step failed, its
        storage update is abandoned)."""
        if not self.ids:
            return
        if not self._norm.done():
            self._norm.set_result(norm)
        if norm is None and self.early:
            self._queue.put(_SKIP)

    def send(self, work, grads: dict) -> None:
        """Hand over every storage chunk's gradient not sent yet (``grads``: ``{c: gradient}``) and
        add the wait for their new params to ``work`` (the step's
        :class:`chunkjax.updaters.HostWork`: joined by ``step.wait`` or the next step, which
        re-raise a :class:`~chunkjax.storage.files.StorageError`)."""
        if not self.ids:
            return
        for c in self.order:
            if c not in self._sent:
                self._sent.add(c)
                self._queue.put((c, grads[c]))
        self._handed = time.perf_counter()
        self._queue.put(None)
        work.submit(self._params_in.result)
        work.watch(self.disk.opt.watch)  # a dead or stopped worker fails the wait early, named


def wait_tail(step, state) -> None:
    """Wait for the disk work of the step that returned ``state`` (:attr:`DiskState.tail`)."""
    ids = storage_chunks(step)
    if ids and isinstance(state.master[ids[0]], DiskState):
        state.master[ids[0]].wait()
