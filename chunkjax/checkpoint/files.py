"""The files of a checkpoint: directory listing, temporaries, checksums, meta.json, chunk files.

A checkpoint of step ``N`` is one directory ``<directory>/step_<N:08d>/`` holding

* ``chunk_<c:05d>/``: an orbax-checkpoint PyTree checkpoint per chunk ``c`` with the portable
  arrays of :mod:`chunkjax.checkpoint.protocol` (whole (chunk_size,) chunks);
* ``checksums.json``: the size (bytes) and zlib crc32 of every other file, with its own crc32;
  written last, checked on every read (a mismatch is a one-line :class:`CheckpointError` naming
  the file; :func:`latest_step` skips such a checkpoint with a warning);
* ``meta.json``: format version, step number, the chunk layout (every leaf's path, pieces
  ``[chunk, offset, leaf offset, size]``, shape, dtype) and its fingerprint, the compute dtype, per chunk the optimizer step
  count, the moment names, the scalars of optax's *rest-of-model* leaf (:mod:`chunkjax.optim`)
  and where it was saved from, the engine it was saved from (``saved_from``) and the user's
  ``extra`` dict (:mod:`chunkjax.checkpoint.codec`).

Saves write into a hidden temporary ``<directory>/.tmp_step_<N:08d>_<pid>_<random>/`` renamed
into place at the end (:mod:`chunkjax.checkpoint.save`); temporaries of dead processes are
removed by :func:`remove_stale_temporaries`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import difflib
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
import zlib

import jax
import numpy as np

from chunkjax.checkpoint.protocol import CheckpointError

FORMAT = "chunkjax-checkpoint"

#: 2: with checksums.json; version 1 checkpoints (no checksums) still restore, unverified.
#: 3: a leaf's place is its pieces (leaves may span chunks); versions 1 and 2 (one [chunk, offset]
#: per leaf) are read by converting their layout (:func:`upgrade_layout_spec`).
VERSION = 3

META = "meta.json"
CHECKSUMS = "checksums.json"
_CHECKSUM_BLOCK = 256 << 10  # bytes read at a time when checksumming a file
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_step_"
_TMP_RE = re.compile(r"^\.tmp_step_(\d+)_(\d+)_[0-9a-f]+$")
_log = logging.getLogger(__name__)


# ---- directory listing ----------------------------------------------------------------------

def step_dir(directory, step: int) -> str:
    return os.path.join(os.fspath(directory), f"step_{step:08d}")


def _step_numbers(directory) -> list[int]:
    """Step numbers of every ``step_<N>`` directory in ``directory``, complete or not, ascending."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(d)) if m)


def all_steps(directory) -> list[int]:
    """Step numbers of the complete checkpoints in ``directory`` (a ``step_<N>`` directory with
    its ``meta.json``), ascending ([] if none or if the directory does not exist). Temporaries of
    unfinished saves are never listed; the files are not verified (:func:`verify_checkpoint`)."""
    return [s for s in _step_numbers(directory) if os.path.isfile(os.path.join(step_dir(directory, s), META))]


def latest_step(directory, *, verify: bool = True) -> int | None:
    """The largest step number with a complete, intact checkpoint in ``directory``, or None.

    With ``verify`` (the default) the newest checkpoint is checked file by file
    (:func:`verify_checkpoint`: reads every file once, 1-4 GB/s from the page cache); an incomplete
    (no ``meta.json``) or corrupt one is skipped, the one before it tried, with a ``RuntimeWarning``
    naming it, the file at fault and the step used instead (or that none is left).
    ``verify=False`` returns the newest :func:`all_steps` entry unchecked."""
    step, skipped = _newest_intact(directory, verify)
    _warn_skipped(directory, skipped, step)
    return step


def _newest_intact(directory, verify: bool) -> tuple[int | None, list[tuple[int, str]]]:
    """(latest_step's step, [(newer step skipped, its defect without the earlier-step advice)]); no warning."""
    skipped = []
    for s in reversed(_step_numbers(directory)):
        where = step_dir(directory, s)
        try:
            if not os.path.isfile(os.path.join(where, META)):
                raise CheckpointError(f"{where} is incomplete (no {META})")
            if verify:
                verify_checkpoint(directory, s)
            return s, skipped
        except CheckpointError as e:
            skipped.append((s, str(e).replace(earlier_steps(where), "").rstrip(" :,")))
    return None, skipped


def _warn_skipped(directory, skipped: list[tuple[int, str]], used: int | None) -> None:
    instead = f"using step {used} instead" if used is not None else f"no intact one left in {os.fspath(directory)}"
    for s, why in skipped:
        warnings.warn(f"checkpoint step {s} skipped: {why}; {instead}", RuntimeWarning, stacklevel=3)


def earlier_steps(root: str) -> str:
    """What to do about the corrupt checkpoint ``root`` (a ``step_<N>`` directory), for messages:
    restore an earlier complete step explicitly (named, with the call), or that there is none."""
    directory, name = os.path.split(os.path.normpath(os.fspath(root)))
    m = _STEP_RE.match(name)
    older = [s for s in all_steps(directory) if s < int(m.group(1))] if m else []
    if older:
        return (f"restore an earlier step explicitly, e.g. chunkjax.restore_checkpoint({directory!r}, engine, "
                f"step_number={older[-1]}) (complete earlier steps: {older})")
    if m:
        return f"{directory} holds no earlier checkpoint to restore instead"
    return "restore an earlier step"


def verify_checkpoint(directory, step_number: int) -> dict:
    """Check every file of checkpoint ``step_number`` against the size and crc32 recorded when it
    was saved (``checksums.json``), reading each file once in 256 KiB blocks.

    Returns:
      The checkpoint's ``meta.json`` (as :func:`read_meta`).

    Raises:
      FileNotFoundError: no complete checkpoint of that step.
      CheckpointError: a one-line message naming the first file that is missing, unreadable, of
        another size or another checksum, or unreadable metadata (``meta.json``,
        ``checksums.json``). Version-1 checkpoints (saved before checksums) pass unverified with
        a warning.
    """
    meta, sums = load_meta(directory, step_number)
    if sums is not None:
        root = step_dir(directory, step_number)
        for c in range(int(meta["layout"]["n_chunks"])):
            verify_files(root, sums, chunk_name(c))
    return meta


# ---- checksums: every file's size and crc32, recorded at save, checked on read ----------------

def chunk_name(c: int) -> str:
    return f"chunk_{c:05d}"


def file_checksum(path: str) -> list[int]:
    """``[size in bytes, zlib crc32]`` of the file at ``path``, read in blocks (bounded memory)."""
    crc, n = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(max(1, min(_CHECKSUM_BLOCK, os.fstat(f.fileno()).st_size))))
        while True:
            k = f.readinto(buf)
            if not k:
                break
            crc, n = zlib.crc32(buf[:k], crc), n + k
    return [n, crc]


def tree_checksums(root: str, sub: str) -> dict[str, list[int]]:
    """``{path relative to root ('/'-separated): [size, crc32]}`` of every file under ``root/sub``."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, sub)):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = file_checksum(path)
    return out


def _sums_crc(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def write_checksums(root: str, files: dict) -> None:
    body = {"format": FORMAT, "algorithm": "crc32", "files": dict(sorted(files.items()))}
    body["crc32"] = _sums_crc(body["files"])  # the manifest's own checksum
    write_meta(os.path.join(root, CHECKSUMS), body)


def read_checksums(root: str) -> dict | None:
    """The recorded ``{relative path: [size, crc32]}`` of a checkpoint, or None if it has no
    ``checksums.json`` (version 1). Raises CheckpointError if the file is unreadable or corrupt."""
    path = os.path.join(root, CHECKSUMS)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
        files, crc = body["files"], body["crc32"]
        ok = _sums_crc(files) == crc and all(len(v) == 2 for v in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is unreadable ({one_line(e)}): the checkpoint is corrupt, "
                              f"{earlier_steps(root)}") from None
    if not ok:
        raise CheckpointError(f"{path} does not match its own checksum: the checkpoint is corrupt, "
                              f"{earlier_steps(root)}")
    return files


def verify_files(root: str, sums: dict, sub: str) -> None:
    """Check the recorded files at ``sub`` (a file) or under it (a directory) of checkpoint
    ``root``. Raises a one-line CheckpointError naming the first bad file."""
    mine = [r for r in sums if r == sub or r.startswith(sub + "/")]
    if not mine:
        raise CheckpointError(f"{os.path.join(root, sub)}: {CHECKSUMS} records no such file: the checkpoint is "
                              f"corrupt, {earlier_steps(root)}")
    for rel in mine:
        path = os.path.join(root, *rel.split("/"))
        try:
            got = file_checksum(path)
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({one_line(e)}): the checkpoint is corrupt, "
                                  f"{earlier_steps(root)}") from None
        want = [int(x) for x in sums[rel]]
        if got != want:
            raise CheckpointError(f"{path} is corrupt ({got[0]} bytes, crc32 {got[1]:08x}; saved: {want[0]} bytes, "
                                  f"crc32 {want[1]:08x}): {earlier_steps(root)}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tmp_dir(directory, step: int) -> str:
    """A fresh temporary name for step ``step`` in ``directory`` (``_TMP_RE``: never listed by
    :func:`all_steps`, removed by :func:`remove_stale_temporaries` once this process is gone)."""
    return os.path.join(os.fspath(directory), f"{_TMP_PREFIX}{step:08d}_{os.getpid()}_{uuid.uuid4().hex[:12]}")


def delete_checkpoint(directory, step_number: int) -> None:
    """Delete checkpoint ``step_number`` of ``directory``: renamed first to a temporary name, then
    removed, so a crash mid-delete leaves neither a half-deleted checkpoint that looks complete
    nor an orphan (the next save removes the temporary).

    Raises:
      FileNotFoundError: there is no such checkpoint.
    """
    tmp = tmp_dir(directory, step_number)
    os.rename(step_dir(directory, step_number), tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(directory) -> list[str]:
    """Remove temporary directories of saves whose process has died (a crash mid-save).

    Returns the removed paths. Temporaries of live processes (a save in progress) are kept.
    """
    d = os.fspath(directory)
    removed = []
    if not os.path.isdir(d):
        return removed
    for name in os.listdir(d):
        m = _TMP_RE.match(name)
        if m and not _pid_alive(int(m.group(2))):
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
            removed.append(os.path.join(d, name))
    return removed


# ---- layout fingerprint ---------------------------------------------------------------------

def layout_spec(layout) -> dict:
    """JSON form of a :class:`~chunkjax.layout.ChunkLayout`: chunk_size (elements), n_chunks,
    chunk dtypes, every leaf slot as ``[path, pieces, shape, dtype]`` (``pieces`` a list of
    ``[chunk, offset in chunk, offset in leaf, size]``, elements, in leaf order) and, when some
    chunk is frozen, ``chunk_trainable``."""
    spec = {
        "chunk_size": int(layout.chunk_size),
        "n_chunks": int(layout.n_chunks),
        "chunk_dtypes": [np.dtype(d).name for d in layout.chunk_dtypes],
        "slots": [[s.path, [[int(p.chunk), int(p.offset), int(p.leaf_offset), int(p.size)] for p in s.pieces],
                   [int(x) for x in s.shape], np.dtype(s.dtype).name] for s in layout.slots],
    }
    if not all(layout.chunk_trainable):
        spec["chunk_trainable"] = [bool(t) for t in layout.chunk_trainable]
    return spec


def upgrade_layout_spec(spec: dict) -> dict:
    """A layout spec of a version 1 or 2 checkpoint (slots ``[path, chunk, offset, shape, dtype]``,
    every leaf whole in one chunk) in the current form (:func:`layout_spec`)."""
    slots = [[p, [[int(c), int(o), 0, int(np.prod(shape, dtype=np.int64))]], shape, dt]
             for p, c, o, shape, dt in spec["slots"]]
    return {**spec, "slots": slots}


def layout_fingerprint(layout) -> str:
    """sha256 (hex) of :func:`layout_spec`: equal fingerprints mean identical chunk layouts."""
    return hashlib.sha256(json.dumps(layout_spec(layout), sort_keys=True).encode()).hexdigest()


def layout_difference(saved: dict, here: dict) -> str | None:
    """One line saying how two layout specs differ, or None if they are equal."""
    for key in ("chunk_size", "n_chunks"):
        if saved[key] != here[key]:
            return f"{key} is {saved[key]} in the checkpoint but {here[key]} in this step"
    if saved["chunk_dtypes"] != here["chunk_dtypes"]:
        c = next(i for i, (a, b) in enumerate(zip(saved["chunk_dtypes"], here["chunk_dtypes"])) if a != b)
        return f"chunk {c} has dtype {saved['chunk_dtypes'][c]} in the checkpoint but {here['chunk_dtypes'][c]} here"
    tr_saved = saved.get("chunk_trainable", [True] * saved["n_chunks"])
    tr_here = here.get("chunk_trainable", [True] * here["n_chunks"])
    if tr_saved != tr_here:
        c = next(i for i, (a, b) in enumerate(zip(tr_saved, tr_here)) if a != b)
        return f"chunk {c} is {'trainable' if tr_saved[c] else 'frozen'} in the checkpoint but not here"
    if len(saved["slots"]) != len(here["slots"]):
        return f"the checkpoint has {len(saved['slots'])} leaves but this step's params have {len(here['slots'])}"
    for a, b in zip(saved["slots"], here["slots"]):
        if a != b:
            fmt = lambda s: f"{s[0]} (pieces {s[1]}, shape {tuple(s[2])}, {s[3]})"  # noqa: E731
            return f"leaf {fmt(a)} in the checkpoint is {fmt(b)} in this step"
    return None


def tree_difference(saved: dict, here: dict) -> str | None:
    """One line naming the first leaf whose path, shape or dtype differs between two layout
    specs (the parameter trees), or None if the trees match (chunk placement may differ)."""
    a = {s[0]: (tuple(s[2]), s[3]) for s in saved["slots"]}
    b = {s[0]: (tuple(s[2]), s[3]) for s in here["slots"]}
    for path in a:
        if path not in b:
            return f"leaf {path} is in the checkpoint but not in this step's params ({len(a)} vs {len(b)} leaves)"
    for path in b:
        if path not in a:
            return f"leaf {path} of this step's params is not in the checkpoint ({len(a)} vs {len(b)} leaves)"
    for path, (shape, dt) in a.items():
        if b[path] != (shape, dt):
            return f"leaf {path} is {shape} {dt} in the checkpoint but {b[path][0]} {b[path][1]} in this step"
    return None


def common_optimizer(meta: dict, where: str, need_one_count: bool) -> tuple[list[str], int | None, dict]:
    """(moment names, step count, rest scalars) shared by the checkpoint's chunks.

    Raises:
      CheckpointError: chunks saved with different moments, or (``need_one_count``) different
        optimizer step counts, which a changed chunk layout could not keep apart.
    """
    chunks = [cm for cm in meta["chunks"] if not cm.get("frozen")]  # frozen chunks: params only
    if not chunks:
        return [], None, {}
    names = {tuple(sorted(cm["moments"])) for cm in chunks}
    if len(names) != 1:
        raise CheckpointError(f"{where}: its chunks hold different optimizer moments {sorted(names)}")
    counts = {cm["count"] for cm in chunks}
    if need_one_count and len(counts) != 1:
        raise CheckpointError(f"{where}: its chunks hold different optimizer step counts {sorted(counts, key=str)}, "
                              "so they cannot be remapped into another chunk layout: restore with the saved layout")
    return list(names.pop()), chunks[0]["count"], chunks[0].get("rest", {})


# ---- meta.json ------------------------------------------------------------------------------

def write_meta(path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())


def read_meta(directory, step_number: int | None = None) -> dict:
    """``meta.json`` of a checkpoint, checked against its recorded checksum (the latest intact
    checkpoint, :func:`latest_step`, when ``step_number`` is None).

    Raises:
      FileNotFoundError: no complete checkpoint of that step (or none at all) in ``directory``.
      CheckpointError: one line naming the file: ``meta.json`` or ``checksums.json`` unreadable
        or corrupt, or not a chunkjax checkpoint of a known version; with ``step_number`` None
        and every complete checkpoint corrupt, the newest one's first bad file (size and crc32).
    """
    if step_number is None:
        step_number, skipped = _newest_intact(directory, True)
        if step_number is None:  # no warning first: the error says it all (fresh25)
            complete = all_steps(directory)
            if complete:  # all corrupt: the newest one's fault, in one line (not FileNotFoundError)
                try:
                    verify_checkpoint(directory, complete[-1])
                except CheckpointError as e:
                    raise CheckpointError(f"no intact checkpoint in {os.fspath(directory)}: {e}") from None
            raise FileNotFoundError(not_found(directory))
        _warn_skipped(directory, skipped, step_number)
    return load_meta(directory, step_number)[0]


def not_found(directory) -> str:
    """The one-line message for a ``directory`` holding no complete checkpoint: what it is (missing,
    a file, one checkpoint's ``step_<N>`` folder, saves cut short) and where checkpoints are (the
    checkpoint roots found in it, its parent, or beside it under a similar name, with their steps),
    or to pass the folder :func:`chunkjax.save_checkpoint` wrote."""
    d = os.path.normpath(os.fspath(directory))
    parent, name = os.path.split(os.path.abspath(d))
    if _STEP_RE.match(name) and os.path.isdir(d):
        return (f"no complete checkpoint in {d}: it is one checkpoint's step folder; pass the folder "
                f"save_checkpoint wrote, its parent: restore_checkpoint({parent!r}, ...)")
    what = ("does not exist" if not os.path.exists(d) else "is a file" if not os.path.isdir(d)
            else f"holds saves cut short (steps without {META}: {_step_numbers(d)})" if _step_numbers(d)
            else "holds no step_<N> folder")

    def roots(folder):
        try:
            names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        except OSError:
            names = []
        return [os.path.join(folder, n) for n in names if not _STEP_RE.match(n) and all_steps(os.path.join(folder, n))]
    # beside it: only folders named like it (a typo: "checkpoint" for "checkpoints"), not every
    # run in a shared folder such as /tmp (fresh23, fresh24: other users' runs were suggested)
    near = difflib.get_close_matches(name, [os.path.basename(r) for r in roots(parent)], n=4, cutoff=0.6)
    found = [r for r in dict.fromkeys(roots(d) + ([parent] if all_steps(parent) else [])
                                      + [os.path.join(parent, n) for n in near])
             if os.path.abspath(r) != os.path.abspath(d)][:4]
    where = ("; checkpoints found in " + ", ".join(f"{r} (steps {all_steps(r)})" for r in found)
             + ": pass one of them" if found
             else "; pass the folder chunkjax.save_checkpoint(folder, n, step) wrote (it holds step_<N> folders)")
    return f"no complete checkpoint in {d}: it {what}{where}"


def load_meta(directory, step_number: int) -> tuple[dict, dict | None]:
    """(meta.json, the recorded checksums or None for a version-1 checkpoint), meta.json verified."""
    root = step_dir(directory, step_number)
    path = os.path.join(root, META)
    if not os.path.isfile(path):
        have = all_steps(directory)
        raise FileNotFoundError(f"no complete checkpoint of step {step_number} in {os.fspath(directory)} "
                                f"(complete steps: {have}): " + ("pass step_number= one of them, or None for the newest"
                                                                  if have else not_found(directory)))
    sums = read_checksums(root)
    if sums is not None:
        verify_files(root, sums, META)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({one_line(e)}): the checkpoint is corrupt, "
                              f"{earlier_steps(root)}") from None
    if meta.get("format") != FORMAT or meta.get("version") not in (1, 2, VERSION):
        raise CheckpointError(f"{path} is not a {FORMAT} file of version 1 to {VERSION} "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r}): "
                              "restore it with the chunkjax that saved it")
    if sums is None and meta["version"] >= 2:
        raise CheckpointError(f"{os.path.join(root, CHECKSUMS)} is missing: the checkpoint is incomplete, "
                              f"{earlier_steps(root)}")
    if sums is None:
        _log.warning("checkpoint %s has no %s (saved before version 2): restored unverified", root, CHECKSUMS)
    if meta["version"] < 3:  # leaves whole in one chunk: the same layout in the pieces form
        meta["layout"] = upgrade_layout_spec(meta["layout"])
        meta["layout_fingerprint"] = hashlib.sha256(json.dumps(meta["layout"], sort_keys=True).encode()).hexdigest()
    return meta, sums


# ---- chunk I/O (module-level so tests can inject faults) -------------------------------------

def checkpointer():
    """An orbax checkpointer for this process's own file I/O: under ``jax.distributed`` each
    process is its own primary host with no barriers to the others (the per-chunk arrays are
    numpy; chunkjax coordinates the processes itself, :func:`_save_multiprocess`)."""
    import orbax.checkpoint as ocp
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=mp), multiprocessing_options=mp)


def write_chunk(ckptr, path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write one chunk's arrays (numpy) as an orbax PyTree checkpoint at ``path``.

    A failed or interrupted write (a full disk, Ctrl-C) raises here and nowhere else: orbax's
    background threads of this write are joined before the exception leaves (so the caller's
    removal of the temporary directory does not race them), and what they and tensorstore print
    about the same failure (absl ``_SignalingThread.run() raised an exception`` tracebacks,
    ``RuntimeError: Event loop is closed`` from callbacks of the aborted write) is dropped while
    this call runs: :func:`quiet_orbax_failures`.

    Raises:
      OSError: with the errno tensorstore reports (``os_error_code``, e.g. ENOSPC: a full disk)
        (the message names the chunk), instead of tensorstore's ValueError with its whole spec.
      KeyboardInterrupt and any other exception of the write: unchanged.
    """
    import orbax.checkpoint as ocp
    with quiet_orbax_failures():
        try:
            ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave(arrays))  # orbax refuses relative paths
        except Exception as e:
            code = _os_error_code(e)
            if code is None:
                raise
            raise OSError(code, os.strerror(code)) from e


def _os_error_code(e: BaseException) -> int | None:
    """The errno of an OSError, or of tensorstore's ``[os_error_code='28']`` in its message."""
    if isinstance(e, OSError) and e.errno:
        return e.errno
    m = re.search(r"os_error_code='?(\d+)", str(e))
    return int(m.group(1)) if m else None


class _OrbaxNoise(logging.Filter):
    """Drops orbax's ERROR records (the absl logger), while a write is in flight."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


_quiet_lock = threading.Lock()
_quiet = {"depth": 0, "filter": _OrbaxNoise(), "prev_hook": None}  # process-wide hooks, refcounted


def _drop_closed_loop(unraisable) -> None:
    if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
        return  # a tensorstore callback of an aborted orbax write, after orbax closed its loop
    _quiet["prev_hook"](unraisable)


class quiet_orbax_failures:
    """Context manager: while any chunk write is in flight, orbax's own reports of a failed write
    (absl ERROR records with tracebacks from its threads; tensorstore's unraisable ``Event loop is
    closed``) are dropped, since the failure reaches the caller as this write's exception. On an
    exception, the orbax threads started inside are joined (up to 30 s) before it propagates, so
    that nothing of the failed write runs or prints after the caller's one-line error."""

    def __enter__(self):
        with _quiet_lock:
            if _quiet["depth"] == 0:
                logging.getLogger("absl").addFilter(_quiet["filter"])
                _quiet["prev_hook"], sys.unraisablehook = sys.unraisablehook, _drop_closed_loop
            _quiet["depth"] += 1
        self.before = set(threading.enumerate())
        return self

    def __exit__(self, typ, exc, tb):
        try:
            if typ is not None:  # the aborted write's threads: done before the caller removes its files
                deadline = time.monotonic() + 30.0  # a second Ctrl-C ends the wait
                for t in threading.enumerate():
                    if t not in self.before and type(t).__module__.startswith("orbax") and t is not threading.current_thread():
                        t.join(max(0.0, deadline - time.monotonic()))
                time.sleep(0.05)  # tensorstore's last callbacks into orbax's closed loop
        finally:
            with _quiet_lock:
                _quiet["depth"] -= 1
                if _quiet["depth"] == 0:
                    logging.getLogger("absl").removeFilter(_quiet["filter"])
                    if sys.unraisablehook is _drop_closed_loop:
                        sys.unraisablehook = _quiet["prev_hook"]
        return False


def read_chunk(ckptr, path: str, names) -> dict[str, np.ndarray]:
    """Read one chunk's arrays (numpy, writable) from ``path``."""
    import orbax.checkpoint as ocp
    ra = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
    item = {n: np.zeros((), np.float32) for n in names}  # structure only (a subset of the saved arrays)
    return ckptr.restore(os.path.abspath(path),
                         args=ocp.args.PyTreeRestore(item=item, restore_args=ra, partial_restore=True))


def fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"

