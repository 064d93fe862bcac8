"""The disk tier's chunk files: format, checksums, manifest and the crash-safe commit of one directory.

When host memory cannot hold the fp32 master params and the Adam moments, they live on storage
(ZeRO-Infinity's NVMe offload; Smart-Infinity, Jang et al., HPCA 2024, arXiv 2403.06664). This
module holds what lies on one storage directory; :mod:`chunkjax.storage.tier` runs the I/O over
several, :mod:`chunkjax.storage.links` the emulated bandwidth model. No JAX dependency (the
near-storage workers of :mod:`chunkjax.storage.worker` run it).

File layout
-----------
Chunk ``c`` of ``n`` float32 elements belongs to directory ``c % n_dirs`` (one directory per
storage device). Each directory holds::

    manifest.json                      committed step, chunk sizes, file and CRC-32 of each chunk
    chunk0000003.step000000012.bin     chunk 3 as written at step 12

One file per chunk per version holds the ``n_kinds`` tensors (``master | m | v`` for AdamW)
contiguously, each section padded with zero bytes to :data:`ALIGN` (4096) bytes so that
``O_DIRECT`` works::

    [master: n*4 bytes, zero padding to 4096k] [m: same] [v: same]

The padding is zeroed before every write (the staging buffers are reused), so the bytes on disk
are a function of the state: the same state gives the same files.

Checksums
---------
The manifest keeps the CRC-32 (``zlib.crc32``, about 3 GB/s per core, computed on the I/O threads
with the GIL released) of every chunk file it names. Every read of a chunk file checks it, and a
tier opened on a committed run (a resume) reads and checks every file first; a mismatch raises
:class:`StorageError` with one line naming the file. An unreadable manifest also names its file.

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
With ``keep_previous=False`` (:class:`~chunkjax.storage.tier.DiskTier`) each chunk's committed file
is deleted as soon as its new one is written: disk use stays at the state plus the files in
flight, but a step that fails part way leaves the directory at no complete step (a later open
fails in one line naming a missing chunk file): restore from a checkpoint then.

I/O
---
``os.preadv`` / ``os.pwrite`` on whole chunk files. ``io_mode="auto"`` probes each directory with
an ``O_DIRECT`` open and aligned write and falls back to buffered I/O when the filesystem refuses
it (``EINVAL``, e.g. tmpfs). Buffers are 4096-byte aligned in either mode. Bytes actually passed
to ``pread``/``pwrite`` (padded sections included) are counted per directory.

Errors: :class:`StorageError` (a full disk, a corrupt file, an inconsistent or foreign directory,
a dead worker).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import threading
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from chunkjax.storage.links import Link

#: Alignment (bytes) of file sections, file offsets and staging buffers (O_DIRECT needs it).
ALIGN = 4096
#: The state dtype on storage (mixed-precision rule: fp32 master params and moments).
STATE_DTYPE = np.dtype(np.float32)
#: Tensor kinds of an AdamW chunk file, in file order.
ADAM_KINDS = ("master", "m", "v")
MANIFEST = "manifest.json"
FORMAT = "chunkjax.storage/2"  # /2: CRC-32 of every chunk file in the manifest
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
    """The committed manifest of directory ``path`` (a dict), or None if it has none.

    Raises:
      StorageError: the manifest is unreadable (truncated, not JSON) or of another format; one line
        naming the file.
    """
    name = os.path.join(path, MANIFEST)
    try:
        with open(name, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorageError(f"{name} is unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}): "
                           "the storage directory is damaged; restore it from a checkpoint") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        fmt = m.get("format") if isinstance(m, dict) else None
        raise StorageError(f"{name} is not a {FORMAT} manifest (format={fmt!r}): open it with the chunkjax that "
                           "wrote it and move the run through a checkpoint (save_storage_checkpoint)")
    return m


def file_crc32(mv) -> int:
    """CRC-32 (``zlib.crc32``) of a bytes-like object: a whole chunk file, padding included."""
    return zlib.crc32(mv) & 0xFFFFFFFF


def zero_padding(buf: np.ndarray, n: int, n_kinds: int) -> None:
    """Zero the padding after each of the ``n_kinds`` sections of an ``n``-element chunk file held in
    the uint8 buffer ``buf`` (the bytes between ``n * 4`` and :func:`section_bytes` of each)."""
    sec, used = section_bytes(n), n * STATE_DTYPE.itemsize
    for i in range(n_kinds):
        buf[i * sec + used:(i + 1) * sec] = 0


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


def clear_run(path: str) -> int:
    """Delete a run's files from storage directory ``path`` (its manifest, its chunk files and
    their temporaries; nothing else), so a fresh state can be written there. Returns the files
    removed (0 for a missing or empty directory)."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(path):
            if _CHUNK_RE.match(name) or name in (MANIFEST, MANIFEST + ".tmp"):
                os.unlink(os.path.join(path, name))
                removed += 1
    return removed


class _Shard:
    """The chunk files of one directory (one storage device)."""

    def __init__(self, path: str, index: int, n_dirs: int, sizes: Mapping[int, int], n_kinds: int,
                 io_mode: str, fsync: bool, disk_link: Link, shared_link: Link | None, keep_previous: bool = True):
        self.path, self.index, self.n_dirs = path, index, n_dirs
        self.keep_previous = keep_previous
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
        self._new_crc: dict[int, int] = {}

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
            self._write_manifest({**m, "step": target, "files": m["prev"]["files"], "crc32": m["prev"]["crc32"],
                                  "prev": None})
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

    def initialize_manifest(self, step: int):
        """Commit the files just written as step ``step`` (a fresh or restored run)."""
        self._write_manifest({"format": FORMAT, "step": step, "dir_index": self.index, "n_dirs": self.n_dirs,
                              "n_kinds": self.n_kinds, "align": ALIGN,
                              "sizes": {str(c): n for c, n in sorted(self.sizes.items())},
                              "files": {str(c): f for c, f in sorted(self._new_files.items())},
                              "crc32": {str(c): k for c, k in sorted(self._new_crc.items())}, "prev": None})
        self._new_files, self._new_crc = {}, {}

    def commit(self, step: int):
        m = self.manifest
        files = {**m["files"], **{str(c): f for c, f in self._new_files.items()}}
        crc = {**m["crc32"], **{str(c): k for c, k in self._new_crc.items()}}
        self._write_manifest({**m, "step": step, "files": files, "crc32": crc,
                              "prev": {"step": m["step"], "files": m["files"], "crc32": m["crc32"]}})
        self._new_files, self._new_crc = {}, {}

    def abort(self):
        for f in self._new_files.values():
            self._unlink(f)
        self._new_files, self._new_crc = {}, {}

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
        want, got = self.manifest["crc32"][str(c)], file_crc32(mv)
        if got != want:
            raise StorageError(f"{os.path.join(self.path, name)}: checksum mismatch (crc32 {got:08x}, the manifest "
                               f"says {want:08x}): the chunk file is corrupt; restore the run from a checkpoint")

    def verify(self, buf: np.ndarray):
        """Read every committed chunk file of this directory into ``buf`` and check its CRC-32."""
        for c in sorted(self.sizes):
            self.read_into(c, buf)

    def write_from(self, c: int, step: int, buf: np.ndarray):
        name = chunk_file_name(c, step)
        nbytes = self.file_bytes(c)
        zero_padding(buf, self.sizes[c], self.n_kinds)  # the bytes on disk are a function of the state
        mv = memoryview(buf[:nbytes])
        crc = file_crc32(mv)
        with self._lock:
            self._new_files[c] = name
            self._new_crc[c] = crc
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
        old = None if self.manifest is None else self.manifest["files"].get(str(c))
        if not self.keep_previous and old is not None and old != name:  # half the disk: no way back to the last step
            self._unlink(old)


