"""Speculative host updates: the host kernel overlaps the backward with clipping, non-finite skip
and loss scaling (SuperOffload's speculation-then-validation), rolled back by inverting the step.

The host thread of a step (:class:`chunkjax.updaters.HostWork`) updates each host chunk as soon as
its gradient is complete, while the device still runs the rest of the backward. With global-norm
clipping, a non-finite skip (``nonfinite="skip"``) or loss scaling, the gradient's factor depends
on the global norm, known only at the end of the backward. :class:`Speculation` then:

1. *speculates*: a chunk whose gradient is ready before the norm is known is updated with the
   factor of the common case (no clipping, finite gradients: ``clip_scale(max, 0)``, times the
   loss-scale inverse), its gradient kept for a rollback. The rollback (the step's ``rollback``):
   ``"backup"`` (default: the bits of waiting for the norm) first copies the chunk's float32
   master params and optimizer state into a :class:`BackupPool` (12 bytes per parameter for
   AdamW, 8 for Lion and SGD with momentum); ``"invert"`` undoes the step from the new state,
   the gradient and the factor (:func:`chunkjax.host_update.host_invert_`,
   :mod:`chunkjax.kernels_inverse`): no copy, every host chunk can speculate, but only float32
   tolerance, and not in the spike regime below (so it is not the default); a chunk whose step
   is not invertible (a zero decay rate, ``lr * wd > 1/2``) is backed up instead;
2. *waits* for the norm when the bound has no room for one more chunk (the kept gradients'
   bytes for inversion, the pool's for backups), when a skip is possible and the chunk's
   gradient is not finite (a NaN would erase the old state: no inverse then), or when the policy
   says so: ``speculation_policy="after_common"`` (default) speculates only when the previous
   step's factor was the common one (not on a process's first step), so that steady clipping
   waits instead of paying for every chunk twice (and the inversion stays well conditioned);
   ``"always"`` speculates every step. On a speculating step a chunk that waits for a factor
   other than the guess gets the bits of speculating on it
   (:func:`chunkjax.host_update.host_canonical_`, one pass): results do not depend on the norm's
   timing nor on the bound;
3. *validates* at the end (:meth:`Speculation.validate`, the last task of the step's host thread):
   when the right factor equals the speculated one (clipping did not fire, the gradients are
   finite) the chunks are kept; otherwise each speculated chunk is inverted (or restored from its
   backup) and updated again with the right factor, or, for a skipped step, left rolled back
   with its compute params rewritten from its master params (what the device path leaves).

Exactness: a backup gives the bits of waiting for the norm. An inversion is float32-exact to about
one ulp of the new value (``tests/test_rollback.py``): equal to optax within fp32 tolerance,
except in one regime the policy mostly avoids: AdamW's ``v`` redone with a clipping factor
``c << 1`` after a speculated gradient far above that element's history (steady clipping far
below the norm, a spike early in training): relative error up to ~``6e-8 / c^2``
(``docs/design.md``, "Rollback by inversion", with the measured table and the resume caveat).

Host memory: inversion holds nothing beyond the speculated chunks' gradients, kept until the
validation (the compute dtype's bytes per parameter, 2 for bf16), at most ``limit_bytes`` of the
pool (the step's ``speculation_bytes``; by default :func:`auto_backup_bytes`: 16 GiB or half the
host's available memory, whichever is less); backups hold the pool's buffers, at most
``limit_bytes``, allocated on first use and reused across steps (the pool travels in the step's
pending work, explicit state), plus their gradients. Host memory traffic: inversion adds none
when clipping does not fire (a skip adds one read of each speculated gradient, the finiteness
check), and one inverse pass (~26 bytes per AdamW parameter) per speculated chunk when it fires;
a backup copies the speculated chunks' state every step (read 12 + write 12 bytes per parameter
for AdamW) on top of the kernel's ~28.

Reference: SuperOffload (ASPLOS'26), "speculation-then-validation" of the CPU optimizer step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading

import jax
import numpy as np

from chunkjax import updaters
from chunkjax.kernels import clip_scale

#: Default bound of the backup pool (bytes): 16 GiB, the state of ~1.4e9 AdamW parameters.
DEFAULT_BACKUP_BYTES = 16 * 2**30
#: Arrays of at least this many elements are copied by several threads.
_PARALLEL_COPY_MIN = 1 << 20


class BackupPool:
    """Float32 buffers that hold the old state of speculatively updated host chunks, reused from
    step to step (thread-safe).

    Args:
      limit_bytes: at most this many bytes are handed out at once (>= 0).

    Attributes:
      allocated_bytes: bytes of numpy buffers this pool has allocated (host memory it holds).
      peak_in_use_bytes: the most bytes handed out at once.

    Raises:
      ValueError: a negative ``limit_bytes``.
    """

    def __init__(self, limit_bytes: int = DEFAULT_BACKUP_BYTES):
        if not (isinstance(limit_bytes, (int, np.integer)) and limit_bytes >= 0):
            raise ValueError(f"speculation_bytes must be an int >= 0 (bytes), got {limit_bytes!r}")
        self.limit_bytes = int(limit_bytes)
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.allocated_bytes = 0
        self.peak_in_use_bytes = 0
        self._threads = max(1, min(16, os.cpu_count() or 1))
        self._copiers = None  # threads for large copies (numpy releases the GIL while it copies)
        self._copying = threading.Lock()  # one copy at a time; close() waits for it

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src`` on all cores (one thread copies ~18 GB/s, the host's memory ~100); the
        copy threads start on first use and end at :meth:`close`."""
        n = src.size
        if n < _PARALLEL_COPY_MIN or self._threads == 1:
            np.copyto(dst, src)
            return
        with self._copying:
            if self._copiers is None:
                self._copiers = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="chunkjax-backup")
            step = -(-n // self._threads)
            futures = []
            try:
                for lo in range(0, n, step):
                    futures.append(self._copiers.submit(np.copyto, dst[lo:lo + step], src[lo:lo + step]))
            except RuntimeError:  # the interpreter is exiting (host_work.join_at_exit): no new work taken
                concurrent.futures.wait(futures)
                np.copyto(dst, src)
                return
            for f in futures:
                f.result()

    def close(self) -> None:
        """End the copy threads (after the step's host work: :meth:`chunkjax.host_work.HostWork.join`);
        the next copy starts them again. The buffers stay."""
        with self._copying:
            if self._copiers is not None:
                self._copiers.shutdown(wait=True)
                self._copiers = None

    def take(self, sizes) -> list[np.ndarray] | None:
        """(n,) float32 buffers of the given sizes, or None when they would pass the limit."""
        need = 4 * sum(int(s) for s in sizes)
        with self._lock:
            if self.in_use_bytes + need > self.limit_bytes:
                return None
            self.in_use_bytes += need
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            out = []
            for s in sizes:
                free = self._free.get(int(s))
                if free:
                    out.append(free.pop())
                else:
                    out.append(np.empty(int(s), np.float32))
                    self.allocated_bytes += 4 * int(s)
            return out

    def give(self, bufs) -> None:
        """Return buffers from :meth:`take`."""
        with self._lock:
            for b in bufs:
                self._free.setdefault(b.size, []).append(b)
                self.in_use_bytes -= 4 * b.size


def _local_states(state, c: int) -> list:
    """(master, host optimizer state) of each local rank of host chunk ``c``."""
    m, o = state.master[c], state.opt_state[c]
    if isinstance(m, tuple):
        return [(mm, oo) for mm, oo in zip(m, o) if mm is not None]
    return [(m, o)]


def _arrays(host_state) -> list[tuple[str, np.ndarray]]:
    return [(f.name, getattr(host_state, f.name)) for f in dataclasses.fields(host_state)
            if isinstance(getattr(host_state, f.name), np.ndarray)]


def backup_bytes_per_param(host_state) -> int:
    """Backup bytes per parameter of one chunk's host state (master params + float32 buffers)."""
    return 4 + sum(a.itemsize for _, a in _arrays(host_state))


def _backup(pool: BackupPool, state, c: int):
    pairs = _local_states(state, c)
    sizes = [a.size for m, o in pairs for a in [m] + [x for _, x in _arrays(o)]]
    bufs = pool.take(sizes)
    if bufs is None:
        return None
    it = iter(bufs)
    saved = []
    for m, o in pairs:
        arrays = [m] + [x for _, x in _arrays(o)]
        for a in arrays:
            pool.copy(next(it), a)
        saved.append(getattr(o, "count", None))
    return bufs, saved


def _restore(pool: BackupPool, state, c: int, backup) -> None:
    bufs, counts = backup
    it = iter(bufs)
    for (m, o), count in zip(_local_states(state, c), counts):
        for a in [m] + [x for _, x in _arrays(o)]:
            pool.copy(a, next(it))
        if count is not None:
            o.count = count


#: Rollback of a speculated chunk: ``"invert"`` (undo the step from the kept gradient, no copy;
#: chunks whose step is not invertible are backed up) or ``"backup"`` (copy first, bit-exact).
ROLLBACKS = ("invert", "backup")
#: When a step speculates: ``"after_common"`` (unless clipping fired on the step before: steady
#: clipping then waits instead of paying for every chunk twice) or ``"always"``.
POLICIES = ("after_common", "always")


#: meta.json key of the policy's input a checkpoint carries (:func:`policy_meta`).
META_KEY = "speculation"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The last step's outcome as the policy reads it, restored from a checkpoint
    (:func:`resumed`; held in :attr:`chunkjax.TrainState.speculation` until the next step): the
    first step after a restore decides as the uninterrupted run's step did.

    Attributes:
      fired: clipping fired on the last step before the save (:attr:`Speculation.fired`).
      speculating: what a :class:`Speculation` reads of its previous step (a decision already taken).
    """
    fired: bool
    speculating: bool = False


def policy_meta(previous) -> dict:
    """The meta.json entry ``{META_KEY: {"fired": bool}}`` of the last step's outcome
    ``previous`` (a validated :class:`Speculation`, or a :class:`Resumed`); ``{}`` without one
    (no step yet, or no host chunks)."""
    return {} if previous is None else {META_KEY: {"fired": bool(previous.fired)}}


def resumed(meta: dict) -> Resumed | None:
    """The :class:`Resumed` outcome a checkpoint's ``meta`` (dict) carries; None without one (a
    checkpoint saved before any step, without host chunks, or by an older chunkjax: the first
    step after its restore then waits for the norm, as a process's first step does)."""
    entry = meta.get(META_KEY)
    return Resumed(bool(entry["fired"])) if isinstance(entry, dict) and "fired" in entry else None


def check_options(rollback: str, policy: str) -> None:
    """Raises ValueError (one line) for a ``rollback`` not in :data:`ROLLBACKS` or a ``policy``
    not in :data:`POLICIES`."""
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback={rollback!r}: use one of {ROLLBACKS}")
    if policy not in POLICIES:
        raise ValueError(f"speculation_policy={policy!r}: use one of {POLICIES}")


class Speculation:
    """One step's host updates, started before the global norm is known (module docstring).

    Runs on the step's host thread: :meth:`update` per program as its gradients complete, then
    :meth:`validate` once; the main thread calls :meth:`set_norm` when the global norm is
    dispatched.

    Args:
      update: ``update(state, {c: gradient}, grad_scale) -> seconds``, the host updater's step
        (:func:`chunkjax.updaters.host_updater`; the step's ``update_host_chunks``).
      write_params: ``write_params(state, c)`` rewrites chunk ``c``'s compute params from its
        master params (:func:`chunkjax.updaters.host_write_params`).
      host_optimizer: the host kernel spec (its ``max_grad_norm`` and ``grad_scale``).
      skip: a non-finite norm skips the step (``nonfinite="skip"`` or loss scaling).
      inv: 1 / loss scale (1.0 without loss scaling).
      pool: the :class:`BackupPool`; its ``limit_bytes`` also bounds the gradients kept for
        rollback by inversion.
      inverter: a :class:`chunkjax.updaters.HostInverter` (rollback by inversion), or None
        (every speculated chunk is backed up: ``rollback="backup"``).
      policy: one of :data:`POLICIES`.
      previous: the previous step's :class:`Speculation` or, after a restore, its :class:`Resumed`
        outcome (None: none), read by the policy.

    Attributes:
      stalled: a Future done (with the chunk id) once an update waits for the norm (the pool or
        the kept-gradient bound is full, a non-finite gradient, or the policy waits)
        (:meth:`chunkjax.updaters.HostWork.hand_over` stops holding programs back).
      speculating: whether this step speculates (the policy's decision, read at the first update).
      speculated: chunks updated before the norm was known (this step).
      inverted: of those, chunks kept for rollback by inversion (the others were backed up).
      redone: chunks rolled back and updated again (or left as they were: a skipped step).
      fired: after :meth:`validate`: the step's factor was finite and not the common one
        (clipping fired); the next step's policy reads it.
      kept_bytes_peak: the most gradient bytes kept for rollback by inversion at once.
    """

    def __init__(self, update, write_params, host_optimizer, *, skip: bool, inv: float, pool: BackupPool,
                 inverter=None, policy: str = "after_common", previous=None):
        self._update, self._write_params, self.spec = update, write_params, host_optimizer
        self.max_grad_norm = getattr(host_optimizer, "max_grad_norm", None)
        self.skip, self.inv, self.pool, self._inverter = skip, float(inv), pool, inverter
        self.certain = self.max_grad_norm is None and not skip  # the factor does not depend on the norm
        self.guess = self.scale_of(0.0)
        self._policy, self._previous, self._speculating, self._deciding = policy, previous, None, threading.Lock()
        if previous is not None:  # decided now (its own previous is joined): no chain of steps kept alive
            previous.speculating  # noqa: B018
        self._norm, self._set = None, threading.Event()
        self._final = None
        self._kept: dict = {}  # c -> (backup or None for inversion, gradient)
        self._kept_bytes = 0
        self.stalled = concurrent.futures.Future()  # set once an update waits for the norm
        self.speculated = self.inverted = self.redone = self.kept_bytes_peak = 0
        self.fired = False

    @property
    def speculating(self) -> bool:
        """Whether this step speculates (the policy's decision, taken at the first update: with
        cross-step overlap the previous step's validation may end after this step began).
        "after_common": the previous step's factor was the common one; the first step of a process
        waits, unless its state was restored from a checkpoint that carries the last step's outcome
        (:class:`Resumed`): then it decides as the uninterrupted run did."""
        with self._deciding:
            if self._speculating is None:
                prev = self._previous
                self._speculating = self._policy == "always" or (prev is not None and not prev.fired)
                self._previous = None  # the previous step's speculation is not kept alive
            return self._speculating

    def holds(self, c: int) -> bool:
        """Whether chunk ``c`` was updated speculatively and awaits :meth:`validate` (not final)."""
        return c in self._kept

    def scale_of(self, norm: float | None):
        """The host kernels' gradient factor for a global norm of the scaled gradients: None
        (skip), the :func:`~chunkjax.kernels.clip_scale` pair, or one float32 factor."""
        if norm is None:
            return None
        n = float(norm) * self.inv
        if self.skip and not math.isfinite(n):
            return None
        clip = self.max_grad_norm is not None
        if clip and self.inv == 1.0:  # optax's clipping arithmetic (kernels.clip_scale): the device path's bits
            return clip_scale(self.max_grad_norm, np.float32(n))
        return float(np.float32((self.spec.grad_scale(n) if clip else 1.0) * self.inv))

    def set_norm(self, norm) -> None:
        """The global norm of the step's (scaled) gradients: a () jax array or float; None
        abandons the step (every speculated chunk is rolled back)."""
        self._norm = norm
        self._set.set()

    def known(self) -> bool:
        """Whether the right factor is known without waiting (:meth:`chunkjax.host_work.HostWork.validate`)."""
        return self._known()

    def _known(self) -> bool:
        if self.certain:
            return True
        if not self._set.is_set():
            return False
        return not isinstance(self._norm, jax.Array) or self._norm.is_ready()

    def final(self):
        """The right factor (blocks until the norm is known)."""
        if self.certain:
            return self.guess
        self._set.wait()
        if self._final is None:
            self._final = ("ok", self.scale_of(self._norm))
        return self._final[1]

    def _speculate(self, state, c: int, g) -> float | None:
        """Update chunk ``c`` with the guessed factor, keeping what its rollback needs; None (nothing
        done) when the bounds have no room or its gradient is not finite (a skip would need it)."""
        import time
        t0 = time.perf_counter()
        if self._inverter is not None and self._inverter.can(state, c):
            nbytes = int(getattr(g, "nbytes", 0))
            if self._kept_bytes + nbytes > self.pool.limit_bytes:
                return None
            if self.skip and not self._inverter.finite(g, self.guess):  # NaN/inf would erase the old state
                return None
            self._kept_bytes += nbytes
            self.kept_bytes_peak = max(self.kept_bytes_peak, self._kept_bytes)
            self._kept[c] = (None, g)
            self.inverted += 1
        else:
            bk = _backup(self.pool, state, c)
            if bk is None:
                return None
            self._kept[c] = (bk, g)
        self.speculated += 1
        spent = time.perf_counter() - t0
        return spent + self._update(state, {c: g}, self.guess)

    def update(self, state, grads: dict) -> float:
        """Update each chunk of ``grads`` (``{c: gradient or Future of (gradient, sq)}``) in place:
        with the right factor when it is known, else speculatively when the policy speculates and
        the bounds have room, else after waiting for the norm (:attr:`stalled` is set first). Each
        gradient is popped from ``grads`` as its update starts; a speculated chunk's gradient is
        kept until :meth:`validate` (a rollback needs it), the others are dropped once their
        kernel ran. Returns kernel, check and copy seconds."""
        spent = 0.0
        while grads:
            c = next(iter(grads))
            g = grads.pop(c)
            if isinstance(g, concurrent.futures.Future):
                g = g.result()[0]
            else:
                updaters.wait_for_gradient(g)
            if self.certain:  # no speculation: the factor is known
                spent += self._update(state, {c: g}, self.guess)
                continue
            if not self._known():
                t = self._speculate(state, c, g) if self.speculating else None
                if t is not None:
                    spent += t
                    continue
                if not self.stalled.done():  # the main thread must not hold programs back for us
                    self.stalled.set_result(c)
            spent += self._direct(state, c, g, self.final())
        return spent

    def _same(self, final) -> bool:
        return final is not None and self.guess is not None and bool(np.all(np.equal(final, self.guess)))

    def _direct(self, state, c: int, g, final) -> float:
        """Update chunk ``c`` once the factor is known. On a speculating step with rollback by
        inversion and a factor that differs from the guess, an invertible chunk gets the bits of
        speculating on it (:func:`chunkjax.host_update.host_canonical_`; a skip: its compute params
        rewritten), so that no result depends on which chunks speculated (the timing of the norm,
        the bound); on a step the policy waits on, the plain update."""
        import time
        inv = self._inverter
        if inv is None or not self.speculating or self._same(final) or not inv.can(state, c):
            return self._update(state, {c: g}, final)
        if final is None and not inv.finite(g, self.guess):  # not speculated either: left as it is
            return 0.0
        t0 = time.perf_counter()
        inv.canonical(state, c, g, self.guess, final)
        if final is None:
            self._write_params(state, c)
        return time.perf_counter() - t0

    def validate(self, state) -> float:
        """Keep or roll back the speculated chunks once the norm is known (the step's last host
        task): when the factor differs from the guess, each is inverted (or restored from its
        backup), then updated with the right factor or, for a skipped step, left as it was with
        its compute params rewritten from its master params."""
        import time
        final = self.final()
        spent = 0.0
        same = self._same(final)
        self.fired = final is not None and not same
        for c, (bk, g) in self._kept.items():
            if not same:
                t0 = time.perf_counter()
                if bk is None:
                    self._inverter.invert(state, c, g, self.guess)
                else:
                    _restore(self.pool, state, c, bk)
                if final is None:
                    self._write_params(state, c)
                spent += time.perf_counter() - t0
                if final is not None:
                    spent += self._update(state, {c: g}, final)
                self.redone += 1
            if bk is not None:
                self.pool.give(bk[0])
        self._kept, self._kept_bytes = {}, 0
        return spent


def auto_backup_bytes() -> int:
    """The default pool bound (bytes): :data:`DEFAULT_BACKUP_BYTES`, or half of the host's
    ``MemAvailable`` when that is less (read when a step first speculates, after its state is
    allocated)."""
    from chunkjax.host_memory import host_memory_available_bytes
    avail = host_memory_available_bytes()
    return DEFAULT_BACKUP_BYTES if avail is None else int(min(DEFAULT_BACKUP_BYTES, avail // 2))


def for_step(step, work, inv: float, previous=None) -> Speculation:
    """The :class:`Speculation` of one call of ``step`` (a :class:`chunkjax.ChunkedStep` with
    host chunks): its host updater, its ``rollback`` (an inverter for ``"invert"``) and
    ``speculation_policy``, the pool of ``work`` (a :class:`chunkjax.updaters.HostWork`; created
    with the step's ``speculation_bytes`` bound on the first step), ``inv`` (1 / loss scale) and
    ``previous``, the previous step's :class:`Speculation` (None on the first step)."""
    from chunkjax.updaters import host_inverter, host_write_params
    if work.backups is None:
        work.backups = BackupPool(auto_backup_bytes() if step.speculation_bytes is None else step.speculation_bytes)
    update = lambda st, grads, scale: step.update_host_chunks(st, grads, scale)  # noqa: E731 (looked up per call)
    inverter = (host_inverter(step.topology, step.host_optimizer, step.compute_dtype, step.master_fetch_chunks)
                if step.rollback == "invert" else None)
    return Speculation(update, host_write_params(step.topology, step.compute_dtype, step.master_fetch_chunks),
                       step.host_optimizer, skip=step.skips_nonfinite, inv=inv, pool=work.backups,
                       inverter=inverter, policy=step.speculation_policy, previous=previous)
