"""The float32 optimizer kernels: AdamW, Lion and SGD with momentum, updated in place on one chunk.

The optimizer arithmetic of every tier that updates chunks outside XLA: the host tier
(:func:`chunkjax.host_update.host_update_`, PatrickStar's "host" update location, Fang et al.,
arXiv 2108.05818, section 5) and the storage tier's near-storage workers
(:mod:`chunkjax.storage.worker`, Smart-Infinity's SmartUpdate, Jang et al., arXiv 2403.06664).
Both use the specs (:class:`AdamW`, :class:`Lion`, :class:`SGDMomentum`, with ``.optax()`` and
``.host_state(n)``), ONE clipping arithmetic (:func:`clip_scale`: the float32 factors
``(1 / norm, max_norm)``, applied one after the other as eager optax does; a single float
``grad_scale`` is the pair ``(s, 1)``), ONE computation of the step's scalars (:func:`step_hyper`:
bias corrections, learning rate) and ONE set of numba kernels (:func:`update_`). So one spec gives
bit-identical master params and moments on both tiers
(``tests/test_host_update.py::test_host_and_storage_tiers_bit_identical``).

The arithmetic is optax's, in float32, the same operations in the same order, IEEE (no fast-math,
no fused multiply-add): eager optax on the JAX CPU backend gives the same bits, clipping included
(XLA there turns a division by a scalar into a multiply by its float32 reciprocal, and so do the
kernels). Jitted optax fuses a*b+c into FMAs and differs in the last bits, as optax on the GPU may.

The kernels read the gradient as bf16 bits (``np.uint16``) or float32, optionally write the new
params as bf16 bits (round to nearest even, NaN stays NaN) or as float32 (a float32 compute copy,
written in the same pass: no second pass over the chunk), and release the GIL. How they run on the
threads (jit options, the launch lock, the dynamic division of a chunk): :mod:`chunkjax.kernel_threads`.
Imports numpy and numba only (``.optax()`` imports optax when called): a near-storage
worker imports no jax (docs/storage.md, "Worker start"). Kernels are compiled once per machine
and cached in ``__pycache__`` (numba ``cache=True``).
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np
from numba import prange

from chunkjax.kernel_elements import as_f32, bf16_bits_of, param_out
from chunkjax.kernel_threads import BLOCK as _BLOCK
from chunkjax.kernel_threads import LAUNCH_LOCK as _LAUNCH_LOCK
from chunkjax.kernel_threads import block_range, bounds_threads, claim, guided_bounds, n_blocks
from chunkjax.kernel_threads import kernel_jit as _jit

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
_MSG_FIELD = "{cls}.{field} = {value!r}: {rule}"


# Optimizer specifications, their host state, and the one clipping arithmetic.

def _check_common(obj, learning_rate, max_grad_norm, weight_decay):
    cls = type(obj).__name__
    if not (callable(learning_rate) or (isinstance(learning_rate, numbers.Real) and abs(learning_rate) < float("inf"))):
        raise ValueError(_MSG_FIELD.format(cls=cls, field="learning_rate", value=learning_rate,
                                           rule="must be a finite float or a schedule count -> lr"))
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(_MSG_FIELD.format(cls=cls, field="max_grad_norm", value=max_grad_norm,
                                           rule="must be None or > 0"))
    if not weight_decay >= 0:
        raise ValueError(_MSG_FIELD.format(cls=cls, field="weight_decay", value=weight_decay, rule="must be >= 0"))


def _check_decay(obj, field, value):
    if not 0 <= value < 1:
        raise ValueError(_MSG_FIELD.format(cls=type(obj).__name__, field=field, value=value,
                                           rule="must be in [0, 1)"))


def clip_scale(max_grad_norm: float | None, global_norm: float) -> tuple[np.float32, np.float32]:
    """The two gradient factors of global-norm clipping, as ``optax.clip_by_global_norm`` rounds
    them: (1, 1) when ``max_grad_norm`` is None or ``global_norm < max_grad_norm`` (optax keeps the
    gradient), else ``(1 / global_norm, max_grad_norm)`` in float32; the kernels multiply by the
    first, then the second (eager optax's bits: XLA turns ``t / norm`` into ``t * (1 / norm)``).
    The one clipping arithmetic of the host and storage tiers: pass it as ``grad_scale``.

    Args:
      max_grad_norm: the clipping threshold (L2 norm), or None for no clipping.
      global_norm: the L2 norm of the whole model's gradient (all chunks), not of one chunk; a
        float32 value (optax computes it in float32).

    Returns:
      ``(a, b)``: np.float32 factors; the gradient becomes ``(g * a) * b``.
    """
    one = np.float32(1)
    if max_grad_norm is None or global_norm < max_grad_norm:
        return one, one
    return one / np.float32(global_norm), np.float32(max_grad_norm)


def _scale_factors(grad_scale) -> tuple[np.float32, np.float32]:
    """``grad_scale`` as the kernels' two factors: a float s is ``(s, 1)`` (one multiply: times 1 is
    exact), a pair from :func:`clip_scale` is itself."""
    if isinstance(grad_scale, tuple):
        a, b = grad_scale
        return np.float32(a), np.float32(b)
    return np.float32(grad_scale), np.float32(1)


def _single_scale(max_grad_norm: float | None, global_norm: float) -> float:
    a, b = clip_scale(max_grad_norm, global_norm)
    return float(a * b)


def _with_clipping(tx, max_grad_norm: float | None):
    import optax
    return tx if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)


@dataclasses.dataclass
class HostAdamState:
    """AdamW state of one chunk in host memory (mutated in place by :func:`update_`).

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

    def optax(self):
        """The optax transformation with exactly this math (``clip_by_global_norm`` then ``adamw``)."""
        import optax
        tx = optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostAdamState:
        """Zero moments for a chunk of ``chunk_size`` elements (8 bytes per element)."""
        return HostAdamState(0, np.zeros(chunk_size, MASTER_DTYPE), np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """The clipping factor as one float, for callers that fold another factor in (a loss-scale
        inverse): 1 without clipping or when ``global_norm`` < max_grad_norm, else the float32
        product of the two factors of :func:`clip_scale` (one rounding more than optax; pass
        ``clip_scale(spec.max_grad_norm, global_norm)`` itself for optax's bits, as the storage tier
        does). ``global_norm`` is the L2 norm of the whole model's gradient, not of one chunk."""
        return _single_scale(self.max_grad_norm, global_norm)


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

    def optax(self):
        """``clip_by_global_norm`` (if set) then ``optax.lion``."""
        import optax
        tx = optax.lion(self.learning_rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostLionState:
        """Zero momentum for a chunk of ``chunk_size`` elements (4 bytes per element)."""
        return HostLionState(0, np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """See :meth:`AdamW.grad_scale`."""
        return _single_scale(self.max_grad_norm, global_norm)


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

    def optax(self):
        """``clip_by_global_norm`` (if set), ``add_decayed_weights``, then ``optax.sgd``."""
        import optax
        tx = optax.chain(optax.add_decayed_weights(self.weight_decay),
                         optax.sgd(self.learning_rate, momentum=self.momentum, nesterov=self.nesterov))
        return _with_clipping(tx, self.max_grad_norm)

    def host_state(self, chunk_size: int) -> HostMomentumState:
        """Zero momentum buffer for a chunk of ``chunk_size`` elements (4 bytes per element)."""
        return HostMomentumState(0, np.zeros(chunk_size, MASTER_DTYPE))

    def grad_scale(self, global_norm: float) -> float:
        """See :meth:`AdamW.grad_scale`."""
        return _single_scale(self.max_grad_norm, global_norm)


HostOptimizer = AdamW | Lion | SGDMomentum

# numba kernels (float32 throughout: every scalar argument is passed as np.float32).


@_jit
def _bf16_round_kernel(x, out):
    for i in prange(x.size):
        out[i] = bf16_bits_of(x[i])


# Each kernel's threads claim ranges of blocks (chunkjax.kernel_threads) and run a per-range loop on each,
# specialised on the gradient's dtype (a branch outside the loop) and on ``out`` being None (numba prunes
# the store). No flag is tested inside a loop (LLVM vectorised only one case of such a loop); unsigned
# indices: no negative-index wraparound, which also blocks vectorisation.


@_jit(parallel=False)
def _adamw_range(lo, hi, master, m, v, grad, out, grad_scale, hp):
    b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
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
            out[i] = param_out(out, p)


@_jit
def _adamw_kernel(master, m, v, grad_bits, grad_f32, is_bf16, out, grad_scale, hp, threads, ctr):
    n = master.size
    bounds = guided_bounds(n_blocks(n), threads)
    for _ in prange(bounds_threads(bounds, threads)):
        k = claim(ctr)
        while k < bounds.size - 1:
            lo, hi = block_range(bounds, k, n)
            if is_bf16:
                _adamw_range(lo, hi, master, m, v, grad_bits, out, grad_scale, hp)
            else:
                _adamw_range(lo, hi, master, m, v, grad_f32, out, grad_scale, hp)
            k = claim(ctr)


@_jit(parallel=False)
def _lion_range(lo, hi, master, m, grad, out, grad_scale, hp):
    b1, one_minus_b1, b2, one_minus_b2, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
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
            out[i] = param_out(out, p)


@_jit
def _lion_kernel(master, m, grad_bits, grad_f32, is_bf16, out, grad_scale, hp, threads, ctr):
    n = master.size
    bounds = guided_bounds(n_blocks(n), threads)
    for _ in prange(bounds_threads(bounds, threads)):
        k = claim(ctr)
        while k < bounds.size - 1:
            lo, hi = block_range(bounds, k, n)
            if is_bf16:
                _lion_range(lo, hi, master, m, grad_bits, out, grad_scale, hp)
            else:
                _lion_range(lo, hi, master, m, grad_f32, out, grad_scale, hp)
            k = claim(ctr)


@_jit(parallel=False)
def _momentum_range(lo, hi, master, trace, grad, out, grad_scale, nesterov, hp):
    momentum, wd, neg_lr = hp
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
        p = master[i]
        if wd != 0:
            g = g + wd * p
        t = g + momentum * trace[i]
        u = g + momentum * t if nesterov else t
        trace[i] = t
        p = p + neg_lr * u
        master[i] = p
        if out is not None:
            out[i] = param_out(out, p)


@_jit
def _momentum_kernel(master, trace, grad_bits, grad_f32, is_bf16, out, grad_scale, nesterov, hp, threads, ctr):
    n = master.size
    bounds = guided_bounds(n_blocks(n), threads)
    for _ in prange(bounds_threads(bounds, threads)):
        k = claim(ctr)
        while k < bounds.size - 1:
            lo, hi = block_range(bounds, k, n)
            if is_bf16:
                _momentum_range(lo, hi, master, trace, grad_bits, out, grad_scale, nesterov, hp)
            else:
                _momentum_range(lo, hi, master, trace, grad_f32, out, grad_scale, nesterov, hp)
            k = claim(ctr)


# The per-step scalars (the one place they are computed) and the update.


#: The np.float32 scalars of one step (:func:`step_hyper`), in the order the kernels unpack them;
#: ``inv_bc1``/``inv_bc2`` are ``1 / (1 - b^t)``, ``neg_lr`` is ``-learning_rate(t - 1)``.
AdamWStep = NamedTuple("AdamWStep", [(f, np.float32) for f in (
    "b1", "one_minus_b1", "b2", "one_minus_b2", "inv_bc1", "inv_bc2", "eps", "weight_decay", "neg_lr")])
LionStep = NamedTuple("LionStep", [(f, np.float32) for f in (
    "b1", "one_minus_b1", "b2", "one_minus_b2", "weight_decay", "neg_lr")])
MomentumStep = NamedTuple("MomentumStep", [("momentum", np.float32), ("weight_decay", np.float32),
                                           ("neg_lr", np.float32), ("nesterov", bool)])


StepHyper = AdamWStep | LionStep | MomentumStep


def next_count(count: int) -> int:
    """The step count after a step taken at ``count`` (int32, saturating as ``optax.safe_increment``)."""
    return min(int(count) + 1, INT32_MAX)


def step_hyper(spec: HostOptimizer, count: int, learning_rate: float) -> StepHyper:
    """The float32 scalars of the step taken when the state's count is ``count`` (the count before
    the step, 0 at the first): the one place the host and storage tiers compute them.

    Args:
      spec: :class:`AdamW`, :class:`Lion` or :class:`SGDMomentum`.
      count: the state's step count before this step (int >= 0).
      learning_rate: the learning rate of this step (``spec.learning_rate`` itself, or a schedule's
        value at ``count``: :func:`chunkjax.host_update.learning_rate_at` evaluates it with jax).

    Returns:
      :class:`AdamWStep`, :class:`LionStep` or :class:`MomentumStep` (a picklable NamedTuple: the
      storage tier sends it to its workers). The AdamW bias corrections ``1 - b**t`` are computed
      as XLA computes them in float32 (numpy's powf: equal on CPU for t < 2e5), and their float32
      reciprocals are taken, as XLA turns optax's division by them into a multiply.

    Raises:
      ValueError: ``spec`` is not one of the three specs.
    """
    f32 = np.float32
    neg_lr, wd = -f32(learning_rate), f32(spec.weight_decay)
    if isinstance(spec, AdamW):
        t = f32(next_count(count))
        return AdamWStep(f32(spec.b1), f32(1 - spec.b1), f32(spec.b2), f32(1 - spec.b2),
                         f32(1) / (f32(1) - f32(spec.b1) ** t), f32(1) / (f32(1) - f32(spec.b2) ** t),
                         f32(spec.eps), wd, neg_lr)
    if isinstance(spec, Lion):
        return LionStep(f32(spec.b1), f32(1 - spec.b1), f32(spec.b2), f32(1 - spec.b2), wd, neg_lr)
    if isinstance(spec, SGDMomentum):
        return MomentumStep(f32(spec.momentum), wd, neg_lr, bool(spec.nesterov))
    raise ValueError(f"step_hyper: spec must be AdamW, Lion or SGDMomentum, got {type(spec).__name__}")


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


_MOMENTS = {AdamWStep: ("state.m", "state.v"), LionStep: ("state.m",), MomentumStep: ("state.trace",)}


def update_(hyper: StepHyper, master: np.ndarray, moments: tuple[np.ndarray, ...], grad: np.ndarray,
            params_bits_out: np.ndarray | None = None,
            grad_scale: float | tuple[float, float] = 1.0) -> None:
    """One optimizer step of one chunk, in place: the kernel both tiers run.

    Args:
      hyper: the step's scalars from :func:`step_hyper` (its type picks the optimizer).
      master: (n,) float32 master params, updated in place.
      moments: the (n,) float32 moment buffers, updated in place: ``(m, v)`` for AdamW, ``(m,)``
        for Lion, ``(trace,)`` for SGD with momentum.
      grad: (n,) gradient, bf16 bits as np.uint16 or np.float32.
      params_bits_out: (n,) np.uint16, receives the new params as bf16 bits (round to nearest
        even), or (n,) np.float32, receives them as they are; None to skip.
      grad_scale: multiplies every gradient element: a float (rounded to float32; 1.0 for none,
        or one factor with a loss-scale inverse folded in), or the two factors of
        :func:`clip_scale`, applied one after the other (optax's rounding).

    Raises:
      ValueError: an array is not a 1-D C-contiguous numpy array of the right dtype and size, an
        output is read-only, two buffers overlap, or ``moments`` has the wrong length.
    """
    names = _MOMENTS.get(type(hyper))
    if names is None:
        raise ValueError(f"update_: hyper must come from step_hyper, got {type(hyper).__name__}")
    if len(moments) != len(names):
        raise ValueError(f"update_: {type(hyper).__name__} needs {len(names)} moment buffers, got {len(moments)}")
    n = _check_vec("master", master, [MASTER_DTYPE], None, True).size
    _check_vec("grad", grad, [BF16_BITS_DTYPE, MASTER_DTYPE], n, False)
    for name, a in zip(names, moments):
        _check_vec(name, a, [MASTER_DTYPE], n, True)
    if params_bits_out is not None:
        _check_vec("params_bits_out", params_bits_out, [BF16_BITS_DTYPE, MASTER_DTYPE], n, True)
    _check_distinct({"master": master, **dict(zip(names, moments)), "grad": grad, "params_bits_out": params_bits_out})
    scale = _scale_factors(grad_scale)
    if n <= _BLOCK:  # one block: the per-range loop on this thread (a parallel launch costs more)
        if isinstance(hyper, AdamWStep):
            _adamw_range(0, n, master, *moments, grad, params_bits_out, scale, tuple(hyper))
        elif isinstance(hyper, LionStep):
            _lion_range(0, n, master, *moments, grad, params_bits_out, scale, tuple(hyper))
        else:
            _momentum_range(0, n, master, *moments, grad, params_bits_out, scale, bool(hyper.nesterov),
                            tuple(hyper)[:3])
        return
    is_bf16 = grad.dtype == BF16_BITS_DTYPE
    grads = (grad, np.empty(0, MASTER_DTYPE), True) if is_bf16 else (np.empty(0, BF16_BITS_DTYPE), grad, False)
    threads, ctr = numba.get_num_threads(), np.zeros(1, np.int64)  # this thread's numba threads; the claims
    with _LAUNCH_LOCK:
        if isinstance(hyper, AdamWStep):
            _adamw_kernel(master, *moments, *grads, params_bits_out, scale, tuple(hyper), threads, ctr)
        elif isinstance(hyper, LionStep):
            _lion_kernel(master, *moments, *grads, params_bits_out, scale, tuple(hyper), threads, ctr)
        else:
            _momentum_kernel(master, *moments, *grads, params_bits_out, scale, bool(hyper.nesterov),
                             tuple(hyper)[:3], threads, ctr)


def load_adamw_kernels(chunk_sizes=(1, _BLOCK + 1)) -> None:
    """Load (from numba's cache, or compile) the AdamW kernels of a dense step on chunks of these
    sizes (bf16 or float32 gradients): the first call in a process costs 0.5-1 s (LLVM start, cache
    load); a near-storage worker runs this on a thread at start, overlapping the trainer's start."""
    hyper = step_hyper(AdamW(0.0), 0, 0.0)
    for n in sorted({1 if n <= _BLOCK else _BLOCK + 1 for n in chunk_sizes}):
        for dtype in (BF16_BITS_DTYPE, MASTER_DTYPE):
            z = [np.zeros(n, MASTER_DTYPE) for _ in range(3)]
            update_(hyper, z[0], (z[1], z[2]), np.zeros(n, dtype), np.empty(n, BF16_BITS_DTYPE))


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


__all__ = ["AdamW", "AdamWStep", "HostAdamState", "HostLionState", "HostMomentumState", "HostOptimizer", "Lion",
           "LionStep", "MomentumStep", "SGDMomentum", "bf16_round_bits", "clip_scale", "load_adamw_kernels",
           "next_count", "step_hyper", "update_"]
