"""The in-place host optimizer update of one chunk (PatrickStar's "host" update location).

PatrickStar (Fang et al., arXiv 2108.05818, section 5 "device-aware operator placement") runs
the optimizer update of a chunk where the chunk's optimizer state lives. For chunks whose fp32
master params and moments live in host memory, the fastest path measured on the lent H200
machine is a multithreaded numba kernel that updates the host buffers *in place*: 0.27 ns per
parameter on 16 cores for AdamW with a bf16 gradient (``shared/guides/gpu_facts.md``, "Adam
update cost"), against 0.64 ns for the JAX CPU backend and 0.43 ns for streaming the state
through the GPU.

The optimizer arithmetic (specs, clipping, per-step scalars, numba kernels) is
:mod:`chunkjax.kernels`, shared with the storage tier's near-storage workers; this module is its
JAX side: :func:`host_update_` (one chunk's step, the learning-rate schedule evaluated with JAX),
:func:`learning_rate_at`, the zero-copy views of JAX host buffers (:func:`bf16_bits`,
:func:`writable_view`) and :func:`measure_host_update_rate`. The specs are importable from here
too (``from chunkjax.host_update import AdamW``).

One call of :func:`host_update_` updates one chunk:

* reads the gradient as bf16 bits (``np.uint16``, see :func:`bf16_bits`) or float32, times a
  scalar ``grad_scale`` (global-norm clipping: see :meth:`AdamW.grad_scale`);
* updates the float32 master params and the float32 moments in place, with the float32
  arithmetic of the optax optimizer that :meth:`AdamW.optax` returns (bit-exact with eager optax
  on the JAX CPU backend; see :mod:`chunkjax.kernels`);
* optionally writes the new bf16 compute params as bits (round to nearest even, NaN stays NaN).

The kernels release the GIL, so a Python thread can run the update while another thread
dispatches JAX work; launches from several threads run one at a time.

The host buffers may be writable views of JAX ``pinned_host`` arrays (:func:`writable_view`);
that steps outside JAX's immutable-array contract, see the rules in ``gpu_facts.md``, "Rules for
updating pinned buffers in place on the host".
"""
from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.kernels import (BF16_BITS_DTYPE, INT32_MAX, AdamW, HostAdamState, HostLionState,
                              HostMomentumState, HostOptimizer, Lion, SGDMomentum, bf16_round_bits, next_count,
                              step_hyper, update_)
from chunkjax.kernels_inverse import canonical_, invert_, invertible

_MSG_STATE_MISMATCH = "{spec} needs a {want} (from {spec}.host_state), got {got}"
_MSG_VIEW = "writable_view: {why}"


@functools.cache
def _cpu_device():
    try:
        return jax.local_devices(backend="cpu")[0]  # this process's (under jax.distributed)
    except RuntimeError:  # the CPU backend is disabled (JAX_PLATFORMS without cpu)
        return None


def _evaluate_schedule(schedule: Callable, count: int) -> float:
    # On the CPU backend: on a GPU platform the default device would queue this behind the training
    # step and block until it finishes.
    dev = _cpu_device()
    if dev is None:
        return float(schedule(jnp.asarray(count, jnp.int32)))
    with jax.default_device(dev):
        return float(schedule(jnp.asarray(count, jnp.int32)))


# Every chunk of a step asks for the same (schedule, count): evaluate it once (schedules are pure).
_evaluate_schedule_memo = functools.lru_cache(maxsize=256)(_evaluate_schedule)


def learning_rate_at(learning_rate: float | Callable, count: int) -> np.float32:
    """The float32 learning rate optax uses for the step taken when the state's count is ``count``
    (the count before the step). A schedule is called with an int32 array, as in
    ``optax.scale_by_schedule``, on the JAX CPU backend; results are memoised per (schedule, count)
    when the schedule is hashable."""
    if not callable(learning_rate):
        return np.float32(learning_rate)
    try:
        hash(learning_rate)
    except TypeError:
        return np.float32(_evaluate_schedule(learning_rate, int(count)))
    return np.float32(_evaluate_schedule_memo(learning_rate, int(count)))


_STATE_TYPES = {AdamW: HostAdamState, Lion: HostLionState, SGDMomentum: HostMomentumState}
_MOMENT_FIELDS = {HostAdamState: ("m", "v"), HostLionState: ("m",), HostMomentumState: ("trace",)}


def moment_fields(state) -> tuple[str, ...]:
    """Names of the float32 moment buffers of a host state (``("m", "v")`` for
    :class:`HostAdamState`, ``("m",)`` for Lion, ``("trace",)`` for momentum SGD).

    Raises:
      ValueError: ``state`` is not a host state of :mod:`chunkjax.kernels`.
    """
    fields = _MOMENT_FIELDS.get(type(state))
    if fields is None:
        raise ValueError(f"{type(state).__name__} is not a host optimizer state (HostAdamState, HostLionState, "
                         "HostMomentumState)")
    return fields


def host_update_(spec: HostOptimizer, state, grad: np.ndarray, master: np.ndarray,
                 params_bits_out: np.ndarray | None = None, grad_scale: float | tuple[float, float] = 1.0) -> None:
    """One optimizer step of one chunk, in place on host buffers.

    Mutates ``master``, the moments in ``state`` and ``state.count`` (+1, saturating at int32 max),
    and writes ``params_bits_out`` if given. Equals one ``spec.optax()`` update followed by
    ``optax.apply_updates`` (bit for bit against eager optax on the JAX CPU backend when ``grad_scale``
    is 1 or the pair of :func:`chunkjax.kernels.clip_scale`; a single float factor is one rounding
    away from optax's two). Padding elements (gradient 0, master 0, moments 0) stay exactly 0.

    Safe to call from any Python thread (the GIL is released while the kernel runs); launches from
    several threads run one at a time.

    Args:
      spec: :class:`AdamW`, :class:`Lion` or :class:`SGDMomentum`.
      state: ``spec.host_state(n)`` (or the same dataclass built over other float32 buffers).
      grad: (n,) gradient, either bf16 bits as np.uint16 (:func:`bf16_bits`) or np.float32.
      master: (n,) np.float32 master params, updated in place.
      params_bits_out: (n,) np.uint16, receives the new params as bf16 bits (round to nearest
        even, as ``jnp.astype(jnp.bfloat16)``), e.g. a :func:`writable_view` of the chunk's bf16
        pinned_host buffer; or (n,) np.float32, receives them as they are (a float32 compute
        copy, written in the kernel's one pass); None to skip.
      grad_scale: multiplies the gradient: 1.0; for clipping the pair
        ``chunkjax.kernels.clip_scale(spec.max_grad_norm, global_norm)`` (optax's rounding, the
        storage tier's arithmetic: bit-identical tiers), or one float such as
        ``spec.grad_scale(global_norm)`` times a loss-scale inverse.

    Raises:
      ValueError: an array is not a 1-D C-contiguous numpy array of the right dtype and size, an
        output is read-only, two buffers overlap, or ``state`` does not belong to ``spec``.

    Example::

        spec = AdamW(1e-3, max_grad_norm=1.0)
        state = spec.host_state(chunk_size)
        # after the step that produced grad_chunk (bf16, pinned_host) finished:
        host_update_(spec, state, bf16_bits(grad_chunk), master, writable_view(param_chunk, np.uint16),
                     grad_scale=spec.grad_scale(global_norm))
    """
    moments = _moments(spec, state)
    count = int(state.count)
    hyper = step_hyper(spec, count, learning_rate_at(spec.learning_rate, count))
    update_(hyper, master, moments, grad, params_bits_out, grad_scale)
    state.count = next_count(count)


def _moments(spec: HostOptimizer, state) -> tuple:
    """The float32 moment buffers of ``state``; ValueError (one line) when ``state`` is not
    ``spec``'s host state type."""
    state_type = _STATE_TYPES.get(type(spec))
    if state_type is None or not isinstance(state, state_type):
        raise ValueError(_MSG_STATE_MISMATCH.format(spec=type(spec).__name__,
                                                    want=getattr(state_type, "__name__", "known spec"),
                                                    got=type(state).__name__))
    return tuple(getattr(state, f) for f in _MOMENT_FIELDS[state_type])


def _undone_hyper(spec: HostOptimizer, state):
    count = int(state.count)
    if not 0 < count < INT32_MAX:  # nothing to undo, or a saturated count (which step is unknown)
        return None
    return step_hyper(spec, count - 1, learning_rate_at(spec.learning_rate, count - 1))


def host_invertible(spec: HostOptimizer, state) -> bool:
    """Whether :func:`host_invert_` will be able to undo the *next* :func:`host_update_` of a
    chunk whose host state is ``state`` (:func:`chunkjax.kernels_inverse.invertible` of that
    step's scalars; False when it would saturate the count)."""
    count = int(state.count)
    if not 0 <= count < INT32_MAX - 1:
        return False
    return invertible(step_hyper(spec, count, learning_rate_at(spec.learning_rate, count)))


def host_invert_(spec: HostOptimizer, state, grad: np.ndarray, master: np.ndarray,
                 grad_scale: float | tuple[float, float] = 1.0) -> None:
    """Undo the last :func:`host_update_` of one chunk in place, given the gradient and factor it
    applied (:func:`chunkjax.kernels_inverse.invert_`, to float32 rounding: not bit-exact):
    ``master`` and the moments of ``state`` are put back and ``state.count`` goes down by one.
    The compute params are not touched (a redo's :func:`host_update_` rewrites them;
    :func:`chunkjax.updaters.host_write_params` writes them from the master params).

    Args:
      spec, state, grad, master: as :func:`host_update_`, ``state`` and ``master`` after the step.
      grad_scale: the factor the undone step applied.

    Raises:
      ValueError: as :func:`host_update_`, or the step is not :func:`host_invertible`.
    """
    moments = _moments(spec, state)
    hyper = _undone_hyper(spec, state)
    if hyper is None:
        raise ValueError(f"host_invert_: count {state.count} has no step to undo (0, or saturated at int32 max)")
    invert_(hyper, master, moments, grad, grad_scale)
    state.count = int(state.count) - 1


def host_canonical_(spec: HostOptimizer, state, grad: np.ndarray, master: np.ndarray,
                    params_bits_out: np.ndarray | None, guess, right) -> None:
    """The step of a chunk that did not speculate, on a step whose factor ``right`` is not the
    guessed ``guess`` (rollback by inversion, :mod:`chunkjax.speculate`): the bits of
    :func:`host_update_` with ``guess``, :func:`host_invert_`, then :func:`host_update_` with
    ``right`` (None: a skipped step, the count unchanged, ``params_bits_out`` unused), in one pass
    (:func:`chunkjax.kernels_inverse.canonical_`). Arguments and errors as :func:`host_update_`;
    ``host_invertible(spec, state)`` must hold."""
    moments = _moments(spec, state)
    count = int(state.count)
    hyper = step_hyper(spec, count, learning_rate_at(spec.learning_rate, count))
    canonical_(hyper, master, moments, grad,
               params_bits_out, guess, right)
    if right is not None:
        state.count = next_count(count)


def bf16_bits(x) -> np.ndarray:
    """Read-only np.uint16 view of the bits of a bfloat16 array (numpy, or a JAX array in host memory).

    For a JAX array this is ``np.asarray(x)``: zero-copy for CPU-backend and ``pinned_host`` arrays,
    a slow device-to-host copy (1.5 GB/s on the H200 machine) for arrays in GPU memory.

    Raises:
      ValueError: ``x`` is not bfloat16.
    """
    a = np.asarray(x)
    if a.dtype != jnp.bfloat16:
        raise ValueError(f"bf16_bits needs a bfloat16 array, got {a.dtype}")
    bits = a.view(BF16_BITS_DTYPE)
    bits.flags.writeable = False
    return bits


def writable_view(arr: jax.Array, dtype) -> np.ndarray:
    """A writable 1-D numpy view of a single-device JAX array's host buffer (no copy).

    .. warning:: this breaks JAX's immutable-array contract (``gpu_facts.md``, "Rules for updating
       pinned buffers in place on the host"). Use it only on buffers chunkjax created and owns
       alone: never donated, aliased, copied into a sharded array, or handed to a user. Call
       ``arr.block_until_ready()`` (and on every producer of ``arr``) first, and make sure no JAX
       program that reads or writes ``arr`` is in flight while the view is written; the next JAX
       program on ``arr`` must start after the write. If ``arr`` is deleted or donated the view
       dangles (reading it is undefined behaviour); the view keeps ``arr`` itself alive.

    Args:
      arr: 1-D array on one device, in host memory: a CPU-backend array or a ``pinned_host`` /
        ``unpinned_host`` array of a GPU.
      dtype: numpy dtype of the view, with the same itemsize as ``arr.dtype`` (e.g. np.uint16 for
        a bfloat16 array).

    Returns:
      (arr.size,) writable numpy array aliasing ``arr``'s buffer.

    Raises:
      ValueError: ``arr`` is not 1-D, spans several devices, is deleted, lives in GPU memory,
        or ``dtype``'s itemsize differs from ``arr``'s.
    """
    dtype = np.dtype(dtype)
    if not isinstance(arr, jax.Array):
        raise ValueError(_MSG_VIEW.format(why=f"needs a jax.Array, got {type(arr).__name__}"))
    if arr.is_deleted():
        raise ValueError(_MSG_VIEW.format(why="the array has been deleted (donated?)"))
    if arr.ndim != 1:
        raise ValueError(_MSG_VIEW.format(why=f"needs a 1-D array (a chunk), got shape {arr.shape}"))
    if len(arr.sharding.device_set) != 1 or not arr.is_fully_addressable:
        raise ValueError(_MSG_VIEW.format(why=f"needs a single-device array, got sharding {arr.sharding}"))
    if np.dtype(arr.dtype).itemsize != dtype.itemsize:
        raise ValueError(_MSG_VIEW.format(why=f"view dtype {dtype} has itemsize {dtype.itemsize}, "
                                              f"the array's {arr.dtype} has {np.dtype(arr.dtype).itemsize}"))
    (device,) = arr.sharding.device_set
    kind = arr.sharding.memory_kind
    if device.platform != "cpu" and kind not in ("pinned_host", "unpinned_host"):
        raise ValueError(_MSG_VIEW.format(why=f"the array is in {device.platform} memory kind {kind!r}, "
                                              "not host memory: its pointer is not addressable from the CPU"))
    if arr.size == 0:
        return np.empty(0, dtype)
    ptr = arr.addressable_data(0).unsafe_buffer_pointer()
    buf = (ctypes.c_byte * arr.nbytes).from_address(ptr)
    buf._chunkjax_owner = arr  # the view's base is buf; buf keeps arr (and so its buffer) alive
    return np.frombuffer(buf, dtype=dtype)


def rate_problem(n: int):
    """``(spec, state, grad, master, out)``: an AdamW host update of ``n`` parameters (float32 master
    and state, bf16-rounded gradient as uint16 bits, bf16 output bits), run once (numba compiled, pages
    touched), for timing :func:`host_update_` on it (:func:`measure_host_update_rate`,
    :func:`chunkjax.host_contention.measure_loaded_host_update_rate`). About 16 bytes per parameter."""
    rng = np.random.default_rng(0)
    spec = AdamW(1e-3)
    state = spec.host_state(n)
    master = rng.standard_normal(n, dtype=np.float32)
    grad = bf16_round_bits(rng.standard_normal(n, dtype=np.float32))
    out = np.empty(n, BF16_BITS_DTYPE)
    host_update_(spec, state, grad, master, out)  # compile and first-touch the pages
    return spec, state, grad, master, out


def measure_host_update_rate(n: int = 2**24, repeats: int = 5, *, stats: dict | None = None) -> float:
    """Seconds per parameter of the in-place AdamW kernel on this machine (bf16 gradient in, bf16
    params out, all numba threads), the fastest of ``repeats`` timed calls after a warm-up call
    (interference only slows a call: the median once read 0.42 ns on the H200 host where the
    training step's host updates ran at 0.27).
    Calibrates ``chunkjax.cost.Rates.host_update_s_per_param`` (0.27e-9 on the 16-core H200 host).
    Allocates about 16 bytes per parameter (n=2**24: 256 MiB). A working set inside the last-level
    cache reads fast: calibrate on at least 4x that cache and 1 GiB (``n >= 2**26``; the s14 run's
    0.214 ns calibrated against 0.29 ns inside its step: ``docs/dropin.md``, "Rates under contention").

    Args:
      n: parameters (>= 1). repeats: timed calls (>= 1).
      stats: if given, filled with ``min_s_per_param``, ``median_s_per_param``, ``n``, ``repeats``,
        ``working_set_bytes`` and ``llc_bytes`` (the largest CPU cache this Linux host reports, 0 if
        none), ``working_set_over_llc``.

    Raises:
      ValueError: ``n`` or ``repeats`` below 1.
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"measure_host_update_rate(n={n}, repeats={repeats}): use n >= 1 and repeats >= 1")
    spec, state, grad, master, out = rate_problem(n)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        host_update_(spec, state, grad, master, out)
        times.append(time.perf_counter() - t0)
    if stats is not None:
        import glob
        import re
        llc = 0
        for f in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*/size"):
            try:
                with open(f) as fh:
                    m = re.fullmatch(r"(\d+)([KMG]?)", fh.read().strip())
            except OSError:
                continue
            if m:
                llc = max(llc, int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
        ws = int(master.nbytes + grad.nbytes + out.nbytes + sum(
            getattr(state, k).nbytes for k in vars(state) if hasattr(getattr(state, k), "nbytes")))
        stats.update(min_s_per_param=float(np.min(times)) / n, median_s_per_param=float(np.median(times)) / n,
                     n=int(n), repeats=int(repeats), working_set_bytes=ws, llc_bytes=llc,
                     working_set_over_llc=ws / llc if llc else None)
    return float(np.min(times)) / n


__all__ = ["AdamW", "HostAdamState", "HostLionState", "HostMomentumState", "Lion", "SGDMomentum",
           "bf16_bits", "bf16_round_bits", "host_canonical_", "host_invert_", "host_invertible", "host_update_", "learning_rate_at",
           "measure_host_update_rate", "moment_fields", "writable_view"]
