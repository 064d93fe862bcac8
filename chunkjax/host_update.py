"""The in-place host optimizer update of one chunk (PatrickStar's "host" update location).

PatrickStar (Fang et al., arXiv 2108.05818, section 5 "device-aware operator placement") runs
the optimizer update of a chunk where the chunk's optimizer state lives. For chunks whose fp32
master params and moments live in host memory, the fastest path measured on the lent H200
machine is a multithreaded numba kernel that updates the host buffers *in place*: 0.27 ns per
parameter on 16 cores for AdamW with a bf16 gradient (``shared/guides/gpu_facts.md``, "Adam
update cost"), against 0.64 ns for the JAX CPU backend and 0.43 ns for streaming the state
through the GPU.

One call of :func:`host_update_` updates one chunk:

* reads the gradient as bf16 bits (``np.uint16``, see :func:`bf16_bits`) or float32, times a
  scalar ``grad_scale`` (global-norm clipping: see :meth:`AdamW.grad_scale`);
* updates the float32 master params and the float32 moments in place, with the float32
  arithmetic of the optax optimizer that :meth:`AdamW.optax` returns: the same operations in the
  same order, IEEE (no fast-math, no fused multiply-add). Run eagerly on the JAX CPU backend, optax
  gives the same bits (XLA there turns optax's division by the bias correction into a multiply by
  its float32 reciprocal, and so does the kernel); jitted optax fuses a*b+c into FMAs and differs
  in the last bits, as optax on the GPU may;
* optionally writes the new bf16 compute params as bits (round to nearest even, NaN stays NaN).

The kernels release the GIL (``nogil=True``), so a Python thread can run the update while
another thread dispatches JAX work. Kernel launches are serialised by a lock, because numba's
``workqueue`` threading layer aborts the process on concurrent parallel launches (each launch
already uses every numba thread).

The host buffers may be writable views of JAX ``pinned_host`` arrays (:func:`writable_view`);
that steps outside JAX's immutable-array contract, see the rules in ``gpu_facts.md``, "Rules for
updating pinned buffers in place on the host".
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import numbers
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numba
import numpy as np
import optax
from numba import prange, types
from numba.extending import overload

#: Master params and moments are float32 (mixed precision rule).
MASTER_DTYPE = np.dtype(np.float32)
#: bf16 values are carried as their raw bits (numpy and numba have no bfloat16).
BF16_BITS_DTYPE = np.dtype(np.uint16)
#: optax counts steps in int32 and saturates there (``optax.safe_increment``).
INT32_MAX = 2**31 - 1

_MSG_NOT_ARRAY = "{name} must be a numpy array, got {type}"
_MSG_BAD_ARRAY = ("{name} must be a 1-D C-contiguous{w} numpy array of dtype {dtype} and size {size}; "
                  "got ndim={ndim}, dtype={got_dtype}, size={got_size}, c_contiguous={contig}, "
                  "writeable={writeable}")
_MSG_OVERLAP = "{a} and {b} share memory: each buffer of an in-place update must be distinct"
_MSG_STATE_MISMATCH = "{spec} needs a {want} (from {spec}.host_state), got {got}"
_MSG_FIELD = "{cls}.{field} = {value!r}: {rule}"
_MSG_VIEW = "writable_view: {why}"


# ----------------------------------------------------------------------------------------------
# Optimizer specifications and their host state.
# ----------------------------------------------------------------------------------------------

def _check_common(obj, learning_rate, max_grad_norm, weight_decay):
    cls = type(obj).__name__
    if not (callable(learning_rate) or isinstance(learning_rate, numbers.Real)):
        raise ValueError(_MSG_FIELD.format(cls=cls, field="learning_rate", value=learning_rate,
                                           rule="must be a float or a schedule count -> lr"))
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(_MSG_FIELD.format(cls=cls, field="max_grad_norm", value=max_grad_norm,
                                           rule="must be None or > 0"))
    if not weight_decay >= 0:
        raise ValueError(_MSG_FIELD.format(cls=cls, field="weight_decay", value=weight_decay, rule="must be >= 0"))


def _check_decay(obj, field, value):
    if not 0 <= value < 1:
        raise ValueError(_MSG_FIELD.format(cls=type(obj).__name__, field=field, value=value,
                                           rule="must be in [0, 1)"))


def _grad_scale(max_grad_norm: float | None, global_norm: float) -> float:
    # optax.clip_by_global_norm keeps the gradient when norm < max_norm, else t / norm * max_norm.
    if max_grad_norm is None or global_norm < max_grad_norm:
        return 1.0
    return float(np.float32(max_grad_norm / global_norm))


def _with_clipping(tx: optax.GradientTransformation, max_grad_norm: float | None):
    return tx if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)


@dataclasses.dataclass
class HostAdamState:
    """AdamW state of one chunk in host memory (mutated in place by :func:`host_update_`).

    Attributes:
      count: updates done so far (optax ``ScaleByAdamState.count``; int32 range, saturating).
      m: (chunk_size,) float32 first moment.
      v: (chunk_size,) float32 second moment.
    """

    count: int
    m: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes


@dataclasses.dataclass
class HostLionState:
    """Lion state of one chunk in host memory.

    Attributes:
      count: updates done so far. m: (chunk_size,) float32 momentum.
    """

    count: int
    m: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.m.nbytes


@dataclasses.dataclass
class HostMomentumState:
    """SGD-with-momentum state of one chunk in host memory.

    Attributes:
      count: updates done so far. trace: (chunk_size,) float32 momentum buffer (optax ``TraceState``).
    """

    count: int
    trace: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.trace.nbytes


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW as optax implements it, runnable in place on host chunks.

    Per step t (starting at 1), in float32, with g the gradient times ``grad_scale``::

        m = (1 - b1) g + b1 m;     v = (1 - b2) g^2 + b2 v
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * master
        master = master - lr(t - 1) * u

    Attributes:
      learning_rate: float, or an optax schedule ``count -> lr`` evaluated at the count *before*
        the step (0 at the first step), as ``optax.scale_by_learning_rate`` does.
      b1, b2: moment decay rates in [0, 1).
      eps: added to sqrt(v_hat) (``eps_root`` is 0).
      weight_decay: decoupled decay, multiplied by the learning rate (optax/PyTorch convention).
      max_grad_norm: if set, gradients are clipped to this global L2 norm first.

    Raises:
      ValueError: a field is out of range.
    """

    learning_rate: float | Callable
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float | None = None

    def __post_init__(self):
        _check_common(self, self.learning_rate, self.max_grad_norm, self.weight_decay)
        _check_decay(self, "b1", self.b1)
        _check_decay(self, "b2", self.b2)
        if not self.eps >= 0:
            raise ValueError(_MSG_FIELD.format(cls="AdamW", field="eps", value=self.eps, rule="must be >= 0"))

    def optax(self) -> optax.GradientTransformation:
        """The optax transformation with exactly this math (``clip_by_global_norm`` then ``adamw``)."""
        tx = optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostAdamState:
        """Zero moments for a chunk of ``chunk_size`` elements (8 bytes per element)."""
        return HostAdamState(0, np.zeros(chunk_size, MASTER_DTYPE), np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """Factor to pass as ``grad_scale``: 1 without clipping or when ``global_norm`` < max_grad_norm,
        else max_grad_norm / global_norm (rounded to float32). ``global_norm`` is the L2 norm of the
        whole model's gradient, not of one chunk."""
        return _grad_scale(self.max_grad_norm, global_norm)


@dataclasses.dataclass(frozen=True)
class Lion:
    """Lion as ``optax.lion`` implements it (hard sign), runnable in place on host chunks.

    Per step, in float32: ``u = sign((1 - b1) g + b1 m) + weight_decay * master``,
    ``m = (1 - b2) g + b2 m``, ``master = master - lr(t - 1) * u``.
    Fields as in :class:`AdamW`; optax's defaults (b2=0.99, weight_decay=1e-3).
    """

    learning_rate: float | Callable
    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 1e-3
    max_grad_norm: float | None = None

    def __post_init__(self):
        _check_common(self, self.learning_rate, self.max_grad_norm, self.weight_decay)
        _check_decay(self, "b1", self.b1)
        _check_decay(self, "b2", self.b2)

    def optax(self) -> optax.GradientTransformation:
        """``clip_by_global_norm`` (if set) then ``optax.lion``."""
        tx = optax.lion(self.learning_rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostLionState:
        """Zero momentum for a chunk of ``chunk_size`` elements (4 bytes per element)."""
        return HostLionState(0, np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """See :meth:`AdamW.grad_scale`."""
        return _grad_scale(self.max_grad_norm, global_norm)


@dataclasses.dataclass(frozen=True)
class SGDMomentum:
    """SGD with momentum and coupled (L2, PyTorch ``SGD``-style) weight decay, runnable in place.

    Per step, in float32: ``g = g + weight_decay * master``, ``trace = g + momentum * trace``,
    ``u = g + momentum * trace`` if nesterov else ``trace``, ``master = master - lr(t - 1) * u``.
    The optax equivalent is ``chain(add_decayed_weights(weight_decay), sgd(lr, momentum, nesterov))``.
    """

    learning_rate: float | Callable
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    max_grad_norm: float | None = None

    def __post_init__(self):
        _check_common(self, self.learning_rate, self.max_grad_norm, self.weight_decay)
        _check_decay(self, "momentum", self.momentum)

    def optax(self) -> optax.GradientTransformation:
        """``clip_by_global_norm`` (if set), ``add_decayed_weights``, then ``optax.sgd``."""
        tx = optax.chain(optax.add_decayed_weights(self.weight_decay),
                         optax.sgd(self.learning_rate, momentum=self.momentum, nesterov=self.nesterov))
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostMomentumState:
        """Zero momentum buffer for a chunk of ``chunk_size`` elements (4 bytes per element)."""
        return HostMomentumState(0, np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """See :meth:`AdamW.grad_scale`."""
        return _grad_scale(self.max_grad_norm, global_norm)


HostOptimizer = AdamW | Lion | SGDMomentum

# ----------------------------------------------------------------------------------------------
# numba kernels (float32 throughout: every scalar argument is passed as np.float32).
# ----------------------------------------------------------------------------------------------


def _jit(fn=None, *, parallel=True):
    """njit with IEEE float semantics, no GIL, numpy error model (x/0 gives inf, not an exception);
    cached in __pycache__ when a cache location is writable, else compiled per process."""
    def deco(f):
        opts = dict(parallel=parallel, nogil=True, fastmath=False, error_model="numpy")
        try:
            return numba.njit(cache=True, **opts)(f)
        except RuntimeError:  # no writable cache location
            return numba.njit(cache=False, **opts)(f)
    return deco if fn is None else deco(fn)


def _as_f32(x):
    """A gradient element as float32; implemented for numba below."""
    raise NotImplementedError


@overload(_as_f32)
def _as_f32_impl(x):
    if x == types.uint16:  # bf16 bits: widening is exact
        return lambda x: np.uint32(np.uint32(x) << 16).view(np.float32)
    if x == types.float32:
        return lambda x: x
    return None


@_jit(parallel=False)
def _bf16_bits_of(x):
    """bf16 bits of float32 x, round to nearest even; NaN -> quiet NaN with x's sign (as XLA)."""
    b = np.float32(x).view(np.uint32)
    if x != x:
        return np.uint16(((b >> 16) & 0x8000) | 0x7FC0)
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@_jit
def _bf16_round_kernel(x, out):
    for i in prange(x.size):
        out[i] = _bf16_bits_of(x[i])


# Each kernel splits the chunk into blocks over the numba threads and runs a per-range loop on each.
# The loop is specialised on the gradient's dtype (uint16 bf16 bits or float32: a runtime branch
# outside the loop picks one) and on ``out`` being an array or None (numba compiles a kernel per
# case, lazily, and prunes the store for None). No flag is tested inside a loop: LLVM vectorised
# only one case of a loop that tested flags (the others ran 2-3x slower). Loop indices are
# unsigned so that numba emits no negative-index wraparound, which also blocks vectorisation.
_BLOCK = 4096


@_jit(parallel=False)
def _adamw_range(lo, hi, master, m, v, grad, out, grad_scale, hp):
    b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = _as_f32(grad[i]) * grad_scale
        mi = one_minus_b1 * g + b1 * m[i]
        vi = one_minus_b2 * (g * g) + b2 * v[i]
        u = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2) + eps)
        p = master[i]
        if wd != 0:  # optax skips a zero weight decay
            u = u + wd * p
        p = p + neg_lr * u
        m[i] = mi
        v[i] = vi
        master[i] = p
        if out is not None:
            out[i] = _bf16_bits_of(p)


@_jit
def _adamw_kernel(master, m, v, grad_bits, grad_f32, is_bf16, out, grad_scale, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _adamw_range(lo, hi, master, m, v, grad_bits, out, grad_scale, hp)
        else:
            _adamw_range(lo, hi, master, m, v, grad_f32, out, grad_scale, hp)


@_jit(parallel=False)
def _lion_range(lo, hi, master, m, grad, out, grad_scale, hp):
    b1, one_minus_b1, b2, one_minus_b2, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = _as_f32(grad[i]) * grad_scale
        mo = m[i]
        x = one_minus_b1 * g + b1 * mo
        u = np.float32(1.0) if x > 0 else (np.float32(-1.0) if x < 0 else x)  # jnp.sign (0, -0, NaN kept)
        m[i] = one_minus_b2 * g + b2 * mo
        p = master[i]
        if wd != 0:
            u = u + wd * p
        p = p + neg_lr * u
        master[i] = p
        if out is not None:
            out[i] = _bf16_bits_of(p)


@_jit
def _lion_kernel(master, m, grad_bits, grad_f32, is_bf16, out, grad_scale, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _lion_range(lo, hi, master, m, grad_bits, out, grad_scale, hp)
        else:
            _lion_range(lo, hi, master, m, grad_f32, out, grad_scale, hp)


@_jit(parallel=False)
def _momentum_range(lo, hi, master, trace, grad, out, grad_scale, nesterov, hp):
    momentum, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = _as_f32(grad[i]) * grad_scale
        p = master[i]
        if wd != 0:
            g = g + wd * p
        t = g + momentum * trace[i]
        u = g + momentum * t if nesterov else t
        trace[i] = t
        p = p + neg_lr * u
        master[i] = p
        if out is not None:
            out[i] = _bf16_bits_of(p)


@_jit
def _momentum_kernel(master, trace, grad_bits, grad_f32, is_bf16, out, grad_scale, nesterov, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _momentum_range(lo, hi, master, trace, grad_bits, out, grad_scale, nesterov, hp)
        else:
            _momentum_range(lo, hi, master, trace, grad_f32, out, grad_scale, nesterov, hp)


# Parallel launches are serialised: the 'workqueue' threading layer aborts on concurrent launches.
_LAUNCH_LOCK = threading.Lock()

# ----------------------------------------------------------------------------------------------
# Public functions.
# ----------------------------------------------------------------------------------------------


def _check_vec(name: str, a, dtypes, size: int | None, writable: bool) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(_MSG_NOT_ARRAY.format(name=name, type=type(a).__name__))
    dtypes = tuple(np.dtype(d) for d in dtypes)
    ok = (a.ndim == 1 and a.dtype in dtypes and a.flags.c_contiguous and (size is None or a.size == size)
          and (a.flags.writeable or not writable))
    if not ok:
        raise ValueError(_MSG_BAD_ARRAY.format(
            name=name, w=" writable" if writable else "", dtype=" or ".join(map(str, dtypes)),
            size=a.size if size is None else size, ndim=a.ndim, got_dtype=a.dtype, got_size=a.size,
            contig=a.flags.c_contiguous, writeable=a.flags.writeable))
    return a


def _check_distinct(named: dict[str, np.ndarray]):
    items = [(k, a) for k, a in named.items() if a is not None and a.size]
    for i, (ka, a) in enumerate(items):
        for kb, b in items[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError(_MSG_OVERLAP.format(a=ka, b=kb))


@functools.cache
def _cpu_device():
    try:
        return jax.devices("cpu")[0]
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


def host_update_(spec: HostOptimizer, state, grad: np.ndarray, master: np.ndarray,
                 params_bits_out: np.ndarray | None = None, grad_scale: float = 1.0) -> None:
    """One optimizer step of one chunk, in place on host buffers.

    Mutates ``master``, the moments in ``state`` and ``state.count`` (+1, saturating at int32 max),
    and writes ``params_bits_out`` if given. Equals one ``spec.optax()`` update followed by
    ``optax.apply_updates`` to float32 rounding (the clipping scale is applied as one multiply, optax
    divides then multiplies). Padding elements (gradient 0, master 0, moments 0) stay exactly 0.

    Safe to call from any Python thread (the GIL is released while the kernel runs); launches from
    several threads run one at a time.

    Args:
      spec: :class:`AdamW`, :class:`Lion` or :class:`SGDMomentum`.
      state: ``spec.host_state(n)`` (or the same dataclass built over other float32 buffers).
      grad: (n,) gradient, either bf16 bits as np.uint16 (:func:`bf16_bits`) or np.float32.
      master: (n,) np.float32 master params, updated in place.
      params_bits_out: (n,) np.uint16, receives the new params as bf16 bits (round to nearest
        even, as ``jnp.astype(jnp.bfloat16)``), e.g. a :func:`writable_view` of the chunk's bf16
        pinned_host buffer; None to skip.
      grad_scale: multiplies the gradient: 1.0, or ``spec.grad_scale(global_norm)`` for clipping.

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
    state_type = _STATE_TYPES.get(type(spec))
    if state_type is None or not isinstance(state, state_type):
        raise ValueError(_MSG_STATE_MISMATCH.format(spec=type(spec).__name__,
                                                    want=getattr(state_type, "__name__", "known spec"),
                                                    got=type(state).__name__))
    n = _check_vec("master", master, [MASTER_DTYPE], None, True).size
    _check_vec("grad", grad, [BF16_BITS_DTYPE, MASTER_DTYPE], n, False)
    is_bf16 = grad.dtype == BF16_BITS_DTYPE
    grads = (grad, np.empty(0, MASTER_DTYPE), True) if is_bf16 else (np.empty(0, BF16_BITS_DTYPE), grad, False)
    out = params_bits_out
    if out is not None:
        _check_vec("params_bits_out", out, [BF16_BITS_DTYPE], n, True)
    f32 = np.float32
    count = int(state.count)
    neg_lr = -learning_rate_at(spec.learning_rate, count)
    t = min(count + 1, INT32_MAX)
    scale = f32(grad_scale)
    wd = f32(spec.weight_decay)
    if isinstance(spec, AdamW):
        _check_vec("state.m", state.m, [MASTER_DTYPE], n, True)
        _check_vec("state.v", state.v, [MASTER_DTYPE], n, True)
        _check_distinct({"master": master, "state.m": state.m, "state.v": state.v, "grad": grad,
                         "params_bits_out": params_bits_out})
        # 1 - b**t as XLA computes it in float32 (numpy's powf: equal on CPU for t < 2e5). XLA turns
        # optax's division by this scalar into a multiply by its float32 reciprocal; so do we.
        inv_bc1 = f32(1) / (f32(1) - f32(spec.b1) ** f32(t))
        inv_bc2 = f32(1) / (f32(1) - f32(spec.b2) ** f32(t))
        with _LAUNCH_LOCK:
            _adamw_kernel(master, state.m, state.v, *grads, out, scale,
                          (f32(spec.b1), f32(1 - spec.b1), f32(spec.b2), f32(1 - spec.b2), inv_bc1, inv_bc2,
                           f32(spec.eps), wd, neg_lr))
    elif isinstance(spec, Lion):
        _check_vec("state.m", state.m, [MASTER_DTYPE], n, True)
        _check_distinct({"master": master, "state.m": state.m, "grad": grad, "params_bits_out": params_bits_out})
        with _LAUNCH_LOCK:
            _lion_kernel(master, state.m, *grads, out, scale,
                         (f32(spec.b1), f32(1 - spec.b1), f32(spec.b2), f32(1 - spec.b2), wd, neg_lr))
    else:
        _check_vec("state.trace", state.trace, [MASTER_DTYPE], n, True)
        _check_distinct({"master": master, "state.trace": state.trace, "grad": grad,
                         "params_bits_out": params_bits_out})
        with _LAUNCH_LOCK:
            _momentum_kernel(master, state.trace, *grads, out, scale, bool(spec.nesterov),
                             (f32(spec.momentum), wd, neg_lr))
    state.count = t


def bf16_round_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bits (np.uint16, same shape) of float32 ``x``, rounded to nearest even; NaN gives a quiet
    NaN of the same sign, subnormals are kept (as ``jnp.asarray(x).astype(jnp.bfloat16)``).

    Raises:
      ValueError: ``x`` is not a float32 numpy array.
    """
    if not isinstance(x, np.ndarray) or x.dtype != MASTER_DTYPE:
        raise ValueError(f"bf16_round_bits needs a float32 numpy array, got {getattr(x, 'dtype', type(x))}")
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(flat.size, BF16_BITS_DTYPE)
    with _LAUNCH_LOCK:
        _bf16_round_kernel(flat, out)
    return out.reshape(x.shape)


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


def measure_host_update_rate(n: int = 2**24, repeats: int = 5) -> float:
    """Seconds per parameter of the in-place AdamW kernel on this machine (bf16 gradient in, bf16
    params out, all numba threads), the fastest of ``repeats`` timed calls after a warm-up call
    (interference only slows a call: the median once read 0.42 ns on the H200 host where the
    training step's host updates ran at 0.27).
    Calibrates ``chunkjax.cost.Rates.host_update_s_per_param`` (0.27e-9 on the 16-core H200 host).
    Allocates about 16 bytes per parameter (n=2**24: 256 MiB)."""
    rng = np.random.default_rng(0)
    spec = AdamW(1e-3)
    state = spec.host_state(n)
    master = rng.standard_normal(n, dtype=np.float32)
    grad = bf16_round_bits(rng.standard_normal(n, dtype=np.float32))
    out = np.empty(n, BF16_BITS_DTYPE)
    host_update_(spec, state, grad, master, out)  # compile and first-touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        host_update_(spec, state, grad, master, out)
        times.append(time.perf_counter() - t0)
    return float(np.min(times)) / n


__all__ = ["AdamW", "HostAdamState", "HostLionState", "HostMomentumState", "Lion", "SGDMomentum",
           "bf16_bits", "bf16_round_bits", "host_update_", "learning_rate_at", "measure_host_update_rate",
           "writable_view"]
