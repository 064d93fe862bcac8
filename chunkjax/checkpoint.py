"""Checkpoints of a chunked training run: saved chunk by chunk, atomic, placement-independent.

Covered: :class:`chunkjax.ChunkedStep` on one device (any placement or schedule, device, streamed
or host updates) and over a ZeRO ``data`` mesh (stages 1-3, master params and optimizer state
sharded; device, streamed and per-rank host-updated chunks), and the storage tier
(:class:`chunkjax.near_storage.NearStorageOptimizer`: AdamW state in chunk files on disk) through
:func:`save_storage_checkpoint` / :func:`restore_storage_checkpoint`, in the same format, so a
checkpoint moves between disk and memory in both directions. A ZeRO step whose mesh spans
several processes (``jax.distributed``) saves with every process calling :func:`save_checkpoint`
(each chunk all-gathered, process 0 writes; the directory must be visible to every process) and
restores with every process calling :func:`restore_checkpoint` (each reads the files and places
its own shards); every wait on another process has a deadline (``peer_timeout_s``), and a
process killed or stuck during the save is named in one line by the others while process 0
removes its temporary directory; asynchronous saves of such a state are refused.

A checkpoint of step ``N`` is one directory ``<directory>/step_<N:08d>/`` holding

* ``chunk_<c:05d>/``: an orbax-checkpoint PyTree checkpoint per chunk ``c`` with the arrays
  ``params`` ((chunk_size,) compute dtype), ``master`` ((chunk_size,) float32) and one
  (chunk_size,) float32 array per optimizer moment, named by the optax field (``mu``, ``nu`` for
  AdamW/Adam, ``mu`` for Lion, ``trace`` for SGD with momentum). Always whole, unsharded chunks:
  a ZeRO chunk's rank shards are concatenated in rank order (rank ``r`` owns elements
  ``[r * chunk_size/N, (r+1) * chunk_size/N)``);
* ``checksums.json``: the size (bytes) and zlib crc32 of every other file, with its own crc32;
  written last, checked on every read (a mismatch is a one-line :class:`CheckpointError` naming
  the file; :func:`latest_step` skips such a checkpoint with a warning);
* ``meta.json``: format version, step number, the chunk layout (every leaf's path, chunk,
  offset, shape, dtype) and its fingerprint, the compute dtype, per chunk the optimizer step
  count, the moment names, the scalars of optax's *rest-of-model* leaf (:mod:`chunkjax.optim`;
  rank 0's for ZeRO, they never reach an update) and where it was saved from, the step kind and
  rank count it was saved from (``saved_from``), and the user's ``extra`` dict (numbers,
  strings, lists, dicts, numpy/jax arrays and typed PRNG keys).

**Restore anywhere.** The form is independent of placement, device count and chunking:

* same chunk layout: each chunk is read and placed as it was saved; a chunk saved from the
  device (optax state) restores onto the host (``Host*State`` of :mod:`chunkjax.host_update`)
  and back, a ZeRO chunk onto one device or another rank count (the chunk size of a ZeRO layout
  is a multiple of the rank count, :func:`chunkjax.zero.build_zero_layout`, so e.g. 8 -> 4 ranks
  can keep the layout);
* another chunk layout (another chunk size, e.g. padded for another rank count, or another
  packing): every leaf moves by its path from its saved (chunk, offset) to its new one, params,
  master params and each per-element moment alike; each new chunk is assembled from the saved
  chunks holding its leaves, read lazily with at most two held. The parameter tree (leaf paths,
  shapes, dtypes) must be the same, every chunk must hold the same moments and the same
  optimizer step count; otherwise, and for another optimizer, a one-line :class:`CheckpointError`
  says what differs.

**Bounded host memory** (a "chunk" is one chunk's ``params + master + moments`` in bytes).
Saving copies one chunk at a time to host memory (device chunks, ZeRO shards gathered to the
whole chunk) or writes the host buffers directly (host chunks), and orbax (tensorstore) holds an
encoded copy of the chunk while it writes it: at most two chunks beyond the state (one for host
chunks). Restoring reads one chunk and places it: at most two chunks beyond the restored state
(remapping: two saved chunks, the new one and its placed copy). Measured as peak RSS growth by
``tests/test_checkpoint_memory.py`` (1.5 GiB state, 256 MiB chunks: save 0.75-1.0 chunks,
asynchronous save with a one-chunk bound 1.8-2.2, restore 0.75-1.3 beyond the state); the C
allocator may keep up to about half a chunk more after a process's first save. Device -> host
copies are never left cached on the state's jax arrays (jax keeps ``np.asarray``'s copy on the
array otherwise).

**Atomicity.** Everything is written into a hidden temporary directory
``<directory>/.tmp_step_<N:08d>_<pid>_<random>/`` which is renamed to ``step_<N:08d>`` only
after every chunk and ``meta.json`` are written and fsynced (POSIX rename is atomic within one
filesystem). A crash (SIGKILL, power loss after the fsync) during a save therefore leaves the
previous checkpoints usable and nothing that :func:`latest_step` or :func:`restore_checkpoint`
would pick up; a write error removes the temporary directory before raising
:class:`CheckpointWriteError`. Temporaries left by a killed process are removed by the next
save (:func:`save_checkpoint`, :func:`save_checkpoint_async`) into the same directory (those of
live processes are left alone).

**Asynchronous saves.** :func:`save_checkpoint` is synchronous. :func:`save_checkpoint_async`
returns as soon as the state is *snapshotted* and lets training continue while one background
thread writes: the call waits for the step's host updates, then copies the state chunk by chunk
into host memory (device chunks device -> host, host-updated chunks with numpy, since the next
step updates them in place and donates the device buffers) and hands each copy to the writer,
which writes it with the same per-chunk orbax write as the synchronous save and then does the
same finalize (``meta.json``, fsync, atomic rename). The host memory the save holds (snapshots
not yet written, and the chunk being written counted twice: its snapshot and orbax's encoded
copy) is bounded by ``max_inflight_bytes`` (bytes): before taking a snapshot the call blocks
while it would exceed the bound (back-pressure), so the save holds at most
``max(max_inflight_bytes, 2 chunks)``, never a copy of the whole state unless the bound allows
it. It returns an :class:`AsyncSave`; a background write
error is raised as :class:`CheckpointWriteError` by :meth:`AsyncSave.wait` (or, if never waited
for, by the next save into that directory) after the temporary directory has been removed, so
the previous checkpoints stay intact; a crash during the background write leaves them usable as
above. One save per directory is in flight: a save into a directory whose asynchronous save is
still running waits for it first. orbax's own ``AsyncCheckpointer`` is not used: it commits one
pytree per call with its own finalize, while a checkpoint here is many per-chunk pytrees plus
``meta.json`` under one rename, and it would copy a whole pytree to the host at once; a plain
thread around the synchronous per-chunk writes keeps one code path. Works for every step kind
above. One process writes a checkpoint directory at a time.

Usage::

    step = make_chunked_step(...)            # or make_chunked_step(..., mesh=data_mesh()) on 8 devices
    state = step.init(params)
    ...train...
    save_checkpoint(ckpt_dir, n, step, state, {"rng": key, "data_position": n, "config": cfg})
    # or, training on while it writes (host memory: at most max(256 MiB, two chunks)):
    pending = save_checkpoint_async(ckpt_dir, n, step, state, extra, max_inflight_bytes=256 << 20)
    ...train...
    pending.wait()                           # raises CheckpointWriteError if the write failed
    # later, in a fresh process, with another schedule, chunk size or device count:
    state, extra = restore_checkpoint(ckpt_dir, other_step)   # the latest_step(ckpt_dir)
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import errno as _errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import optim

FORMAT = "chunkjax-checkpoint"
VERSION = 2  # 2: with checksums.json; version 1 checkpoints (no checksums) still restore, unverified
META = "meta.json"
CHECKSUMS = "checksums.json"
_CHECKSUM_BLOCK = 256 << 10  # bytes read at a time when checksumming a file
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_step_"
_TMP_RE = re.compile(r"^\.tmp_step_(\d+)_(\d+)_[0-9a-f]+$")


@functools.cache
def _host_moments() -> dict:
    """Host state dataclass -> ((host field, optax moment name), ...). The optax names are the
    field names of optax's states: ScaleByAdamState.mu/nu, ScaleByLionState.mu, TraceState.trace.
    (chunkjax.host_update, which loads numba, is imported on first use only.)"""
    from chunkjax import host_update as hu
    return {hu.HostAdamState: (("m", "mu"), ("v", "nu")),
            hu.HostLionState: (("m", "mu"),),
            hu.HostMomentumState: (("trace", "trace"),)}


class CheckpointError(ValueError):
    """A checkpoint cannot be restored into this step (layout or optimizer mismatch, a missing or
    malformed checkpoint)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (full disk, I/O error, ...). The previous checkpoints are
    intact and the temporary directory of the failed save has been removed. ``errno`` is the
    underlying error's, when it had one."""


# ---- directory listing ----------------------------------------------------------------------

def _step_dir(directory, step: int) -> str:
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
    return [s for s in _step_numbers(directory) if os.path.isfile(os.path.join(_step_dir(directory, s), META))]


def latest_step(directory, *, verify: bool = True) -> int | None:
    """The largest step number with a complete, intact checkpoint in ``directory``, or None.

    With ``verify`` (the default) the newest checkpoint is checked file by file
    (:func:`verify_checkpoint`: reads every file once, 1-4 GB/s from the page cache); an
    incomplete one (no ``meta.json``) or a corrupt one is skipped with a ``RuntimeWarning`` that
    names it and the file at fault, and the one before it is tried. ``verify=False`` returns the
    newest :func:`all_steps` entry unchecked.
    """
    for s in reversed(_step_numbers(directory)):
        where = _step_dir(directory, s)
        if not os.path.isfile(os.path.join(where, META)):
            warnings.warn(f"checkpoint step {s} at {where} is incomplete (no {META}): skipped, using an earlier step",
                          RuntimeWarning, stacklevel=2)
            continue
        if not verify:
            return s
        try:
            verify_checkpoint(directory, s)
        except CheckpointError as e:
            warnings.warn(f"checkpoint step {s} skipped, using an earlier step: {e}", RuntimeWarning, stacklevel=2)
            continue
        return s
    return None


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
    meta, sums = _load_meta(directory, step_number)
    if sums is not None:
        root = _step_dir(directory, step_number)
        for c in range(int(meta["layout"]["n_chunks"])):
            _verify_files(root, sums, _chunk_name(c))
    return meta


# ---- checksums: every file's size and crc32, recorded at save, checked on read ----------------

def _chunk_name(c: int) -> str:
    return f"chunk_{c:05d}"


def _file_checksum(path: str) -> list[int]:
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


def _tree_checksums(root: str, sub: str) -> dict[str, list[int]]:
    """``{path relative to root ('/'-separated): [size, crc32]}`` of every file under ``root/sub``."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, sub)):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = _file_checksum(path)
    return out


def _sums_crc(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def _write_checksums(root: str, files: dict) -> None:
    body = {"format": FORMAT, "algorithm": "crc32", "files": dict(sorted(files.items()))}
    body["crc32"] = _sums_crc(body["files"])  # the manifest's own checksum
    _write_meta(os.path.join(root, CHECKSUMS), body)


def _read_checksums(root: str) -> dict | None:
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
        raise CheckpointError(f"{path} is unreadable ({_one_line(e)}): the checkpoint is corrupt, "
                              "restore an earlier step") from None
    if not ok:
        raise CheckpointError(f"{path} does not match its own checksum: the checkpoint is corrupt, "
                              "restore an earlier step")
    return files


def _verify_files(root: str, sums: dict, sub: str) -> None:
    """Check the recorded files at ``sub`` (a file) or under it (a directory) of checkpoint
    ``root``. Raises a one-line CheckpointError naming the first bad file."""
    mine = [r for r in sums if r == sub or r.startswith(sub + "/")]
    if not mine:
        raise CheckpointError(f"{os.path.join(root, sub)}: {CHECKSUMS} records no such file: the checkpoint is "
                              "corrupt, restore an earlier step")
    for rel in mine:
        path = os.path.join(root, *rel.split("/"))
        try:
            got = _file_checksum(path)
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({_one_line(e)}): the checkpoint is corrupt, "
                                  "restore an earlier step") from None
        want = [int(x) for x in sums[rel]]
        if got != want:
            raise CheckpointError(f"{path} is corrupt ({got[0]} bytes, crc32 {got[1]:08x}; saved: {want[0]} bytes, "
                                  f"crc32 {want[1]:08x}): restore an earlier step")


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


def _tmp_dir(directory, step: int) -> str:
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
    tmp = _tmp_dir(directory, step_number)
    os.rename(_step_dir(directory, step_number), tmp)
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
    chunk dtypes and every leaf slot as ``[path, chunk, offset, shape, dtype]``."""
    return {
        "chunk_size": int(layout.chunk_size),
        "n_chunks": int(layout.n_chunks),
        "chunk_dtypes": [np.dtype(d).name for d in layout.chunk_dtypes],
        "slots": [[s.path, int(s.chunk), int(s.offset), [int(x) for x in s.shape], np.dtype(s.dtype).name]
                  for s in layout.slots],
    }


def layout_fingerprint(layout) -> str:
    """sha256 (hex) of :func:`layout_spec`: equal fingerprints mean identical chunk layouts."""
    return hashlib.sha256(json.dumps(layout_spec(layout), sort_keys=True).encode()).hexdigest()


def _layout_difference(saved: dict, here: dict) -> str | None:
    """One line saying how two layout specs differ, or None if they are equal."""
    for key in ("chunk_size", "n_chunks"):
        if saved[key] != here[key]:
            return f"{key} is {saved[key]} in the checkpoint but {here[key]} in this step"
    if saved["chunk_dtypes"] != here["chunk_dtypes"]:
        c = next(i for i, (a, b) in enumerate(zip(saved["chunk_dtypes"], here["chunk_dtypes"])) if a != b)
        return f"chunk {c} has dtype {saved['chunk_dtypes'][c]} in the checkpoint but {here['chunk_dtypes'][c]} here"
    if len(saved["slots"]) != len(here["slots"]):
        return f"the checkpoint has {len(saved['slots'])} leaves but this step's params have {len(here['slots'])}"
    for a, b in zip(saved["slots"], here["slots"]):
        if a != b:
            fmt = lambda s: f"{s[0]} (chunk {s[1]}, offset {s[2]}, shape {tuple(s[3])}, {s[4]})"  # noqa: E731
            return f"leaf {fmt(a)} in the checkpoint is {fmt(b)} in this step"
    return None


# ---- optimizer state: optax tree <-> placement-independent form ------------------------------

def _optax_leaf_role(path) -> tuple[str, int | None]:
    """(field name, index) of an optax state leaf of a chunk: ``("count", None)``, or
    ``("mu", 0)`` for the chunk's moment and ``("mu", 1)`` for the rest-of-model leaf's."""
    name, idx = None, None
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            name, idx = k.name, None
        elif isinstance(k, jax.tree_util.DictKey):
            name, idx = str(k.key), None
        elif isinstance(k, jax.tree_util.SequenceKey) and name is not None:
            idx = k.idx
    return name, idx


def _optax_to_portable(opt_state, chunk_size: int) -> tuple[int | None, dict, dict]:
    """Split one chunk's optax state into (count, {moment: (chunk_size,) float32 numpy},
    {moment: rest-leaf float}).

    Raises:
      CheckpointError: a leaf that is neither a step count nor a per-element moment (e.g. a
        transformation with non-elementwise state), two moments of one name, or step counts that
        disagree.
    """
    counts, moments, rest = set(), {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name, idx = _optax_leaf_role(path)
        shape = tuple(np.shape(leaf))
        where = jax.tree_util.keystr(path)
        if name == "count" and shape == ():
            counts.add(int(np.asarray(leaf)))
        elif name is not None and idx == 0 and shape == (chunk_size,):
            if name in moments:
                raise CheckpointError(f"optax state has two moments named {name!r} (at {where}): a chain of two "
                                      "stateful optimizers has no per-chunk checkpoint form")
            moments[name] = _host_value(leaf, np.float32)
        elif name is not None and idx == 1 and shape == ():
            rest[name] = float(np.asarray(leaf))
        else:
            raise CheckpointError(f"optax state leaf {where} (shape {shape}) is neither a step count nor a "
                                  "per-element moment: only elementwise optimizers (Adam/AdamW/Lion/SGD) are supported")
    if len(counts) > 1:
        raise CheckpointError(f"optax state holds differing step counts {sorted(counts)}")
    return (counts.pop() if counts else None), moments, rest


def _portable_to_optax(template, count: int | None, moments: dict, rest: dict, chunk: int):
    """Fill the structure ``template`` (``jax.eval_shape`` of the chunk's optax init) with saved
    values as numpy arrays. Raises CheckpointError if the moment names differ."""
    _check_optax_moments(template, moments, chunk)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        name, idx = _optax_leaf_role(path)
        if name == "count" and leaf.shape == ():
            out.append(np.asarray(0 if count is None else count, leaf.dtype))
        elif idx == 0 and leaf.ndim == 1:
            out.append(np.asarray(moments[name], leaf.dtype))
        elif idx == 1 and leaf.shape == ():
            out.append(np.asarray(rest.get(name, 0.0), leaf.dtype))
        else:
            raise CheckpointError(f"this step's optax state leaf {jax.tree_util.keystr(path)} (shape {leaf.shape}) "
                                  "has no checkpoint form: only elementwise optimizers are supported")
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_optax_moments(template, names, chunk: int) -> None:
    need = sorted(_moment_names(template))
    if need != sorted(names):
        raise CheckpointError(f"chunk {chunk}: the checkpoint's optimizer moments {sorted(names)} do not match "
                              f"this step's optax state {need}: restore with the optimizer the checkpoint was saved with")


def _host_to_portable(st) -> tuple[int, dict]:
    table = _host_moments().get(type(st))
    if table is None:
        raise CheckpointError(f"host optimizer state {type(st).__name__} has no checkpoint form "
                              f"(supported: {', '.join(t.__name__ for t in _host_moments())})")
    return int(st.count), {name: getattr(st, field) for field, name in table}


def _portable_to_host(cls, count: int | None, moments: dict, chunk: int):
    _check_host_moments(cls, moments, chunk)
    table = _host_moments()[cls]
    kw = {field: np.require(moments[name], np.float32, ["C", "W", "O"]) for field, name in table}
    return cls(count=0 if count is None else int(count), **kw)


def _is_host_state(st) -> bool:
    return dataclasses.is_dataclass(st) and not isinstance(st, type)


# ---- extra: JSON with tagged arrays -----------------------------------------------------------

def _encode(x, where="extra"):
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be strings, got {k!r}")
        return {k: _encode(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return {"__prng_key__": str(jax.random.key_impl(x)), "data": _encode(np.asarray(jax.random.key_data(x)))}
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        a = np.ascontiguousarray(np.asarray(x))
        if a.dtype == object:
            raise TypeError(f"{where}: object arrays cannot be saved")
        return {"__ndarray__": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
    raise TypeError(f"{where}: {type(x).__name__} cannot be saved in extra (use numbers, strings, lists, "
                    "dicts, numpy/jax arrays or PRNG keys)")


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        if "__tuple__" in x:
            return tuple(_decode(v) for v in x["__tuple__"])
        if "__ndarray__" in x:
            dt = jnp.dtype(x["__ndarray__"])  # knows bfloat16 etc. (ml_dtypes)
            return np.frombuffer(base64.b64decode(x["data"]), dt).reshape(x["shape"]).copy()
        if "__prng_key__" in x:
            return jax.random.wrap_key_data(_decode(x["data"]), impl=x["__prng_key__"])
        return {k: _decode(v) for k, v in x.items()}
    return x


# ---- chunk I/O (module-level so tests can inject faults) -------------------------------------

def _checkpointer():
    """An orbax checkpointer for this process's own file I/O: under ``jax.distributed`` each
    process is its own primary host with no barriers to the others (the per-chunk arrays are
    numpy; chunkjax coordinates the processes itself, :func:`_save_multiprocess`)."""
    import orbax.checkpoint as ocp
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=mp), multiprocessing_options=mp)


def _write_chunk(ckptr, path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write one chunk's arrays (numpy) as an orbax PyTree checkpoint at ``path``."""
    import orbax.checkpoint as ocp
    ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave(arrays))  # orbax refuses relative paths


def _read_chunk(ckptr, path: str, names) -> dict[str, np.ndarray]:
    """Read one chunk's arrays (numpy, writable) from ``path``."""
    import orbax.checkpoint as ocp
    ra = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
    item = {n: np.zeros((), np.float32) for n in names}  # structure only (a subset of the saved arrays)
    return ckptr.restore(os.path.abspath(path),
                         args=ocp.args.PyTreeRestore(item=item, restore_args=ra, partial_restore=True))


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(d)


def _fsync_dir(d: str) -> None:
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


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


# ---- public API -------------------------------------------------------------------------------

def save_checkpoint(directory, step_number: int, step_fn, state, extra: dict | None = None, *,
                    peer_timeout_s: float | None = None) -> str:
    """Save the whole training state of ``step_fn`` as checkpoint ``step_number``, atomically.

    Waits for the step's host updates (``step_fn.wait()``, scheduled steps), then writes chunk by
    chunk: each chunk's compute params ((chunk_size,) ``step_fn.compute_dtype``), float32 master
    params and float32 optimizer moments, plus the step count of its optimizer; then
    ``meta.json`` with the layout and ``extra``. ZeRO chunks are written whole: the rank shards
    of params, master params and moments are gathered into (chunk_size,) arrays (rank order).
    Host memory beyond the state itself: at most two chunks' params, master and moments (about
    ``2 * chunk_size * (2 + 4 + 8)`` bytes for bf16 AdamW: a device chunk's host copy and orbax's
    encoded copy while it writes; one chunk for host-updated chunks). Every file's size and zlib
    crc32 go to ``checksums.json`` (read back while cached: a few percent of the save). If a
    :func:`save_checkpoint_async` into the same directory through the same ``step_fn`` is still
    running, it is waited for first. See :func:`save_checkpoint_async` for a save that lets
    training continue while it writes.

    Args:
      directory: the checkpoint root (created if missing).
      step_number: the training step (int >= 0); the checkpoint goes to ``step_<N:08d>``.
      step_fn: the :class:`chunkjax.ChunkedStep` that owns ``state``.
      state: its :class:`chunkjax.TrainState` (any placement, topology and ZeRO stage). It stays
        usable.
      extra: a JSON-like dict saved with the state (RNG keys, data position, configuration):
        numbers, strings, None, lists, tuples, dicts with string keys, numpy or jax arrays and
        typed PRNG key arrays (``jax.random.key``).
      peer_timeout_s: under ``jax.distributed`` only: seconds each process waits at most for the
        others before each chunk's gather and before the outcome (None:
        :data:`DEFAULT_PEER_TIMEOUT_S`, or 60 s plus 1 s per 100 MiB of chunk if larger).

    Returns:
      The path of the new checkpoint directory.

    Raises:
      FileExistsError: a checkpoint of ``step_number`` already exists.
      TypeError: ``extra`` holds something that cannot be saved.
      CheckpointError: the optimizer state has no per-chunk form (not elementwise), the ranks of
        a ZeRO chunk hold different step counts, or the state spans several processes.
      CheckpointWriteError: writing failed (e.g. ENOSPC); the previous checkpoints are intact and
        the partial write has been removed. Under ``jax.distributed``: a peer process was lost
        (killed, or silent past ``peer_timeout_s``); the one line names it, the writer has
        removed its temporary directory. Also the unreported failure of an earlier
        :func:`save_checkpoint_async` into ``directory`` whose :meth:`AsyncSave.wait` was never
        called (nothing new is saved then).
    """
    _previous_save(directory, step_fn)
    if _multiprocess(step_fn):
        return _save_multiprocess(directory, step_number, step_fn, state, extra, peer_timeout_s)
    return _run_save(_SaveJob(directory, step_number, step_fn, state, extra), "the state")


def _run_save(job: "_SaveJob", source: str) -> str:
    """A synchronous save: every chunk snapshotted (no copies: host chunks' own buffers are
    written directly) and written, then finalized; on failure the partial write is removed and
    the error raised (:meth:`_SaveJob.failed`). Returns the checkpoint's path."""
    stage = "creating the temporary directory"
    try:
        job.open()
        for c in range(job.n_chunks):
            stage = f"reading chunk {c} of {job.n_chunks} from {source}"
            arrays = job.snapshot(c, copy=False)
            stage = f"writing chunk {c} of {job.n_chunks}"
            job.write(c, arrays)
            del arrays
        stage = job.finalize()
    except BaseException as e:
        err = job.failed(e, getattr(job, "stage", None) or stage)
        if err is e:
            raise
        raise err from e
    finally:
        job.close()
    return job.final


def _multiprocess(step_fn) -> bool:
    """True when ``step_fn``'s mesh has devices of other processes (``jax.distributed``)."""
    mesh = getattr(step_fn, "mesh", None)
    return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


#: Default deadline (seconds) of one wait on the other processes in a multi-process save.
DEFAULT_PEER_TIMEOUT_S = 300.0


class _Peers:
    """The other processes of a multi-process save, met with a deadline through the
    ``jax.distributed`` coordination service's key-value store: before each collective every
    process posts ``<save>/<meeting>/<process>`` and waits for the others' posts, so a process
    that is gone or stuck is named instead of hanging in (or failing inside) the collective."""

    def __init__(self, step_fn, step_number: int, timeout_s: float):
        from jax._src import distributed  # the coordination client: no public API has a deadline
        self.client = distributed.global_state.client
        self.me, self.n = jax.process_index(), jax.process_count()
        count = vars(step_fn).setdefault("_checkpoint_multiprocess_saves", [0])  # same sequence on every process
        count[0] += 1
        self.prefix = f"chunkjax_checkpoint/{step_number}/{count[0]}"
        self.timeout_s = float(timeout_s)

    def meet(self, meeting: str, doing: str, timeout_s: float | None = None) -> None:
        """Wait up to the deadline for every other process to reach ``meeting``.

        Raises:
          _PeerLost: naming the processes that did not arrive (or the coordinator, unreachable).
        """
        import time
        t_end = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        key = f"{self.prefix}/{meeting}"
        try:
            self.client.key_value_set(f"{key}/{self.me}", "1")
        except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is gone
            raise _PeerLost([0], doing, _one_line(e)) from None
        missing = []
        for p in range(self.n):
            if p == self.me:
                continue
            left_ms = max(1, int(1000 * (t_end - time.monotonic())))
            try:
                self.client.blocking_key_value_get(f"{key}/{p}", left_ms if not missing else 1)
            except Exception:  # noqa: BLE001 - deadline passed, or the service is gone
                missing.append(p)
        if missing:
            raise _PeerLost(missing, doing, f"not there after {self.timeout_s if timeout_s is None else timeout_s:g} s")

    def collective(self, fn, doing: str):
        """``fn()`` (a collective over every process) with the deadline: run in a helper thread
        (a collective blocked on a stopped peer cannot be interrupted; the thread is left behind,
        a daemon, and the job has to end). CheckpointError/TypeError of ``fn`` pass through; any
        other failure or the deadline raises :class:`_PeerLost`."""
        box: list = []

        def run():
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
        t = threading.Thread(target=run, name="chunkjax-checkpoint-collective", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if not box:
            raise self.lost(TimeoutError(f"not done after {self.timeout_s:g} s"), doing)
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, (CheckpointError, TypeError)) or not isinstance(value, Exception):
            raise value
        raise self.lost(value, doing) from value

    def lost(self, e: BaseException, doing: str) -> "_PeerLost":
        """After a collective failed (a peer dropped out of it): the processes that do not also
        report the failure within a short deadline are the lost ones."""
        try:
            self.meet(f"failed/{doing}", doing, timeout_s=min(self.timeout_s, 10.0))
        except _PeerLost as p:
            return _PeerLost(p.processes, doing, _one_line(e))
        return _PeerLost([], doing, _one_line(e))

    def forget(self) -> None:
        """Delete this save's keys (process 0, once everyone has passed the last meeting)."""
        if self.me == 0:
            try:
                self.client.key_value_delete(self.prefix)
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass


class _PeerLost(Exception):
    """Processes that failed to meet the others in a multi-process save."""

    def __init__(self, processes, doing: str, why: str):
        self.processes, self.doing, self.why = list(processes), doing, why
        who = (f"process {', '.join(map(str, processes))} of {jax.process_count()}" if processes
               else "a peer process")
        super().__init__(f"{who} lost while {doing} ({why})")


def _peer_deadline(step_fn, timeout_s: float | None) -> float:
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {timeout_s}")
        return float(timeout_s)
    chunk_bytes = 14 * int(step_fn.layout.chunk_size)  # bf16 params, master, two moments
    return max(DEFAULT_PEER_TIMEOUT_S, 60.0 + chunk_bytes / (100 << 20))


def _save_multiprocess(directory, step_number: int, step_fn, state, extra, peer_timeout_s=None) -> str:
    """:func:`save_checkpoint` of a state sharded over several processes (``jax.distributed``;
    ``directory`` on a filesystem every process sees). Every process takes part in each chunk's
    all-gather, in chunk order; process 0 alone writes the files and renames the checkpoint into
    place. A write failure on process 0 does not stop the gathers (no process hangs); afterwards
    process 0's outcome is broadcast and every process raises if it failed. Before each gather
    and the broadcast the processes meet with a deadline (:class:`_Peers`): a process killed or
    stuck is named in one line by every survivor, and process 0 removes its temporary
    directory (the previous checkpoints stay intact)."""
    from jax.experimental import multihost_utils
    timeout_s = _peer_deadline(step_fn, peer_timeout_s)
    writer = jax.process_index() == 0
    job = _SaveJob(directory, step_number, step_fn, state, extra, writer=writer)
    peers = _Peers(step_fn, step_number, timeout_s)
    failure, stage = None, "creating the temporary directory"
    try:
        if writer:
            try:
                job.open()
            except Exception as e:  # noqa: BLE001 - reported after the collectives
                failure = (e, stage)
        for c in range(job.n_chunks):
            stage = f"gathering chunk {c} of {job.n_chunks}"
            peers.meet(f"chunk{c}", stage)
            arrays = peers.collective(lambda: job.snapshot(c, copy=False), stage)  # noqa: B023 - called at once
            if writer and failure is None:
                stage = f"writing chunk {c} of {job.n_chunks}"
                try:
                    job.write(c, arrays)
                except Exception as e:  # noqa: BLE001
                    failure = (e, stage)
            del arrays
        if writer and failure is None:
            try:
                job.finalize()
            except Exception as e:  # noqa: BLE001
                failure = (e, job.stage or "finalizing")
        stage = "sharing process 0's outcome"
        peers.meet("outcome", stage)
        ok = int(peers.collective(lambda: multihost_utils.broadcast_one_to_all(np.int32(failure is None)), stage))
    except _PeerLost as lost:
        shutil.rmtree(job.tmp, ignore_errors=True)  # the writer's temporary (others have none)
        prev = latest_step(directory, verify=False)
        raise CheckpointWriteError(
            f"saving checkpoint step {step_number} to {os.fspath(directory)} failed: {lost}; "
            + (f"the checkpoint itself was complete at {job.final}" if writer and os.path.isdir(job.final)
               else "the partial write was removed and the existing checkpoints are intact"
               + (f" (latest: step {prev})" if prev is not None else "") if writer
               else "process 0 writes the files: its next save removes its partial write")) from None
    finally:
        job.close()
    peers.forget()
    if failure is not None:
        err = job.failed(*failure)
        raise err from failure[0]
    if not ok:
        raise CheckpointWriteError(f"saving checkpoint step {step_number} to {os.fspath(directory)} failed on process "
                                   "0 (its error says why); the partial write was removed and the existing "
                                   "checkpoints are intact")
    return job.final


#: Default of :func:`save_checkpoint_async`'s ``max_inflight_bytes``: 1 GiB.
DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30


def save_checkpoint_async(directory, step_number: int, step_fn, state, extra: dict | None = None, *,
                          max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES) -> "AsyncSave":
    """Start saving checkpoint ``step_number`` in the background; training may go on as soon as
    this returns.

    The call waits for the step's host updates (``step_fn.wait()``), then snapshots the state
    chunk by chunk into host memory, in the calling thread: device chunks copied device -> host
    (ZeRO shards gathered), host-updated chunks copied with numpy (the next step updates them in
    place; device buffers are donated), ``extra`` encoded. Each snapshot is handed to one
    background writer thread, which writes it exactly as :func:`save_checkpoint` does (orbax
    PyTree per chunk) and drops it; after the last chunk the writer writes ``meta.json``, fsyncs
    and renames the temporary directory into place. The result is the same checkpoint, file for
    file, as :func:`save_checkpoint` of the same state would write.

    **Back-pressure.** The host memory held by the save counts each snapshot not yet written and,
    twice, the chunk being written (its snapshot and orbax's encoded copy). Before taking a
    snapshot the call blocks while one more chunk would exceed ``max_inflight_bytes`` (unless
    nothing is held), so the save holds at most ``max(max_inflight_bytes, 2 chunks)`` at all
    times (a chunk: ``params + master + moments`` bytes; :attr:`AsyncSave.peak_inflight_bytes`).
    With a bound of the state's size plus a chunk the call returns as soon as everything is
    snapshotted; with less than 3 chunks it returns once all but the last chunk have been
    written.

    **One save per directory.** Starting a save (this or :func:`save_checkpoint`) into a
    directory whose previous asynchronous save through the same ``step_fn`` is still running
    waits for that one first (the step object keeps track of its saves). Calls for one directory
    are expected from one thread and one step object.

    The writer is a non-daemon thread: a normal interpreter exit finishes the save first. A
    SIGKILL or crash during the background write leaves the previous checkpoints usable and a
    temporary directory that the next save into the directory removes (module docstring,
    *Atomicity*).

    Args:
      directory, step_number, step_fn, state, extra: as :func:`save_checkpoint`. ``state`` may be
        donated to / updated by the next training step as soon as the call returns.
      max_inflight_bytes: bound (bytes, int >= 0) on the host memory the save holds: snapshots
        not yet written plus orbax's copy of the chunk being written; at least two chunks are
        always allowed. Default 1 GiB.

    Returns:
      An :class:`AsyncSave`: ``.wait()`` (the path, or the write error), ``.done()``, ``.path``.

    Raises (in the call; nothing is left on disk then):
      ValueError: ``step_number`` < 0 or ``max_inflight_bytes`` < 0.
      FileExistsError, TypeError, CheckpointError: as :func:`save_checkpoint`, before anything is
        written or while reading the state.
      CheckpointWriteError: the temporary directory cannot be created, reading the state failed,
        or an earlier asynchronous save into ``directory`` failed and was never waited for
        (nothing new is saved then). Errors of the background write are raised by
        :meth:`AsyncSave.wait` (or, if it is never called, by the next save into the directory).
    """
    max_inflight_bytes = int(max_inflight_bytes)
    if max_inflight_bytes < 0:
        raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
    _previous_save(directory, step_fn)
    if _multiprocess(step_fn):
        raise CheckpointError("asynchronous saves of a state over several processes are not supported: use "
                              "save_checkpoint (every process calls it)")
    job = _SaveJob(directory, step_number, step_fn, state, extra)
    try:
        job.open()
    except BaseException as e:
        job.close()
        err = job.failed(e, "creating the temporary directory")
        if err is e:
            raise
        raise err from e
    handle = AsyncSave(job, max_inflight_bytes)
    _async_saves(step_fn)[job.key] = handle
    handle._thread.start()
    stage, nbytes = None, 0
    try:
        for c in range(job.n_chunks):
            if not handle._reserve(nbytes):  # the chunks are of one size: the last one's bytes
                return handle  # the writer failed: its error comes at wait()
            stage = f"reading chunk {c} of {job.n_chunks} from the state"
            arrays = job.snapshot(c, copy=True)
            nbytes = sum(a.nbytes for a in arrays.values())
            if not handle._put((c, arrays), nbytes):
                return handle
            del arrays
        stage = None
        job.state = None  # everything is snapshotted: the writer must not keep the state alive
        handle._put(_FINAL, 0)
    except BaseException as e:
        handle._abort()  # stop and join the writer before removing its temporary directory
        handle._reported = True
        err = job.failed(e, stage or "handing the chunks to the writer")
        if err is e:
            raise
        raise err from e
    return handle


_FINAL = object()  # the writer's last item: finalize
_log = logging.getLogger(__name__)


def _async_saves(step_fn) -> dict:
    """The step object's asynchronous saves still tracked: realpath of a checkpoint root -> its
    latest :class:`AsyncSave` (kept on the step the caller passes to every save: no module state)."""
    return vars(step_fn).setdefault("_checkpoint_async_saves", {})


def _previous_save(directory, step_fn) -> None:
    """Wait for the asynchronous save into ``directory`` (through ``step_fn``) still running, if
    any; raise its CheckpointWriteError if it failed and nobody has seen it through ``wait()``."""
    saves = _async_saves(step_fn)
    key = os.path.realpath(os.fspath(directory))
    prev = saves.get(key)
    if prev is None:
        return
    prev._done.wait()
    if saves.get(key) is prev:
        del saves[key]
    if prev._error is not None and not prev._reported:
        prev._reported = True
        raise prev._error


class AsyncSave:
    """A checkpoint being written in the background, from :func:`save_checkpoint_async`.

    Attributes:
      path: the checkpoint directory it creates (``<directory>/step_<N:08d>``), once complete.
      step: its step number.
      peak_inflight_bytes: the most bytes held at once by this save (snapshots not yet written,
        the chunk being written counted twice); at most ``max(max_inflight_bytes, 2 chunks)``.
    """

    def __init__(self, job: "_SaveJob", max_inflight_bytes: int):
        self._job = job
        self.path, self.step = job.final, job.step_number
        self.max_inflight_bytes = max_inflight_bytes
        self.peak_inflight_bytes = 0
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._reported = False
        self._stop = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chunkjax-checkpoint-{job.step_number}", daemon=False)

    def done(self) -> bool:
        """True once the background write has finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is complete (renamed into place and fsynced).

        Args:
          timeout: seconds to wait at most; None waits as long as it takes.

        Returns:
          :attr:`path`.

        Raises:
          CheckpointWriteError: the background write failed (e.g. ENOSPC): the previous
            checkpoints are intact and the temporary directory has been removed.
          TimeoutError: ``timeout`` passed first (the save goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} is still being written after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "writing"
        return f"AsyncSave(step={self.step}, path={self.path!r}, {state})"

    def _reserve(self, nbytes: int) -> bool:
        """Block, before a snapshot is taken, until ``nbytes`` more fit under the bound (or
        nothing is in flight). False if the writer has failed."""
        with self._cv:
            while (self._error is None and self._inflight > 0
                   and self._inflight + nbytes > self.max_inflight_bytes):
                self._cv.wait()
            return self._error is None

    def _put(self, item, nbytes: int) -> bool:
        """Hand ``item`` (a snapshot of ``nbytes``, reserved) to the writer. False if the writer
        has failed (the item is dropped)."""
        with self._cv:
            if self._error is not None:
                return False
            self._queue.append((item, nbytes))
            self._add(nbytes)
            self._cv.notify_all()
            return True

    def _add(self, nbytes: int) -> None:
        self._inflight += nbytes
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight)

    def _abort(self) -> None:
        """Stop the writer (after the chunk it is writing) and join it."""
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        job, stage = self._job, None
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    item, nbytes = self._queue.popleft()
                if item is _FINAL:
                    stage = job.finalize()
                    return
                c, arrays = item
                del item
                stage = f"writing chunk {c} of {job.n_chunks}"
                with self._cv:
                    self._add(nbytes)  # orbax's encoded copy while it writes (tensorstore)
                job.write(c, arrays)
                del arrays
                with self._cv:
                    self._inflight -= 2 * nbytes
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - kept for wait()
            err = job.failed(e, getattr(job, "stage", None) or stage)
            if err is not e:
                err.__cause__ = e
            _log.error("background checkpoint save failed: %s", err)
            with self._cv:
                self._error = err
                self._queue.clear()
                self._inflight = 0
                self._cv.notify_all()
        finally:
            job.close()
            self._done.set()


class _SaveJob:
    """One save, in the pieces both :func:`save_checkpoint` and :func:`save_checkpoint_async`
    use: checks and ``step_fn.wait()`` (constructor), ``open`` (temporary directory),
    ``snapshot`` (a chunk's arrays from the state), ``write`` (one chunk to disk), ``finalize``
    (meta.json, fsync, rename) and ``failed`` (cleanup, the error to raise)."""

    def __init__(self, directory, step_number: int, step_fn, state, extra, writer: bool = True):
        step_number = int(step_number)
        if step_number < 0:
            raise ValueError(f"step_number must be >= 0, got {step_number}")
        self.directory = directory = os.fspath(directory)
        self.key = os.path.realpath(directory)
        self.step_number = step_number
        self.final = _step_dir(directory, step_number)
        if os.path.exists(self.final):
            raise FileExistsError(f"checkpoint step {step_number} already exists at {self.final}: "
                                  "delete it or save another step")
        self.extra_json = _encode(dict(extra or {}))  # fail on bad extra before writing anything
        self.kind = _step_kind(step_fn)
        self.step_fn, self.state = step_fn, state
        self.n_chunks = step_fn.layout.n_chunks
        self.chunks_meta: list = [None] * self.n_chunks
        self.sums: dict[str, list[int]] = {}  # every written file's [size, crc32] (checksums.json)
        self.ckptr = None
        self.stage = None  # set by finalize (the writer's stage)
        if writer:  # under jax.distributed only process 0 touches the directory
            os.makedirs(directory, exist_ok=True)
            remove_stale_temporaries(directory)
        step_fn.wait(state)
        self.tmp = _tmp_dir(directory, step_number)

    def open(self) -> None:
        os.makedirs(self.tmp)
        self.ckptr = _checkpointer()

    def snapshot(self, c: int, copy: bool) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays in the portable form (its meta.json entry is kept). With
        ``copy`` every array is host memory of its own: nothing aliases the state, which the
        next step may update in place or donate."""
        arrays, self.chunks_meta[c] = _PORTABLE[self.kind](self.step_fn, self.state, c)
        if copy:
            live = _numpy_leaves((self.state.master[c], self.state.opt_state[c]))
            for name, a in arrays.items():
                if not a.flags.owndata or any(np.may_share_memory(a, x) for x in live):
                    arrays[name] = np.array(a, copy=True)  # views of jax buffers, the host chunk's own arrays
                    del a
        return arrays

    def write(self, c: int, arrays: dict[str, np.ndarray]) -> None:
        """Write chunk ``c`` and record its files' sizes and crc32 (read back while cached)."""
        _write_chunk(self.ckptr, os.path.join(self.tmp, _chunk_name(c)), arrays)
        self.sums.update(_tree_checksums(self.tmp, _chunk_name(c)))

    def finalize(self) -> str:
        """Write meta.json, fsync, rename the temporary into place; returns the last stage."""
        step_fn, lay = self.step_fn, self.step_fn.layout
        meta = {"format": FORMAT, "version": VERSION, "step": self.step_number,
                "compute_dtype": np.dtype(step_fn.compute_dtype).name,
                "layout": layout_spec(lay), "layout_fingerprint": layout_fingerprint(lay),
                "chunks": self.chunks_meta,
                "optimizer": repr(getattr(step_fn, "host_optimizer", None) or step_fn.tx),
                "saved_from": _saved_from(step_fn, self.kind),
                "extra": self.extra_json}
        if self.kind == "storage" and _ef_active(step_fn.opt):
            meta[EF_RESIDUAL] = True
        self.stage = f"writing {META}"
        _write_meta(os.path.join(self.tmp, META), meta)
        self.stage = f"writing {CHECKSUMS}"
        self.sums[META] = _file_checksum(os.path.join(self.tmp, META))
        _write_checksums(self.tmp, self.sums)
        self.stage = "syncing to disk"
        _fsync_tree(self.tmp)
        self.stage = "renaming the temporary directory into place"
        os.rename(self.tmp, self.final)
        _fsync_dir(self.directory)
        self.stage = None
        self.state = None  # the snapshot is on disk: do not keep the state alive
        return "done"

    def failed(self, e: BaseException, stage: str) -> BaseException:
        """Remove the temporary directory; the exception to raise for ``e`` (``e`` itself for
        interrupts, CheckpointError, TypeError and a storage worker's StorageError, else a one-line
        CheckpointWriteError)."""
        from chunkjax.storage import StorageError  # a storage-tier worker's own one-line error
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.state = None
        if not isinstance(e, Exception) or isinstance(e, (CheckpointError, TypeError, CheckpointWriteError,
                                                           StorageError)):
            return e
        prev = latest_step(self.directory, verify=False)
        code = getattr(e, "errno", None)
        tag = f" [{_errno.errorcode.get(code, code)}]" if code else ""
        msg = (f"saving checkpoint step {self.step_number} to {self.directory} failed while {stage}{tag}: "
               f"{_one_line(e)}; the partial write was removed" +
               (f" and the existing checkpoints are intact (latest: step {prev})" if prev is not None else ""))
        return CheckpointWriteError(code, msg) if code else CheckpointWriteError(msg)

    def close(self) -> None:
        if self.ckptr is not None:
            self.ckptr.close()
            self.ckptr = None


def _numpy_leaves(x) -> list[np.ndarray]:
    """The numpy arrays inside tuples, lists, dicts and dataclasses (host optimizer states)."""
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for v in x for a in _numpy_leaves(v)]
    if isinstance(x, dict):
        return [a for v in x.values() for a in _numpy_leaves(v)]
    if _is_host_state(x):
        return [a for f in dataclasses.fields(x) for a in _numpy_leaves(getattr(x, f.name))]
    return []


def _host_value(a, dtype=None) -> np.ndarray:
    """``np.asarray(a, dtype)`` without leaving the host copy cached on ``a``: jax keeps
    np.asarray's device -> host copy on the jax.Array for the array's lifetime, which would hold
    every saved device chunk in host memory until the state is donated. A temporary Array over
    the same device buffers takes the cache and is dropped with it."""
    if isinstance(a, jax.Array) and not a.is_deleted():
        a = jax.make_array_from_single_device_arrays(a.shape, a.sharding, [s.data for s in a.addressable_shards])
    return np.asarray(a, dtype)


def _step_kind(step_fn) -> str:
    """``"chunked"`` for a :class:`chunkjax.ChunkedStep` (one device or a ZeRO mesh: its
    ``topology``), ``"storage"`` for a storage-tier optimizer's view.

    Raises:
      CheckpointError: an object that is neither.
    """
    if isinstance(step_fn, _StorageView):
        return "storage"
    if all(hasattr(step_fn, a) for a in ("layout", "placement", "topology", "host_chunks")):
        return "chunked"
    raise CheckpointError(f"cannot checkpoint a {type(step_fn).__name__}: pass a chunkjax.ChunkedStep")


def _saved_from(step_fn, kind: str) -> dict:
    """meta.json's ``saved_from``: the step kind, its rank count and ZeRO stage."""
    if kind == "storage":
        return {"step": type(step_fn.opt).__name__, "n_ranks": 1, "storage_dirs": len(step_fn.opt.dirs)}
    if step_fn.mesh is not None:
        return {"step": "ChunkedStep", "n_ranks": step_fn.n_ranks, "zero_stage": step_fn.zero_stage}
    return {"step": "ChunkedStep", "n_ranks": 1}


def _chunked_chunk_portable(step_fn, state, c: int) -> tuple[dict, dict]:
    """Chunk ``c`` of a :class:`chunkjax.ChunkedStep`'s state in the portable (single-device)
    form: ``({"params", "master", moments...: (chunk_size,) numpy}, its meta.json entry)``. On a
    mesh, ZeRO shards are gathered (:func:`_zero_chunk_portable`) and host-updated chunks' per-rank
    slices concatenated in rank order.

    Raises:
      CheckpointError: step counts that differ over the ranks (of this process), or the errors of
        :func:`_optax_to_portable`.
    """
    loc = "host" if c in set(step_fn.host_chunks) else step_fn.placement.update_locations[c]
    st = state.opt_state[c]
    if step_fn.mesh is not None:
        where = f"zero{step_fn.zero_stage}:{loc}"
        if loc != "host":
            arrays, cm = _zero_chunk_portable(step_fn, state, c)
            return arrays, dict(cm, saved_from=where)
        # this process's ranks (the others' slices are None under jax.distributed: gathered below)
        ports = [None if x is None else _host_to_portable(x) for x in st]
        counts = sorted({p[0] for p in ports if p is not None})
        if len(counts) > 1:
            raise CheckpointError(f"chunk {c}: the ranks' host optimizer step counts differ ({counts})")
        names = next(p[1] for p in ports if p is not None)
        gather = step_fn.topology.gather_slices  # a collective under jax.distributed
        moments = {n: gather(tuple(None if p is None else p[1][n] for p in ports)) for n in names}
        del ports
        arrays = {"params": _whole(state.params[c], f"chunk {c}'s params"),
                  "master": gather(state.master[c]).astype(np.float32, copy=False), **moments}
        return arrays, {"count": counts[0], "moments": sorted(moments), "rest": {}, "saved_from": where}
    if _is_host_state(st):
        count, moments = _host_to_portable(st)
        rest = {}
    else:
        count, moments, rest = _optax_to_portable(st, step_fn.layout.chunk_size)
    arrays = {"params": _host_value(state.params[c]), "master": _host_value(state.master[c], np.float32), **moments}
    return arrays, {"count": count, "moments": sorted(set(_moment_names(st))), "rest": rest, "saved_from": loc}


def _whole(a, what: str) -> np.ndarray:
    """The whole global array ``a`` as numpy. Under ``jax.distributed`` (a mesh over several
    processes) the shards are all-gathered to every process (a collective: every process saves
    the same chunks in the same order)."""
    del what
    if not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return _host_value(a)


def _zero_chunk_portable(step_fn, state, c: int) -> tuple[dict, dict]:
    """Chunk ``c`` (device- or stream-updated) of a ZeRO state in the single-device form: the
    sharded (chunk_size,) params and master gathered to whole numpy arrays, each rank's
    (chunk_size/N,) moment slice concatenated in rank order (rank r owns elements
    [r*chunk_size/N, (r+1)*...)).

    The per-rank step counts must agree; the per-rank moments of the rest-of-model leaf (which
    never reach a parameter update, :mod:`chunkjax.optim`) are taken from rank 0.

    Raises:
      CheckpointError: counts that differ over the ranks, a state leaf without the leading rank
        axis, or any error of :func:`_optax_to_portable`.
    """
    n, cs = step_fn.n_ranks, step_fn.layout.chunk_size
    st = _zero_optax_unshard(state.opt_state[c], n, c)
    count, moments, rest = _optax_to_portable(st, cs)
    del st
    arrays = {"params": _whole(state.params[c], f"chunk {c}'s params"),
              "master": _whole(state.master[c], f"chunk {c}'s master params").astype(np.float32, copy=False), **moments}
    return arrays, {"count": count, "moments": sorted(moments), "rest": rest}


def _zero_optax_unshard(opt_state, n_ranks: int, chunk: int):
    """A ZeRO chunk's optax state (every leaf with a leading rank axis) as the optax state of the
    whole chunk (numpy): (N,) counts -> (), (N, chunk_size/N) moments -> (chunk_size,), other
    (N,) per-rank scalars -> rank 0's."""
    def one(path, leaf):
        a = _whole(leaf, f"chunk {chunk}'s optimizer state")
        where = jax.tree_util.keystr(path)
        if a.ndim == 0 or a.shape[0] != n_ranks or a.ndim > 2:
            raise CheckpointError(f"chunk {chunk}: ZeRO optimizer state leaf {where} has shape {a.shape}, not "
                                  f"({n_ranks}, ...) with one row per rank")
        name, idx = _optax_leaf_role(path)
        if a.ndim == 2:
            return a.reshape(-1)
        if name == "count" and np.any(a != a[0]):
            raise CheckpointError(f"chunk {chunk}: the ranks' optimizer step counts differ ({sorted(set(a.tolist()))})")
        return a[0]
    return jax.tree_util.tree_map_with_path(one, opt_state)


@dataclasses.dataclass
class _StorageView:
    """A storage-tier optimizer seen as a step object by :class:`_SaveJob`: its layout, compute
    dtype and optimizer (for meta.json); nothing to wait for (its steps commit synchronously)."""
    opt: object
    layout: object
    compute_dtype: object

    @property
    def tx(self):
        return self.opt.spec

    def wait(self, state=None) -> None:
        del state  # its steps commit synchronously


def _ef_active(opt) -> bool:
    return bool(getattr(opt, "error_feedback", False)) and getattr(opt, "compression", None) == "topk"


def _storage_chunk_portable(view: _StorageView, state, c: int) -> tuple[dict, dict]:
    """Chunk ``c`` of a storage-tier optimizer at its committed step, read by its worker:
    master, AdamW ``mu``/``nu``, compute params = master cast to the compute dtype (what the
    workers send back), and with error feedback the residual ``ef_residual``."""
    opt = view.opt
    master, m, v = opt.read_chunk(c)
    arrays = {"params": master.astype(np.dtype(view.compute_dtype)), "master": master, "mu": m, "nu": v}
    if _ef_active(opt) and c in opt._residual:
        arrays[EF_RESIDUAL] = np.asarray(opt._residual[c], np.float32)
    elif _ef_active(opt):
        arrays[EF_RESIDUAL] = np.zeros_like(master)
    return arrays, {"count": opt.committed_step, "moments": ["mu", "nu"], "rest": {}, "saved_from": "storage"}


_PORTABLE = {"chunked": _chunked_chunk_portable, "storage": _storage_chunk_portable}

#: Name of the optional per-chunk error-feedback residual array of a storage-tier checkpoint.
EF_RESIDUAL = "ef_residual"


def _moment_names(st) -> list[str]:
    if _is_host_state(st):
        return [name for _, name in _host_moments()[type(st)]]
    return [_optax_leaf_role(p)[0] for p, l in jax.tree_util.tree_flatten_with_path(st)[0]
            if _optax_leaf_role(p)[1] == 0 and np.ndim(l) == 1]


def _write_meta(path: str, meta: dict) -> None:
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
        or corrupt, or not a chunkjax checkpoint of a known version.
    """
    if step_number is None:
        step_number = latest_step(directory)
        if step_number is None:
            raise FileNotFoundError(f"no complete checkpoint in {os.fspath(directory)}")
    return _load_meta(directory, step_number)[0]


def _load_meta(directory, step_number: int) -> tuple[dict, dict | None]:
    """(meta.json, the recorded checksums or None for a version-1 checkpoint), meta.json verified."""
    root = _step_dir(directory, step_number)
    path = os.path.join(root, META)
    if not os.path.isfile(path):
        have = all_steps(directory)
        raise FileNotFoundError(f"no complete checkpoint of step {step_number} in {os.fspath(directory)} "
                                f"(complete steps: {have})")
    sums = _read_checksums(root)
    if sums is not None:
        _verify_files(root, sums, META)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({_one_line(e)}): the checkpoint is corrupt, "
                              "restore an earlier step") from None
    if meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} file "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    if sums is None and meta["version"] >= 2:
        raise CheckpointError(f"{os.path.join(root, CHECKSUMS)} is missing: the checkpoint is incomplete, "
                              "restore an earlier step")
    if sums is None:
        _log.warning("checkpoint %s has no %s (saved before version 2): restored unverified", root, CHECKSUMS)
    return meta, sums


def restore_checkpoint(directory, step_fn, step_number: int | None = None):
    """Restore a checkpoint into ``step_fn``'s placement, layout and devices, chunk by chunk.

    ``step_fn`` is a :class:`chunkjax.ChunkedStep` on one device (any placement or
    schedule: device / pinned host jax arrays with an optax state, or numpy master and
    ``Host*State`` for host-updated chunks) or over a ZeRO mesh (any stage, device count,
    process count and placement: every chunk sharded over its mesh, each process placing its own
    shards; host-updated chunks as one numpy slice and one ``Host*State`` per local rank). The
    checkpoint may come from any of them. If the compute
    dtype differs from the saved one, compute params are recast from the float32 master params.

    When the chunk layouts are equal each chunk is read and placed as it was saved. Otherwise
    (another chunk size, e.g. a ZeRO layout padded to another rank count, or another packing)
    every leaf is moved by its path: each new chunk is assembled from the saved chunks holding
    its leaves (params, master params and every optimizer moment element by element), reading
    saved chunks lazily with at most two held; padding is zero. The parameter tree (leaf paths,
    shapes, dtypes) must be the same, every saved chunk must hold the same moments and, when
    remapping, the same optimizer step count (the remapped chunks take it).

    Host memory beyond the restored state: two chunks (equal layouts: the chunk read and its
    placed copy) or four (remapping: two saved chunks, the new chunk being assembled and its
    placed copy), each ``params + master + moments``. Every file is checked against its
    recorded crc32 (``checksums.json``) just before it is read.

    Args:
      directory: the checkpoint root.
      step_fn: the :class:`chunkjax.ChunkedStep` to restore into (any topology).
      step_number: which step; None for :func:`latest_step`.

    Returns:
      ``(state, extra)``: a :class:`chunkjax.TrainState`, and the saved ``extra``
      dict (arrays come back as numpy arrays, PRNG keys as typed key arrays, tuples as tuples).

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: a file of the checkpoint missing, unreadable or corrupt (one line naming
        it; with ``step_number`` None such a newest checkpoint is skipped with a warning),
        another parameter tree (the one-line message names the first leaf that
        differs), optimizer moments that cannot be converted into this step's optimizer state,
        step counts that differ over the chunks when the layout changes, or a step of another
        kind.
    """
    kind = _step_kind(step_fn)
    meta = read_meta(directory, step_number)
    root = _step_dir(directory, meta["step"])
    lay = step_fn.layout
    saved, here = meta["layout"], layout_spec(lay)
    remap = _layout_difference(saved, here) is not None
    where = f"checkpoint step {meta['step']} in {os.fspath(directory)}"
    if remap:
        diff = _tree_difference(saved, here)
        if diff is not None:
            raise CheckpointError(f"{where} holds another parameter tree: {diff}")
    moments, count, rest = _common_optimizer(meta, where, need_one_count=remap)
    place = _Placer(step_fn, kind)
    # check every chunk's optimizer form before reading any array
    for c in range(lay.n_chunks):
        place.check(c, moments if remap else meta["chunks"][c]["moments"])
    cdt = np.dtype(step_fn.compute_dtype)
    same_dtype = meta["compute_dtype"] == cdt.name
    names = (["params"] if same_dtype else []) + ["master", *moments]
    ckptr = _checkpointer()
    ps, ms, os_ = [], [], []
    try:
        src = _SavedChunks(ckptr, root, names, keep=2 if remap else 1)
        for c in range(lay.n_chunks):
            if remap:
                arrs = _assemble_chunk(src, saved, lay, c, names)
                cm = {"count": count, "rest": rest}
            else:
                arrs = src.take(c)
                cm = meta["chunks"][c]
            master = np.require(arrs.pop("master"), np.float32, ["C", "W", "O"])
            params = arrs.pop("params") if same_dtype else master.astype(cdt)
            p, m, o = place(c, params, master, cm["count"], arrs, cm.get("rest", {}))
            ps.append(p), ms.append(m), os_.append(o)
            del arrs, master, params, p, m, o
    finally:
        ckptr.close()
    jax.block_until_ready([x for x in ps + ms if isinstance(x, jax.Array)])
    return place.state(ps, ms, os_), _decode(meta["extra"])


def _tree_difference(saved: dict, here: dict) -> str | None:
    """One line naming the first leaf whose path, shape or dtype differs between two layout
    specs (the parameter trees), or None if the trees match (chunk placement may differ)."""
    a = {s[0]: (tuple(s[3]), s[4]) for s in saved["slots"]}
    b = {s[0]: (tuple(s[3]), s[4]) for s in here["slots"]}
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


def _common_optimizer(meta: dict, where: str, need_one_count: bool) -> tuple[list[str], int | None, dict]:
    """(moment names, step count, rest scalars) shared by the checkpoint's chunks.

    Raises:
      CheckpointError: chunks saved with different moments, or (``need_one_count``) different
        optimizer step counts, which a changed chunk layout could not keep apart.
    """
    chunks = meta["chunks"]
    names = {tuple(sorted(cm["moments"])) for cm in chunks}
    if len(names) != 1:
        raise CheckpointError(f"{where}: its chunks hold different optimizer moments {sorted(names)}")
    counts = {cm["count"] for cm in chunks}
    if need_one_count and len(counts) != 1:
        raise CheckpointError(f"{where}: its chunks hold different optimizer step counts {sorted(counts, key=str)}, "
                              "so they cannot be remapped into another chunk layout: restore with the saved layout")
    return list(names.pop()), chunks[0]["count"], chunks[0].get("rest", {})


class _SavedChunks:
    """The saved chunks of one checkpoint, read lazily by index with at most ``keep`` held."""

    def __init__(self, ckptr, root: str, names, keep: int):
        self.ckptr, self.root, self.names, self.keep = ckptr, root, list(names), keep
        self.held: dict[int, dict] = {}  # insertion order = least recently used first
        self.sums = _read_checksums(root)  # None: a version-1 checkpoint, read unverified

    def _read(self, c: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s files checked against their checksums, then read (CheckpointError
        naming the first bad file)."""
        if self.sums is not None:
            _verify_files(self.root, self.sums, _chunk_name(c))
        return _read_chunk(self.ckptr, os.path.join(self.root, _chunk_name(c)), self.names)

    def get(self, c: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays (held for later calls; the least recently used is dropped)."""
        if c in self.held:
            self.held[c] = self.held.pop(c)
            return self.held[c]
        while len(self.held) >= self.keep:
            del self.held[next(iter(self.held))]
        self.held[c] = self._read(c)
        return self.held[c]

    def take(self, c: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays, not held (the caller owns them)."""
        out = self.held.pop(c, None)
        if out is None:
            out = self._read(c)
        return out


def _assemble_chunk(src: _SavedChunks, saved: dict, lay, c: int, names) -> dict[str, np.ndarray]:
    """New chunk ``c`` of ``lay``: ``{name: (lay.chunk_size,) numpy}`` for every saved array
    name, each leaf copied from its (chunk, offset) in the saved layout spec; zero padding.
    Leaves are visited in saved (chunk, offset) order, so each saved chunk is read once per new
    chunk."""
    where = {s[0]: (s[1], s[2]) for s in saved["slots"]}
    slots = sorted(lay.chunk_leaves(c), key=lambda s: where[s.path])
    out: dict[str, np.ndarray] = {}
    for s in slots:
        sc, so = where[s.path]
        arrs = src.get(sc)
        for n in names:
            if n not in out:
                out[n] = np.zeros((lay.chunk_size,), arrs[n].dtype)
            out[n][s.offset:s.offset + s.size] = arrs[n][so:so + s.size]
    if not slots:  # a chunk without leaves (not built by build_layout): zeros
        out = {n: np.zeros((lay.chunk_size,), np.float32) for n in names}
    return out


class _Placer:
    """Places restored chunks (whole (chunk_size,) numpy arrays in the portable form) where a
    :class:`chunkjax.ChunkedStep` keeps them, through its topology: device / pinned host jax
    arrays (ZeRO shards on a mesh, each process building only its own shards), or numpy master
    and ``Host*State`` for host-updated chunks (on a mesh one slice and state per local rank)."""

    def __init__(self, step_fn, kind: str):
        self.step, self.kind = step_fn, kind
        lay = step_fn.layout
        self.template = jax.eval_shape(lambda m: optim.init_chunk_state(step_fn.tx, m),
                                       jax.ShapeDtypeStruct((lay.chunk_size,), jnp.float32))
        self.host = set(step_fn.host_chunks)
        self.host_cls = type(step_fn.host_optimizer.host_state(1)) if self.host else None
        if self.host:  # as init does: numba must not compile while XLA compiles
            from chunkjax.updaters import warm_host_kernel
            warm_host_kernel(step_fn.host_optimizer, step_fn.compute_dtype)

    def check(self, c: int, moments) -> None:
        """Raise CheckpointError if chunk ``c`` cannot take these moment names."""
        if c in self.host:
            _check_host_moments(self.host_cls, moments, c)
        else:
            _check_optax_moments(self.template, moments, c)

    def __call__(self, c, params, master, count, moments, rest):
        """(params, master, opt_state) of chunk ``c``, placed."""
        step, cdt = self.step, np.dtype(self.step.compute_dtype)
        topo, pl = step.topology, step.placement
        p = topo.put(np.require(params, cdt, ["C", "W", "O"]), topo.param_sharding(pl.param_kinds[c]))
        if c in self.host:
            if step.mesh is None:
                return p, master, _portable_to_host(self.host_cls, count, moments, c)
            local = set(topo.local_ranks())
            sl = [topo.rank_slice(r, step.layout.chunk_size) if r in local else None for r in range(step.n_ranks)]
            return (p, tuple(None if x is None else master[x].copy() for x in sl),
                    tuple(None if x is None else _portable_to_host(self.host_cls, count,
                                                                   {k: v[x] for k, v in moments.items()}, c)
                          for x in sl))
        sk = pl.state_kinds[c]
        opt = _portable_to_optax(self.template, count, moments, rest, c)
        if step.mesh is not None:  # every leaf with a leading rank axis (chunkjax.topology)
            n = step.n_ranks
            opt = jax.tree.map(lambda a: a.reshape(n, -1) if a.ndim == 1 else np.full((n,), a, a.dtype), opt)
        ssh = topo.state_shardings(opt, sk)
        return (p, topo.put(master, topo.shard_sharding(sk)),
                jax.tree.map(lambda a, sh: topo.put(np.asarray(a), sh), opt, ssh))

    def state(self, ps, ms, os_):
        from chunkjax.step import TrainState
        return TrainState(tuple(ps), tuple(ms), tuple(os_))


def _check_host_moments(cls, names, chunk):
    table = _host_moments().get(cls)
    if table is None:
        raise CheckpointError(f"host optimizer state {cls.__name__} has no checkpoint form")
    need = sorted(n for _, n in table)
    if sorted(names) != need:
        raise CheckpointError(f"chunk {chunk}: the checkpoint's optimizer moments {sorted(names)} cannot restore "
                              f"into {cls.__name__} (needs {need}): restore with the optimizer it was saved with")


def export_params(step_fn, state):
    """The float32 master params as a plain params pytree.

    Args:
      step_fn: the :class:`chunkjax.ChunkedStep` that owns ``state`` (its pending host updates are
        waited for first).
      state: a :class:`chunkjax.TrainState` in any placement (on a mesh of one process).

    Returns:
      The pytree of ``step_fn.layout`` (the model's structure) with one float32 numpy array of
      the leaf's shape per leaf. Built one chunk at a time: host memory holds the result (4 bytes
      per parameter) plus one (chunk_size,) float32 chunk; nothing is placed on the device.
    """
    step_fn.wait(state)
    lay = step_fn.layout
    leaves = [None] * len(lay.slots)
    by_chunk: dict[int, list[int]] = {}
    for i, s in enumerate(lay.slots):
        by_chunk.setdefault(s.chunk, []).append(i)
    for c, idx in by_chunk.items():
        m = state.master[c]
        m = np.concatenate(m) if isinstance(m, tuple) else np.asarray(m, np.float32)  # tuple: ZeRO rank slices
        for i in idx:
            s = lay.slots[i]
            leaves[i] = np.array(m[s.offset:s.offset + s.size].reshape(s.shape), np.float32)
        del m
    return lay.treedef.unflatten(leaves)


def export_checkpoint_params(directory, layout, step_number: int | None = None):
    """Like :func:`export_params`, read from a checkpoint instead of a live state (no step
    object, nothing placed on a device).

    Args:
      directory: the checkpoint root.
      layout: a :class:`~chunkjax.layout.ChunkLayout` of the checkpoint's parameter tree (same
        leaf paths, shapes and dtypes; its chunking may differ from the saved one).
      step_number: which step; None for :func:`latest_step`.

    Returns:
      The pytree of ``layout`` with one float32 numpy array of the leaf's shape per leaf, read
      one saved chunk at a time.

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: another parameter tree (the message names the first leaf that differs).
    """
    meta = read_meta(directory, step_number)
    diff = _tree_difference(meta["layout"], layout_spec(layout))
    if diff is not None:
        raise CheckpointError(f"checkpoint step {meta['step']} holds another parameter tree: {diff}")
    root = _step_dir(directory, meta["step"])
    index = {s.path: i for i, s in enumerate(layout.slots)}
    ckptr = _checkpointer()
    leaves = [None] * len(layout.slots)
    try:
        src = _SavedChunks(ckptr, root, ["master"], keep=1)
        for c in range(meta["layout"]["n_chunks"]):
            m = src.take(c)["master"]
            for path, chunk, off, shape, _ in meta["layout"]["slots"]:
                if chunk == c:
                    size = int(np.prod(shape, dtype=np.int64))
                    leaves[index[path]] = np.array(m[off:off + size].reshape(shape), np.float32)
            del m
    finally:
        ckptr.close()
    return layout.treedef.unflatten(leaves)


# ---- the storage tier (chunkjax.near_storage) -------------------------------------------------

def _check_storage_layout(opt, layout) -> None:
    sizes = list(opt.chunk_sizes.values())
    if len(sizes) != layout.n_chunks or any(n != layout.chunk_size for n in sizes):
        raise CheckpointError(f"the optimizer's {len(sizes)} chunks of {sorted(set(sizes))} elements do not match the "
                              f"layout's {layout.n_chunks} chunks of {layout.chunk_size}: pass the layout whose "
                              "pack() made the optimizer's chunks")


def save_storage_checkpoint(directory, step_number: int, opt, layout, extra: dict | None = None, *,
                            compute_dtype=jnp.bfloat16) -> str:
    """Save the state of a storage-tier optimizer (optimizer state on disk, Smart-Infinity
    section 4) as a chunkjax checkpoint, chunk by chunk and atomically, in the same format as
    :func:`save_checkpoint` (so :func:`restore_checkpoint` can bring it into memory, any
    placement, device count or chunk size, and :func:`restore_storage_checkpoint` back onto
    storage).

    Each chunk's float32 master, AdamW ``mu`` and ``nu`` at the committed step are read by the
    worker that owns the chunk (:meth:`~chunkjax.near_storage.NearStorageOptimizer.read_chunk`),
    so host memory holds one chunk (``12 * chunk_size`` bytes plus its compute params) at a time;
    with error feedback the chunk's residual (trainer memory) is saved with it as
    ``ef_residual``. The optimizer step count is the committed step. Atomicity, the temporary
    directory and the errors are those of :func:`save_checkpoint`.

    Args:
      directory: the checkpoint root (created if missing).
      step_number: the training step (int >= 0), usually ``opt.committed_step``.
      opt: a :class:`chunkjax.near_storage.NearStorageOptimizer` (AdamW) with no step in flight.
      layout: the :class:`~chunkjax.layout.ChunkLayout` whose ``pack`` made the optimizer's
        chunks: ``layout.n_chunks`` chunks of ``layout.chunk_size`` elements.
      extra: as in :func:`save_checkpoint` (data position, RNG keys, configuration).
      compute_dtype: dtype of the saved compute params (the master cast), default bfloat16.

    Returns:
      The path of the new checkpoint directory.

    Raises:
      CheckpointError: the optimizer's chunks do not match ``layout``.
      FileExistsError, TypeError, CheckpointWriteError: as :func:`save_checkpoint`.
      chunkjax.storage.StorageError: a worker is dead or failed to read a chunk (nothing is
        left behind: the partial write is removed first).
    """
    _check_storage_layout(opt, layout)
    return _run_save(_SaveJob(directory, step_number, _StorageView(opt, layout, compute_dtype), None, extra),
                     "storage")


def restore_storage_checkpoint(directory, dirs, spec, layout, step_number: int | None = None, **opt_kwargs):
    """Restore a checkpoint onto storage: a new
    :class:`chunkjax.near_storage.NearStorageOptimizer` over ``dirs`` whose chunk files hold the
    checkpoint's master params and AdamW moments, committed at the checkpoint's optimizer step.

    The checkpoint may come from a storage-tier run (:func:`save_storage_checkpoint`, any number
    of storage directories) or from memory (:func:`save_checkpoint` of a ``ChunkedStep``,
    any topology with AdamW, any placement). ``layout`` may chunk the
    same parameter tree differently (another chunk size): leaves are then moved by path as in
    :func:`restore_checkpoint`. Chunks are read, assembled and streamed to their worker one at a
    time (host memory: one chunk, two saved chunks plus the new one when remapping). With
    ``error_feedback=True`` the saved residuals are restored (zeros when the checkpoint has
    none, e.g. one saved from memory).

    Args:
      directory: the checkpoint root.
      dirs: the storage directories for the new optimizer (one per storage device); they must
        hold no committed run.
      spec: the :class:`chunkjax.host_update.AdamW` to continue with (learning-rate schedule,
        betas, weight decay, clipping); the step count comes from the checkpoint.
      layout: the :class:`~chunkjax.layout.ChunkLayout` the caller packs gradients with.
      step_number: which step; None for :func:`latest_step`.
      **opt_kwargs: further ``NearStorageOptimizer`` arguments (compression, topk_ratio,
        error_feedback, link_model, fsync, ...).

    Returns:
      ``(opt, extra)``: the optimizer (its ``committed_step`` is the saved optimizer step count)
      and the checkpoint's ``extra`` dict.

    Raises:
      FileNotFoundError: no complete checkpoint (of that step).
      CheckpointError: another parameter tree, an optimizer other than Adam/AdamW (moments other
        than ``mu``, ``nu``), chunks with different step counts, or ``dirs`` that already hold a
        committed run (restore into empty directories; nothing is written then).
      chunkjax.storage.StorageError: a worker failed (e.g. a full disk); no step is committed.
    """
    from chunkjax.storage.near import NearStorageOptimizer
    from chunkjax.storage import read_manifest
    meta = read_meta(directory, step_number)
    where = f"checkpoint step {meta['step']} in {os.fspath(directory)}"
    saved, here = meta["layout"], layout_spec(layout)
    remap = _layout_difference(saved, here) is not None
    if remap:
        diff = _tree_difference(saved, here)
        if diff is not None:
            raise CheckpointError(f"{where} holds another parameter tree: {diff}")
    moments, count, _ = _common_optimizer(meta, where, need_one_count=True)
    if sorted(moments) != ["mu", "nu"] or count is None:
        raise CheckpointError(f"{where} holds optimizer moments {sorted(moments)}: the storage tier runs AdamW "
                              "(mu, nu); restore it into memory with restore_checkpoint instead")
    dirs = [os.fspath(d) for d in dirs]
    used = [d for d in dirs if read_manifest(d) is not None]
    if used:
        raise CheckpointError(f"{used} already hold a storage-tier run: restore into empty directories")
    root = _step_dir(directory, meta["step"])
    names = ["master", "mu", "nu"]
    ckptr = _checkpointer()
    try:
        residual = None
        if opt_kwargs.get("error_feedback") and opt_kwargs.get("compression") == "topk" and meta.get(EF_RESIDUAL):
            rsrc = _SavedChunks(ckptr, root, [EF_RESIDUAL], keep=2 if remap else 1)
            residual = {c: (_assemble_chunk(rsrc, saved, layout, c, [EF_RESIDUAL]) if remap
                            else rsrc.take(c))[EF_RESIDUAL] for c in range(layout.n_chunks)}
            del rsrc
        src = _SavedChunks(ckptr, root, names, keep=2 if remap else 1)

        def state_of(c):
            arrs = _assemble_chunk(src, saved, layout, c, names) if remap else src.take(c)
            return tuple(np.asarray(arrs[n], np.float32) for n in names)

        opt = NearStorageOptimizer(dirs, [layout.chunk_size] * layout.n_chunks, spec, init_state=state_of,
                                   init_step=int(count), init_residual=residual, **opt_kwargs)
    finally:
        ckptr.close()
    return opt, _decode(meta["extra"])
