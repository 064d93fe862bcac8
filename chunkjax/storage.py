"""The disk tier: optimizer state as chunk files sharded over storage directories.

When host memory cannot hold the fp32 master params and the Adam moments, they live on storage
(ZeRO-Infinity's NVMe offload; Smart-Infinity, Jang et al., HPCA 2024, arXiv 2403.06664). This
module is the CPU-side core of that tier: files, asynchronous I/O, the fixed staging-buffer pool
(Smart-Infinity's *data transfer handler*), a crash-safe per-step commit, byte accounting and an
emulated bandwidth model. It has no JAX dependency (the near-storage workers of
:mod:`chunkjax.near_storage` run it).

File layout
-----------
Chunk ``c`` of ``n`` float32 elements belongs to directory ``c % n_dirs`` (one directory per
storage device). Each directory holds::

    manifest.json                      committed step, chunk sizes, file of each chunk
    chunk0000003.step000000012.bin     chunk 3 as written at step 12

One file per chunk per version holds the ``n_kinds`` tensors (``master | m | v`` for AdamW)
contiguously, each section padded to :data:`ALIGN` (4096) bytes so that ``O_DIRECT`` works::

    [master: n*4 bytes, zero padding to 4096k] [m: same] [v: same]

Commit scheme (crash safety)
----------------------------
A step never overwrites a committed file: step ``N`` writes ``chunkC.stepN.bin`` files beside the
committed ones (*prepare*), then ``manifest.json`` is replaced atomically (temp file, fsync,
``os.replace``, fsync of the directory) to point at them (*commit*). The manifest keeps the
previous step's file list (``prev``) until every directory has committed ``N``; the previous
files are deleted when the next step starts (*finalize*) or when the tier is reopened. On open,
the tier goes to the *recovery target* (the smallest committed step over all directories):
a directory that committed one step more rolls back to its ``prev`` list, and every chunk file
that the manifest does not name (an interrupted prepare) is deleted. So a failure at any moment
(full disk, killed process) leaves every shard readable at the last step that all directories
completed. Disk use is at most twice the state during a step, once the state in between.

I/O
---
A thread pool runs ``os.preadv`` / ``os.pwrite`` on whole chunk files. ``io_mode="auto"`` probes
each directory with an ``O_DIRECT`` open and aligned write and falls back to buffered I/O when the
filesystem refuses it (``EINVAL``, e.g. tmpfs); :attr:`DiskTier.io_mode` records the mode used per
directory. Buffers are 4096-byte aligned in either mode.

The staging pool has ``n_buffers`` buffers (default 3) of one size, the largest chunk file, fixed at
construction: memory stays the same whatever the number of chunks (the model size). With three
buffers, :meth:`DiskTier.update` overlaps the read of chunk k+1, the update of chunk k (the
caller's function, in place in the staging buffer) and the write of chunk k-1 (Smart-Infinity's
data transfer handler, section "Data Transfer Handler").

Accounting and the bandwidth model
----------------------------------
Bytes actually passed to ``pread``/``pwrite`` (padded sections included) are counted per
directory, per step and in total. A :class:`LinkModel` throttles links to given rates (bytes/s):
each transfer of ``b`` bytes on a link takes at least ``b / rate`` seconds, transfers on one link
are serialised (a link is one resource shared by whoever uses it). Results from throttled links
are an emulation and are labelled ``emulated: True``.

Errors: :class:`StorageError` (a full disk, an inconsistent or foreign directory, a dead worker).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

#: Alignment (bytes) of file sections, file offsets and staging buffers (O_DIRECT needs it).
ALIGN = 4096
#: The state dtype on storage (mixed-precision rule: fp32 master params and moments).
STATE_DTYPE = np.dtype(np.float32)
#: Tensor kinds of an AdamW chunk file, in file order.
ADAM_KINDS = ("master", "m", "v")
MANIFEST = "manifest.json"
FORMAT = "chunkjax.storage/1"
_CHUNK_RE = re.compile(r"^chunk(\d{7})\.step(\d{9})\.bin$")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

# Indirections so that tests can inject I/O faults (e.g. ENOSPC) without touching ``os``.
_pwrite = os.pwrite
_preadv = os.preadv


def _whole(op, mv: memoryview, short: str) -> None:
    """Call ``op(rest_of_mv, offset) -> bytes done`` until all of ``mv`` is read or written (pread
    and pwrite may do part); a call that does nothing raises ``OSError(EIO, short)``."""
    done = 0
    while done < len(mv):
        k = op(mv[done:], done)
        if k == 0:
            raise OSError(errno.EIO, short)
        done += k


class StorageError(RuntimeError):
    """A storage-tier failure with a one-line explanation: a full disk, a dead near-storage worker,
    an inconsistent directory. The committed state on storage is intact when it is raised."""


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def section_bytes(n: int) -> int:
    """Bytes of one tensor section of an ``n``-element float32 chunk in its file (padded to ALIGN)."""
    return _align_up(max(n, 1) * STATE_DTYPE.itemsize)


def chunk_file_name(chunk: int, step: int) -> str:
    return f"chunk{chunk:07d}.step{step:09d}.bin"


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised (nbytes,) uint8 array whose data pointer is a multiple of ``align``."""
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


# ----------------------------------------------------------------------------------------------
# Bandwidth model.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Emulated link rates in bytes/s (None: that link is not throttled).

    The paper's setting (Smart-Infinity, section "Evaluation"): storage devices at 3 GB/s each
    behind one 16 GB/s shared host link, i.e. ``LinkModel(shared_bytes_per_s=16e9,
    disk_bytes_per_s=3e9)``; all rates may be scaled down by one factor on a small machine. Any
    result measured with a rate set is an emulation (:attr:`emulated`).

    Attributes:
      shared_bytes_per_s: the shared link (trainer <-> storage workers, or host <-> all storage
        devices in the baseline), one serialised resource.
      disk_bytes_per_s: each storage device's own link (a worker <-> its directory), one per device.
    """

    shared_bytes_per_s: float | None = None
    disk_bytes_per_s: float | None = None

    def __post_init__(self):
        for f in ("shared_bytes_per_s", "disk_bytes_per_s"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"LinkModel.{f} = {v!r}: must be None or > 0 bytes/s")

    @property
    def emulated(self) -> bool:
        return self.shared_bytes_per_s is not None or self.disk_bytes_per_s is not None


class Link:
    """A link of a given rate (bytes/s) that transfers are serialised on; counts bytes.

    ``with link.transfer(nbytes): <real transfer>`` makes the block last at least until the link,
    serving transfers one after another at ``bytes_per_s``, has carried ``nbytes`` more; with
    ``bytes_per_s=None`` it only counts. Thread-safe; one object per process (a link shared by
    several processes must be throttled in the one process all its traffic passes through).
    """

    def __init__(self, bytes_per_s: float | None = None, name: str = "link"):
        self.bytes_per_s = bytes_per_s
        self.name = name
        self.bytes = 0
        self._free_at = 0.0
        self._lock = threading.Lock()

    def _reserve(self, nbytes: int, t0: float) -> float:
        with self._lock:
            self.bytes += nbytes
            if self.bytes_per_s is None:
                return 0.0
            start = max(t0, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    @contextlib.contextmanager
    def transfer(self, nbytes: int, *others: "Link | None"):
        """Throttle one transfer of ``nbytes`` on this link and on every link in ``others``."""
        t0 = time.monotonic()
        yield
        end = max([lk._reserve(nbytes, t0) for lk in (self, *others) if lk is not None])
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)


# ----------------------------------------------------------------------------------------------
# One directory.
# ----------------------------------------------------------------------------------------------

def _probe_direct(path: str) -> bool:
    """True when ``path``'s filesystem accepts an O_DIRECT open and an aligned O_DIRECT write."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = os.path.join(path, ".odirect_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = aligned_empty(ALIGN)
        buf[:] = 0
        os.pwrite(fd, memoryview(buf), 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(final: str, tmp: str, write, fsync: bool) -> None:
    """Write a file atomically: ``write(f)`` into ``tmp`` (binary), flush (and fsync), rename over
    ``final``, fsync the directory; on OSError ``tmp`` is removed and the error re-raised."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if fsync:
            _fsync_dir(os.path.dirname(final) or ".")
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_manifest(path: str) -> dict | None:
    """The committed manifest of directory ``path`` (a dict), or None if it has none."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            m = json.load(f)
    except FileNotFoundError:
        return None
    if m.get("format") != FORMAT:
        raise StorageError(f"{path}/{MANIFEST} is not a {FORMAT} manifest (format={m.get('format')!r})")
    return m


def committed_step(dirs: Sequence[str]) -> int | None:
    """The recovery target of a set of directories: the smallest committed step over them (the last
    step every directory completed), or None when none has been initialised.

    Raises:
      StorageError: some directories are initialised and others not.
    """
    steps = [None if (m := read_manifest(d)) is None else m["step"] for d in dirs]
    if all(s is None for s in steps):
        return None
    if any(s is None for s in steps):
        raise StorageError(f"directories {list(dirs)} are partly initialised (committed steps {steps}): "
                           "use empty directories or the full set of a previous run")
    return min(steps)


class _Shard:
    """The chunk files of one directory (one storage device)."""

    def __init__(self, path: str, index: int, n_dirs: int, sizes: Mapping[int, int], n_kinds: int,
                 io_mode: str, fsync: bool, disk_link: Link, shared_link: Link | None):
        self.path, self.index, self.n_dirs = path, index, n_dirs
        self.sizes = dict(sizes)
        self.n_kinds = n_kinds
        self.fsync = fsync
        self.disk_link, self.shared_link = disk_link, shared_link
        os.makedirs(path, exist_ok=True)
        if io_mode == "auto":
            io_mode = "direct" if _probe_direct(path) else "buffered"
        elif io_mode not in ("direct", "buffered"):
            raise ValueError(f"io_mode must be 'auto', 'direct' or 'buffered', got {io_mode!r}")
        self.io_mode = io_mode
        self._oflag = getattr(os, "O_DIRECT", 0) if io_mode == "direct" else 0
        self.manifest: dict | None = None
        self.read_bytes = 0
        self.written_bytes = 0
        self._lock = threading.Lock()
        self._new_files: dict[int, str] = {}

    # -- manifest ----------------------------------------------------------------------------
    def _write_manifest(self, m: dict):
        try:
            replace_file(os.path.join(self.path, MANIFEST), os.path.join(self.path, MANIFEST + ".tmp"),
                         lambda f: f.write(json.dumps(m).encode()), self.fsync)
        except OSError as e:
            raise self._error(e, f"writing {MANIFEST} for step {m['step']}") from e
        self.manifest = m

    def _error(self, e: OSError, what: str) -> StorageError:
        last = None if self.manifest is None else self.manifest["step"]
        if e.errno in _FULL_ERRNOS:
            return StorageError(
                f"storage directory {self.path} is full ({errno.errorcode.get(e.errno, e.errno)}) while {what}; "
                f"nothing committed was changed (last committed step {last}): free space there or add directories")
        return StorageError(f"storage directory {self.path}: {type(e).__name__} {e} while {what} "
                            f"(last committed step {last})")

    def _unlink(self, name: str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, name))

    def open(self, target: int | None):
        """Load the manifest and recover to step ``target`` (see the module docstring)."""
        m = read_manifest(self.path)
        if m is None:
            if target is not None:
                raise StorageError(f"storage directory {self.path} has no {MANIFEST} but step {target} was expected")
            self._clean_orphans(set())
            return
        if m["dir_index"] != self.index or m["n_dirs"] != self.n_dirs:
            raise StorageError(f"{self.path} is directory {m['dir_index']} of {m['n_dirs']}, "
                               f"opened as {self.index} of {self.n_dirs}")
        sizes = {int(c): n for c, n in m["sizes"].items()}
        if sizes != self.sizes or m["n_kinds"] != self.n_kinds:
            raise StorageError(f"{self.path} holds other chunks than asked for (chunk sizes or kinds differ)")
        self.manifest = m
        if target is None or m["step"] == target:
            self._drop_prev()
        elif m["step"] == target + 1 and m.get("prev") and m["prev"]["step"] == target:
            newer = m["files"]
            self._write_manifest({**m, "step": target, "files": m["prev"]["files"], "prev": None})
            keep = set(self.manifest["files"].values())
            for f in newer.values():
                if f not in keep:
                    self._unlink(f)
        else:
            raise StorageError(f"{self.path} is at step {m['step']} and cannot go back to step {target} "
                               "(directories from different runs?)")
        self._clean_orphans(set(self.manifest["files"].values()))

    def _clean_orphans(self, keep: set[str]):
        for name in os.listdir(self.path):
            if (_CHUNK_RE.match(name) and name not in keep) or name == MANIFEST + ".tmp":
                self._unlink(name)

    def _drop_prev(self):
        m = self.manifest
        if m is None or not m.get("prev"):
            return
        old = m["prev"]["files"]
        self._write_manifest({**m, "prev": None})
        keep = set(m["files"].values())
        for f in old.values():
            if f not in keep:
                self._unlink(f)

    def initialize_manifest(self, step: int, files: dict[int, str]):
        self._write_manifest({"format": FORMAT, "step": step, "dir_index": self.index, "n_dirs": self.n_dirs,
                              "n_kinds": self.n_kinds, "align": ALIGN,
                              "sizes": {str(c): n for c, n in sorted(self.sizes.items())},
                              "files": {str(c): f for c, f in sorted(files.items())}, "prev": None})

    def commit(self, step: int):
        m = self.manifest
        files = {**m["files"], **{str(c): f for c, f in self._new_files.items()}}
        self._write_manifest({**m, "step": step, "files": files, "prev": {"step": m["step"], "files": m["files"]}})
        self._new_files = {}

    def abort(self):
        for f in self._new_files.values():
            self._unlink(f)
        self._new_files = {}

    # -- chunk I/O ---------------------------------------------------------------------------
    def file_bytes(self, c: int) -> int:
        return self.n_kinds * section_bytes(self.sizes[c])

    def read_into(self, c: int, buf: np.ndarray):
        name = self.manifest["files"][str(c)]
        nbytes = self.file_bytes(c)
        mv = memoryview(buf[:nbytes])
        with self.disk_link.transfer(nbytes, self.shared_link):
            try:
                fd = os.open(os.path.join(self.path, name), os.O_RDONLY | self._oflag)
                try:
                    _whole(lambda m, off: _preadv(fd, [m], off), mv, f"{name} is shorter than {nbytes} bytes")
                finally:
                    os.close(fd)
            except OSError as e:
                raise self._error(e, f"reading chunk {c}") from e
        with self._lock:
            self.read_bytes += nbytes

    def write_from(self, c: int, step: int, buf: np.ndarray):
        name = chunk_file_name(c, step)
        nbytes = self.file_bytes(c)
        mv = memoryview(buf[:nbytes])
        with self._lock:
            self._new_files[c] = name
        with self.disk_link.transfer(nbytes, self.shared_link):
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._oflag
                fd = os.open(os.path.join(self.path, name), flags, 0o644)
                try:
                    _whole(lambda m, off: _pwrite(fd, m, off), mv, f"short write to {name}")
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise self._error(e, f"writing chunk {c} for step {step}") from e
        with self._lock:
            self.written_bytes += nbytes


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


class DiskTier:
    """Chunked optimizer state on one or more storage directories, with a crash-safe step commit.

    The ZeRO-Infinity baseline runs the update in the calling process (read state into host
    staging buffers, update on the host, write back); a near-storage worker
    (:mod:`chunkjax.near_storage`) opens a tier over its own directory only.

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
      io_threads: threads running reads and writes.
      io_mode: 'auto' (O_DIRECT where the filesystem allows, else buffered), 'direct', 'buffered'.
      link_model: emulated rates; ``disk_bytes_per_s`` throttles each directory, and
        ``shared_bytes_per_s`` (if set) throttles all directories' traffic together (the
        baseline's host <-> storage link). Use None (the default) for unthrottled real I/O.
      fsync: fsync data files, manifests and directories at commit (crash safety against power loss).
      target_step: recover to this step (see module docstring); default: the smallest committed
        step over ``dirs``.

    Raises:
      StorageError: directories from another run, partly initialised, or not recoverable.
      ValueError: a chunk is not stored in ``dirs``, or bad arguments.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes: Mapping[int, int] | Sequence[int], *, n_kinds: int = 3,
                 dir_indices: Sequence[int] | None = None, n_dirs_total: int | None = None, n_buffers: int = 3,
                 read_ahead: int = 1,
                 io_threads: int = 2, io_mode: str = "auto", link_model: LinkModel | None = None,
                 fsync: bool = True, target_step: int | None = None):
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
                              Link(self.link_model.disk_bytes_per_s, f"disk{g}"), shared)
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
            s.initialize_manifest(step, s._new_files)
            s._new_files = {}
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
