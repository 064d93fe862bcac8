"""The disk tier: optimizer state as chunk files sharded over storage directories.

When host memory cannot hold the fp32 master params and the Adam moments, they live on storage
(ZeRO-Infinity's NVMe offload; Smart-Infinity, Jang et al., HPCA 2024, arXiv 2403.06664).
:class:`DiskTier` runs one or more directories (the files, checksums and commit of each are
:mod:`chunkjax.storage.files`): asynchronous I/O on a thread pool, the fixed staging-buffer pool
(Smart-Infinity's *data transfer handler*, section "Data Transfer Handler"), the per-step
two-phase commit over the directories, byte accounting and the emulated bandwidth model
(:mod:`chunkjax.storage.links`). No JAX dependency.

The staging pool has ``n_buffers`` buffers (default 3) of one size, the largest chunk file, fixed at
construction: memory stays the same whatever the number of chunks (the model size). With three
buffers, :meth:`DiskTier.update` overlaps the read of chunk k+1, the update of chunk k (the
caller's function, in place in the staging buffer) and the write of chunk k-1.

Bytes actually passed to ``pread``/``pwrite`` (padded sections included) are counted per
directory, per step and in total; with a :class:`~chunkjax.storage.links.LinkModel` rate set,
results are an emulation and are labelled ``emulated: True``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import queue
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from chunkjax.storage.files import STATE_DTYPE, StorageError, _Shard, aligned_empty, committed_step, section_bytes
from chunkjax.storage.links import Link, LinkModel


class _StagingPool:
    """``count`` aligned uint8 buffers of ``nbytes`` each, allocated once and reused."""

    def __init__(self, count: int, nbytes: int):
        self.buffers = [aligned_empty(nbytes) for _ in range(count)]
        self.nbytes = nbytes
        self.reset()

    def reset(self):
        self._free = queue.SimpleQueue()
        for b in self.buffers:
            self._free.put(b)

    def acquire(self) -> np.ndarray:
        return self._free.get()

    def release(self, b: np.ndarray):
        self._free.put(b)


# ----------------------------------------------------------------------------------------------
# The tier.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepIO:
    """Bytes moved by one step, per directory (keys are the directory paths).

    Attributes:
      read: bytes read from each directory (padded sections included).
      written: bytes written to each directory.
      seconds: wall time of the step's I/O pipeline (read, update, write), in seconds.
      emulated: True when a :class:`LinkModel` rate throttled the links.
    """

    read: dict[str, int]
    written: dict[str, int]
    seconds: float
    emulated: bool

    @property
    def total(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


#: I/O threads of a :class:`DiskTier` (the near-storage workers' default): the most chunk files
#: written at once, each beside its committed file until written (``keep_previous=False``), which
#: the planner counts in the disk budget (:func:`chunkjax.plan_disk.place_on_disk`).
IO_THREADS = 2


class DiskTier:
    """Chunked optimizer state on one or more storage directories, with a crash-safe step commit.

    The ZeRO-Infinity baseline runs the update in the calling process (read state into host
    staging buffers, update on the host, write back); a near-storage worker
    (:mod:`chunkjax.storage.worker`) opens a tier over its own directory only.

    Args:
      dirs: the directories this tier opens (created if missing), one per storage device.
      chunk_sizes: ``{chunk_id: n_elements}`` (or a sequence, indexed by chunk id) of the chunks
        stored in ``dirs``; chunk ``c`` lives in global directory ``c % n_dirs_total``.
      n_kinds: float32 tensors per chunk (3 for AdamW: master, m, v).
      dir_indices: global index of each of ``dirs`` (default ``0..len(dirs)-1``).
      n_dirs_total: number of directories of the whole tier (default ``len(dirs)``).
      n_buffers: staging buffers (>= read_ahead + 2; 3 overlaps read k+1, update k, write k-1;
        more let more writes be in flight). Each is as large as the largest chunk file:
        ``n_kinds * section_bytes(max chunk size)`` bytes.
      read_ahead: chunks read ahead of the one being updated (default 1). With several
        directories, more buffers (writes in flight) helped and deeper read-ahead did not: under
        an emulated 3 MB/s per directory and 16 MB/s shared (32 chunks, 4 directories, bound
        1.05 s) one step took 1.46 s with 3 buffers, 1.13 s with 6, and 1.6-2.0 s with 6-18
        buffers and read-ahead n_buffers - 2 (reads queue ahead of writes on each link).
      io_threads: threads running reads and writes (:data:`IO_THREADS`): with ``keep_previous=False``
        at most this many new chunk files are on disk beside their committed ones at once.
      io_mode: 'auto' (O_DIRECT where the filesystem allows, else buffered), 'direct', 'buffered'.
      link_model: emulated rates; ``disk_bytes_per_s`` throttles each directory, and
        ``shared_bytes_per_s`` (if set) throttles all directories' traffic together (the
        baseline's host <-> storage link). Use None (the default) for unthrottled real I/O.
      fsync: fsync data files, manifests and directories at commit (crash safety against power loss).
      target_step: recover to this step (:mod:`chunkjax.storage.files`); default: the smallest
        committed step over ``dirs``.
      verify: on a committed run (a resume), read every chunk file once and check its CRC-32 before
        returning (one read of the state); every later read is checked either way.
      keep_previous: keep the last committed step's files until the step after it commits (crash
        safe, twice the state on disk during a step); False: delete each chunk's committed file
        once its new one is written (the state once on disk; a failed step leaves no complete
        step: :mod:`chunkjax.storage.files`).

    Raises:
      StorageError: directories from another run, partly initialised, not recoverable, or a chunk
        file whose checksum does not match (one line naming the file).
      ValueError: a chunk is not stored in ``dirs``, or bad arguments.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes: Mapping[int, int] | Sequence[int], *, n_kinds: int = 3,
                 dir_indices: Sequence[int] | None = None, n_dirs_total: int | None = None, n_buffers: int = 3,
                 read_ahead: int = 1,
                 io_threads: int = IO_THREADS, io_mode: str = "auto", link_model: LinkModel | None = None,
                 fsync: bool = True, target_step: int | None = None, verify: bool = True, keep_previous: bool = True):
        dirs = [os.fspath(d) for d in dirs]
        if not dirs:
            raise ValueError("DiskTier needs at least one directory")
        if read_ahead < 1 or n_buffers < read_ahead + 2:
            raise ValueError(f"need read_ahead >= 1 and n_buffers >= read_ahead + 2, got {read_ahead}, {n_buffers}")
        self.read_ahead = int(read_ahead)
        sizes = dict(chunk_sizes) if isinstance(chunk_sizes, Mapping) else dict(enumerate(chunk_sizes))
        if not sizes or any(int(n) < 1 for n in sizes.values()):
            raise ValueError("chunk_sizes must be non-empty and every chunk size >= 1")
        dir_indices = list(range(len(dirs))) if dir_indices is None else list(dir_indices)
        n_total = len(dirs) if n_dirs_total is None else int(n_dirs_total)
        self.link_model = link_model or LinkModel()
        self.shared_link = Link(self.link_model.shared_bytes_per_s, "shared")
        local = {g: i for i, g in enumerate(dir_indices)}
        per_dir: list[dict[int, int]] = [{} for _ in dirs]
        for c, n in sizes.items():
            g = int(c) % n_total
            if g not in local:
                raise ValueError(f"chunk {c} belongs to directory {g} of {n_total}, which this tier does not open")
            per_dir[local[g]][int(c)] = int(n)
        shared = self.shared_link if self.link_model.shared_bytes_per_s is not None else None
        self.shards = [_Shard(d, g, n_total, per_dir[i], n_kinds, io_mode, fsync,
                              Link(self.link_model.disk_bytes_per_s, f"disk{g}"), shared, keep_previous)
                       for i, (d, g) in enumerate(zip(dirs, dir_indices))]
        self._shard_of = {c: s for s in self.shards for c in s.sizes}
        self.chunk_sizes = {int(c): int(n) for c, n in sorted(sizes.items())}
        self.n_kinds = n_kinds
        target = committed_step(dirs) if target_step is None else target_step
        for s in self.shards:
            s.open(target)
        self._step = target
        self._pool = _StagingPool(n_buffers, max(s.file_bytes(c) for s in self.shards for c in s.sizes))
        self._exec = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="disk_tier")
        self._prepared: int | None = None
        self.last_step_io: StepIO | None = None
        if verify and target is not None:
            buf = self._pool.acquire()
            try:
                for s in self.shards:
                    s.verify(buf)
            except BaseException:
                self._exec.shutdown(wait=True)
                raise
            finally:
                self._pool.release(buf)

    # -- properties --------------------------------------------------------------------------
    @property
    def dirs(self) -> list[str]:
        return [s.path for s in self.shards]

    @property
    def committed_step(self) -> int | None:
        """The last committed step (0 after :meth:`initialize`), None before."""
        return self._step

    @property
    def io_mode(self) -> dict[str, str]:
        """'direct' or 'buffered', per directory."""
        return {s.path: s.io_mode for s in self.shards}

    @property
    def staging_bytes(self) -> int:
        """Host memory of the staging pool (fixed at construction), bytes."""
        return len(self._pool.buffers) * self._pool.nbytes

    @property
    def bytes_read(self) -> dict[str, int]:
        """Total bytes read per directory since construction."""
        return {s.path: s.read_bytes for s in self.shards}

    @property
    def bytes_written(self) -> dict[str, int]:
        """Total bytes written per directory since construction."""
        return {s.path: s.written_bytes for s in self.shards}

    def _views(self, c: int, buf: np.ndarray) -> tuple[np.ndarray, ...]:
        n, sec = self.chunk_sizes[c], section_bytes(self.chunk_sizes[c])
        return tuple(buf[i * sec:i * sec + n * STATE_DTYPE.itemsize].view(STATE_DTYPE) for i in range(self.n_kinds))

    # -- writing -----------------------------------------------------------------------------
    def initialize(self, values: Callable[[int], np.ndarray] | Mapping[int, np.ndarray] | Sequence[np.ndarray],
                   step: int = 0):
        """Write and commit step ``step`` (default 0, a fresh run; a restored checkpoint's step
        otherwise). ``values[c]`` (or ``values(c)``, called once per chunk in id order, so a
        caller can stream chunks one at a time) is either an (n_c,) float32-convertible array,
        the first kind (master), the other kinds zero; or a tuple of ``n_kinds`` such arrays
        (master, m, v), every kind given.

        Raises:
          StorageError: already initialised, or a write failed (nothing is committed then).
          ValueError: a tuple of another length than ``n_kinds``, or ``step < 0``.
        """
        if self._step is not None:
            raise StorageError(f"{self.dirs} already hold committed step {self._step}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        get = values if callable(values) else (lambda c: values[c])

        def fill(c, views):
            x = get(c)
            kinds = x if isinstance(x, tuple) else (x,)
            if len(kinds) > len(views):
                raise ValueError(f"chunk {c}: {len(kinds)} arrays given, the tier holds {len(views)} kinds")
            if isinstance(x, tuple) and len(kinds) != len(views):
                raise ValueError(f"chunk {c}: a tuple of {len(kinds)} arrays given, the tier holds {len(views)} kinds")
            for v, a in zip(views, kinds):
                v[:] = np.asarray(a, STATE_DTYPE).reshape(-1)
            for v in views[len(kinds):]:
                v[:] = 0

        self._pipeline(step, fill, read=False)
        for s in self.shards:
            s.initialize_manifest(step)
        self._step = step

    def update(self, fn: Callable[[int, tuple[np.ndarray, ...]], None], *, chunk_ids: Iterable[int] | None = None,
               commit: bool = True) -> StepIO:
        """One step ``committed_step + 1``: for each chunk (in ``chunk_ids`` order, default all in id
        order) read its file into a staging buffer, call ``fn(c, (master, m, v))`` with (n_c,)
        float32 views that ``fn`` updates in place, and write the result as the new step's file.
        Reads of chunk k+1 and writes of chunk k-1 run on the I/O threads while ``fn`` runs.

        With ``commit=False`` the step is only prepared; :meth:`commit` or :meth:`abort` ends it
        (two-phase commit across processes). Starting a step first drops the previous step's
        files: call it only once every directory of the whole tier has committed.

        Returns:
          the step's :class:`StepIO` (also in ``last_step_io``).

        Raises:
          StorageError: a read or write failed (e.g. a full disk); the step's new files are deleted
            and every directory stays at the last committed step.
        """
        if self._step is None:
            raise StorageError(f"{self.dirs} are not initialised: call initialize() first")
        if self._prepared is not None:
            raise StorageError(f"step {self._prepared} is prepared but neither committed nor aborted")
        for s in self.shards:
            s._drop_prev()
        step = self._step + 1
        io = self._pipeline(step, fn, read=True, chunk_ids=chunk_ids)
        self._prepared = step
        if commit:
            self.commit()
        return io

    def _pipeline(self, step, fn, *, read: bool, chunk_ids=None) -> StepIO:
        ids = list(self.chunk_sizes) if chunk_ids is None else [int(c) for c in chunk_ids]
        r0, w0 = self.bytes_read, self.bytes_written
        t0 = time.perf_counter()
        pool, ex = self._pool, self._exec
        reads: collections.deque = collections.deque()
        writes: list[concurrent.futures.Future] = []
        it = iter(ids)

        def read_job(c, buf):
            self._shard_of[c].read_into(c, buf)

        def write_job(c, buf):
            try:
                self._shard_of[c].write_from(c, step, buf)
            finally:
                pool.release(buf)

        def submit_next():
            c = next(it, None)
            if c is not None:
                buf = pool.acquire()
                reads.append((c, buf, ex.submit(read_job, c, buf) if read else None))

        # Read-ahead depth <= n_buffers - 2, so that one buffer is always left for a write to
        # finish into: acquire() can then only wait on a write, never deadlock.
        depth = self.read_ahead
        try:
            for _ in range(depth):
                submit_next()
            while reads:
                c, buf, fut = reads.popleft()
                submit_next()  # read k+depth while chunk k is updated and k-1 written
                if fut is not None:
                    fut.result()
                fn(c, self._views(c, buf))
                writes.append(ex.submit(write_job, c, buf))
                for w in writes:
                    if w.done() and w.exception() is not None:
                        raise w.exception()
            for w in writes:
                w.result()
        except BaseException:
            concurrent.futures.wait([f for _, _, f in reads if f is not None] + writes)
            for s in self.shards:
                s.abort()
            pool.reset()
            raise
        rd, wr = self.bytes_read, self.bytes_written
        io = StepIO({d: rd[d] - r0[d] for d in rd}, {d: wr[d] - w0[d] for d in wr}, time.perf_counter() - t0,
                    self.link_model.emulated)
        self.last_step_io = io
        return io

    def commit(self):
        """Commit the prepared step in every directory of this tier (manifest replace)."""
        if self._prepared is None:
            raise StorageError("no prepared step to commit")
        for s in self.shards:
            s.commit(self._prepared)
        self._step, self._prepared = self._prepared, None

    def abort(self):
        """Discard the prepared step's files; the committed step stays."""
        for s in self.shards:
            s.abort()
        self._prepared = None

    # -- reading -----------------------------------------------------------------------------
    def read_chunk(self, c: int) -> tuple[np.ndarray, ...]:
        """Copies of chunk ``c``'s tensors at the committed step: ``n_kinds`` (n_c,) float32 arrays."""
        if self._step is None:
            raise StorageError(f"{self.dirs} are not initialised")
        buf = self._pool.acquire()
        try:
            self._shard_of[c].read_into(c, buf)
            return tuple(v.copy() for v in self._views(c, buf))
        finally:
            self._pool.release(buf)

    def close(self):
        """Stop the I/O threads (a prepared, uncommitted step stays uncommitted)."""
        self._exec.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
