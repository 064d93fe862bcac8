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
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.kernels import AdamW
from chunkjax.schedule import STORAGE_UPDATE
from chunkjax.storage.files import _CHUNK_RE, clear_run
from chunkjax.storage.trainer import validate_storage_dirs
from chunkjax.updaters import Updater

__all__ = ["DiskState", "StorageOptions", "check_step", "disk_capacity", "start_update", "storage_chunks",
           "storage_options", "storage_updater", "updaters_of"]


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

    @property
    def disk_versions(self) -> int:
        """Versions of each chunk file on disk during a step (the planner's disk bound)."""
        return 2 if self.keep_previous else 1

    def __post_init__(self):
        validate_storage_dirs(list(self.dirs))
        object.__setattr__(self, "dirs", tuple(os.fspath(d) for d in self.dirs))
        if self.compression not in (None, "topk"):
            raise ValueError(f"compression must be None or 'topk', got {self.compression!r}")


def storage_options(storage) -> StorageOptions | None:
    """``storage`` as :class:`StorageOptions`: None, a :class:`StorageOptions`, a comma-separated
    string of directories (``"/nvme0/cj,/nvme1/cj"``) or a sequence of directories."""
    if storage is None or isinstance(storage, StorageOptions):
        return storage
    if isinstance(storage, (str, os.PathLike)):
        storage = [d for d in os.fspath(storage).split(",") if d]
    return StorageOptions(tuple(storage))


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
      last: the :class:`~chunkjax.storage.trainer.StepResult` of the last update (disk bytes per
        directory, shared-link bytes, seconds), None before.
    """

    def __init__(self, opt, chunk_ids: Sequence[int]):
        self.opt, self.chunk_ids = opt, tuple(chunk_ids)
        self.local = {c: k for k, c in enumerate(self.chunk_ids)}
        self.last = None

    @property
    def committed_step(self) -> int:
        """The last step every worker committed (= the AdamW step count)."""
        return self.opt.committed_step

    def read(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``c``'s (master, m, v), (chunk_size,) float32 copies at the committed step."""
        return self.opt.read_chunk(self.local[c])

    def close(self) -> None:
        """Stop the workers (the committed state stays in the files)."""
        self.opt.close()


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
    restore). Chunks must come in id order.

    ``update(state, grads, norm) -> seconds``: one AdamW step of every storage chunk with the
    global gradient norm ``norm`` (a () float32 jax array or float: clipping and the non-finite
    skip as the host tier's, :func:`chunkjax.kernels.clip_scale`); ``grads``: ``{c: (chunk_size,)
    gradient}`` (compute dtype; pinned-host jax arrays or numpy); the new params (bf16, or
    float32 for float32 compute params) go into
    ``state.params[c]``'s pinned buffer as each arrives. Returns the update's wall seconds.

    Raises:
      StorageError: a worker died, stopped answering or failed (a full disk); the files stay at
        the last committed step.
    """
    from chunkjax.storage.near import NearStorageOptimizer
    ids = tuple(sorted(chunk_ids))
    f32 = jnp.dtype(compute_dtype) == jnp.float32
    box: dict = {}

    def init(buf, c, moments=None, count: int = 0):
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
                                       keep_previous=options.keep_previous)
            box["disk"] = DiskState(opt, ids)
            opt.begin_init(int(count))
        disk = box["disk"]
        m, v = (None, None) if moments is None else moments
        disk.opt.init_chunk(disk.local[c], buf, m, v)
        if c == ids[-1]:
            disk.opt.end_init()
        return disk, None

    def update(state, grads: dict, norm) -> float:
        disk: DiskState = state.master[ids[0]]
        norm = float(np.float32(norm))  # waits for the step's norm (clip_scale rounds it in float32)

        def on_param(k, bits):
            np.copyto(topology.param_views(state.params[ids[k]], 0, np.float32 if f32 else np.uint16)[0], bits)

        res = disk.opt.step([grads[c] for c in ids], norm=norm, on_param=on_param)
        disk.last = res
        return float(res.update_s)

    return Updater(init, update)


def start_update(step, work, state, grads: dict, norm) -> None:
    """Start the storage chunks' update of one call of ``step`` on a thread of its own (beside
    the host thread's updates and the device's update programs) and hand its end to ``work``
    (the step's :class:`chunkjax.updaters.HostWork`: joined by ``step.wait`` or the next step,
    which re-raises a :class:`~chunkjax.storage.files.StorageError`)."""
    ids = storage_chunks(step)
    if not ids:
        return
    fut: concurrent.futures.Future = concurrent.futures.Future()
    mine = {c: grads[c] for c in ids}

    def run():
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(step.updaters[STORAGE_UPDATE].update(state, mine, norm))
            except BaseException as e:  # handed to work.join()
                fut.set_exception(e)

    threading.Thread(target=run, name="chunkjax-storage-update", daemon=True).start()
    work.submit(fut.result)
