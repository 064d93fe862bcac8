"""Inverse optimizer kernels: undo one in-place AdamW, Lion or SGD-momentum step of a chunk.

A host chunk updated *speculatively* (:mod:`chunkjax.speculate`: before the global norm fixes
the gradient's factor) must be put back when the factor turns out different (clipping fired, a
skipped non-finite step). The forward step of :mod:`chunkjax.kernels` is invertible given the
gradient it applied and its factor (the speculation keeps both until the validation), so no copy
of the old state is needed: :func:`invert_` recomputes each element's old master param and
moments from the new ones, in float32, on all numba threads (the forward's threading and launch
lock), and :func:`gradient_finite` tells whether a chunk's scaled gradient is finite (a
non-finite element destroys the old state: such a chunk is not speculated).

Per element, with ``g = (grad * a) * b`` computed as the forward computes it and the step's
scalars of :func:`chunkjax.kernels.step_hyper` (the step being undone: count - 1):

* AdamW: ``u = (m' / bc1) / (sqrt(v' / bc2) + eps)`` is recomputed bit for bit from the new
  moments; ``m = (m' - (1-b1) g) / b1``, ``v = max(0, (v' - (1-b2) g^2) / b2)``,
  ``p = (p' + lr u) / (1 - lr wd)``.
* Lion: ``m = (m' - (1-b2) g) / b2``; ``s = sign((1-b1) g + b1 m)``;
  ``p = (p' + lr s) / (1 - lr wd)``. Where ``x = (1-b1) g + b1 m`` is within its rounding of 0
  the recovered sign may be the other one (every sign reproduces ``p'``: nothing tells them
  apart), an error of ``lr`` or ``2 lr`` on that element; the forward's own float32 ``x`` has
  that sign by rounding too (fused multiply-adds, as jitted optax uses, can flip it). Measured:
  none in 1.3e7 random elements (``experiments/rollback/lion_sign_flips.py``).
* SGD with momentum: ``p = p' + lr t'`` (Nesterov: ``(p' + lr (g + mu t')) / (1 - lr wd)``),
  ``t = (t' - (g + wd p)) / mu``.

Accuracy: not bit-exact (the forward rounds), ``tests/test_rollback.py`` measures it. The old
value of a moment is recovered to about one float32 ulp *of the new value*: where the gradient
term dominates the new moment (``v' >> b2 v``: a gradient far above that element's history) the
old moment's relative error grows as ``v' / (b2 v)``. A redo with a factor ``c < 1`` (clipping)
then carries a relative error of about ``ulp * min(v' / (b2 v), 1 / c^2)`` in ``v``:
``docs/design.md``, "Rollback by inversion", gives the regime and the policy that avoids it.

Not invertible (:func:`invertible`): a zero decay rate (``b1``, ``b2`` or ``momentum`` of 0:
the old moment is multiplied by 0 and lost) and ``lr * wd > 1/2`` (the division by
``1 - lr wd`` would amplify the rounding more than twice); :mod:`chunkjax.speculate` backs such
chunks up instead.

Imports numpy and numba only, like :mod:`chunkjax.kernels`.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from chunkjax.kernel_threads import BLOCK as _BLOCK
from chunkjax.kernel_threads import LAUNCH_LOCK as _LAUNCH_LOCK
from chunkjax.kernel_threads import kernel_jit as _jit
from chunkjax.kernel_elements import as_f32, bf16_bits_of
from chunkjax.kernels import (_MOMENTS, BF16_BITS_DTYPE, MASTER_DTYPE, AdamWStep, LionStep, MomentumStep, StepHyper,
                              _check_distinct, _check_vec, _scale_factors)

#: ``lr * weight_decay`` above this: the inverse divides by ``1 - lr wd`` < 1/2 (not inverted).
MAX_LR_WD = 0.5


def _elem(f):
    """A per-element step, inlined into the range loops (IEEE float32 as :func:`chunkjax.kernels._jit`)."""
    return numba.njit(inline="always", fastmath=False, error_model="numpy")(f)


# Per-element forward steps: the arithmetic of chunkjax.kernels' range loops, operation for
# operation (tests/test_rollback.py checks the bits against update_).

@_elem
def _adamw_fwd(p, mo, vo, g, hp):
    b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, wd, neg_lr = hp
    mi = one_minus_b1 * g + b1 * mo
    vi = one_minus_b2 * (g * g) + b2 * vo
    u = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2) + eps)
    if wd != 0:
        u = u + wd * p
    return p + neg_lr * u, mi, vi


@_elem
def _adamw_inv(p1, mi, vi, g, hp):
    b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, wd, neg_lr = hp
    u = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2) + eps)  # the forward's u, bit for bit
    p = p1 - neg_lr * u
    if wd != 0:
        p = p / (np.float32(1) + neg_lr * wd)
    vo = (vi - one_minus_b2 * (g * g)) / b2
    return p, (mi - one_minus_b1 * g) / b1, vo if vo > 0 else np.float32(0)  # rounding may leave a tiny negative


@_elem
def _lion_fwd(p, mo, g, hp):
    b1, one_minus_b1, b2, one_minus_b2, wd, neg_lr = hp
    x = one_minus_b1 * g + b1 * mo
    u = np.float32(1.0) if x > 0 else (np.float32(-1.0) if x < 0 else x)  # jnp.sign (0, -0, NaN kept)
    mi = one_minus_b2 * g + b2 * mo
    if wd != 0:
        u = u + wd * p
    return p + neg_lr * u, mi


@_elem
def _lion_inv(p1, mi, g, hp):
    b1, one_minus_b1, b2, one_minus_b2, wd, neg_lr = hp
    mo = (mi - one_minus_b2 * g) / b2
    x = one_minus_b1 * g + b1 * mo
    s = np.float32(1.0) if x > 0 else (np.float32(-1.0) if x < 0 else x)
    p = p1 - neg_lr * s
    if wd != 0:
        p = p / (np.float32(1) + neg_lr * wd)
    return p, mo


@_elem
def _momentum_fwd(p, tr, g, nesterov, hp):
    momentum, wd, neg_lr = hp
    if wd != 0:
        g = g + wd * p
    t = g + momentum * tr
    u = g + momentum * t if nesterov else t
    return p + neg_lr * u, t


@_elem
def _momentum_inv(p1, t, g, nesterov, hp):
    momentum, wd, neg_lr = hp
    if nesterov:
        p = p1 - neg_lr * (g + momentum * t)
        if wd != 0:
            p = p / (np.float32(1) + neg_lr * wd)
    else:
        p = p1 - neg_lr * t
    if wd != 0:
        g = g + wd * p
    return p, (t - g) / momentum


# Range loops: the inverse alone (a speculated chunk), or the canonical update of a chunk that did
# not speculate: forward with the guessed factor, inverse, then forward with the right factor
# (``final``; False: a skipped step, no second forward), in registers, one pass over memory.

@_jit(parallel=False)
def _adamw_inv_range(lo, hi, master, m, v, grad, grad_scale, hp):
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
        master[i], m[i], v[i] = _adamw_inv(master[i], m[i], v[i], g, hp)


@_jit(parallel=False)
def _adamw_canon_range(lo, hi, master, m, v, grad, out, guess, right, final, hp):
    if final:
        for i in range(np.uint64(lo), np.uint64(hi)):
            x = as_f32(grad[i])
            g = (x * guess[0]) * guess[1]
            p, mi, vi = _adamw_fwd(master[i], m[i], v[i], g, hp)
            p, mi, vi = _adamw_inv(p, mi, vi, g, hp)
            p, mi, vi = _adamw_fwd(p, mi, vi, (x * right[0]) * right[1], hp)
            master[i], m[i], v[i] = p, mi, vi
            if out is not None:
                out[i] = bf16_bits_of(p)
    else:
        for i in range(np.uint64(lo), np.uint64(hi)):
            g = (as_f32(grad[i]) * guess[0]) * guess[1]
            p, mi, vi = _adamw_fwd(master[i], m[i], v[i], g, hp)
            master[i], m[i], v[i] = _adamw_inv(p, mi, vi, g, hp)


@_jit(parallel=False)
def _lion_inv_range(lo, hi, master, m, grad, grad_scale, hp):
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
        master[i], m[i] = _lion_inv(master[i], m[i], g, hp)


@_jit(parallel=False)
def _lion_canon_range(lo, hi, master, m, grad, out, guess, right, final, hp):
    if final:
        for i in range(np.uint64(lo), np.uint64(hi)):
            x = as_f32(grad[i])
            g = (x * guess[0]) * guess[1]
            p, mi = _lion_fwd(master[i], m[i], g, hp)
            p, mi = _lion_inv(p, mi, g, hp)
            p, mi = _lion_fwd(p, mi, (x * right[0]) * right[1], hp)
            master[i], m[i] = p, mi
            if out is not None:
                out[i] = bf16_bits_of(p)
    else:
        for i in range(np.uint64(lo), np.uint64(hi)):
            g = (as_f32(grad[i]) * guess[0]) * guess[1]
            p, mi = _lion_fwd(master[i], m[i], g, hp)
            master[i], m[i] = _lion_inv(p, mi, g, hp)


@_jit(parallel=False)
def _momentum_inv_range(lo, hi, master, trace, grad, grad_scale, nesterov, hp):
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
        master[i], trace[i] = _momentum_inv(master[i], trace[i], g, nesterov, hp)


@_jit(parallel=False)
def _momentum_canon_range(lo, hi, master, trace, grad, out, guess, right, final, nesterov, hp):
    if final:
        for i in range(np.uint64(lo), np.uint64(hi)):
            x = as_f32(grad[i])
            g = (x * guess[0]) * guess[1]
            p, t = _momentum_fwd(master[i], trace[i], g, nesterov, hp)
            p, t = _momentum_inv(p, t, g, nesterov, hp)
            p, t = _momentum_fwd(p, t, (x * right[0]) * right[1], nesterov, hp)
            master[i], trace[i] = p, t
            if out is not None:
                out[i] = bf16_bits_of(p)
    else:
        for i in range(np.uint64(lo), np.uint64(hi)):
            g = (as_f32(grad[i]) * guess[0]) * guess[1]
            p, t = _momentum_fwd(master[i], trace[i], g, nesterov, hp)
            master[i], trace[i] = _momentum_inv(p, t, g, nesterov, hp)


@_jit
def _adamw_inv_kernel(master, m, v, grad_bits, grad_f32, is_bf16, grad_scale, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _adamw_inv_range(lo, hi, master, m, v, grad_bits, grad_scale, hp)
        else:
            _adamw_inv_range(lo, hi, master, m, v, grad_f32, grad_scale, hp)


@_jit
def _adamw_canon_kernel(master, m, v, grad_bits, grad_f32, is_bf16, out, guess, right, final, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _adamw_canon_range(lo, hi, master, m, v, grad_bits, out, guess, right, final, hp)
        else:
            _adamw_canon_range(lo, hi, master, m, v, grad_f32, out, guess, right, final, hp)


@_jit
def _lion_inv_kernel(master, m, grad_bits, grad_f32, is_bf16, grad_scale, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _lion_inv_range(lo, hi, master, m, grad_bits, grad_scale, hp)
        else:
            _lion_inv_range(lo, hi, master, m, grad_f32, grad_scale, hp)


@_jit
def _lion_canon_kernel(master, m, grad_bits, grad_f32, is_bf16, out, guess, right, final, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _lion_canon_range(lo, hi, master, m, grad_bits, out, guess, right, final, hp)
        else:
            _lion_canon_range(lo, hi, master, m, grad_f32, out, guess, right, final, hp)


@_jit
def _momentum_inv_kernel(master, trace, grad_bits, grad_f32, is_bf16, grad_scale, nesterov, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _momentum_inv_range(lo, hi, master, trace, grad_bits, grad_scale, nesterov, hp)
        else:
            _momentum_inv_range(lo, hi, master, trace, grad_f32, grad_scale, nesterov, hp)


@_jit
def _momentum_canon_kernel(master, trace, grad_bits, grad_f32, is_bf16, out, guess, right, final, nesterov, hp):
    n = master.size
    for blk in prange((n + _BLOCK - 1) // _BLOCK):
        lo, hi = blk * _BLOCK, min(blk * _BLOCK + _BLOCK, n)
        if is_bf16:
            _momentum_canon_range(lo, hi, master, trace, grad_bits, out, guess, right, final, nesterov, hp)
        else:
            _momentum_canon_range(lo, hi, master, trace, grad_f32, out, guess, right, final, nesterov, hp)


@_jit(parallel=False)
def _finite_range(lo, hi, grad, grad_scale):
    for i in range(np.uint64(lo), np.uint64(hi)):
        g = (as_f32(grad[i]) * grad_scale[0]) * grad_scale[1]
        if not np.isfinite(g * g):
            return False
    return True


@_jit
def _finite_kernel(grad_bits, grad_f32, is_bf16, grad_scale, out):
    n = out.size
    size = grad_bits.size if is_bf16 else grad_f32.size
    step = (size + n - 1) // n
    for k in prange(n):
        lo, hi = min(k * step, size), min(k * step + step, size)
        out[k] = _finite_range(lo, hi, grad_bits, grad_scale) if is_bf16 else _finite_range(lo, hi, grad_f32,
                                                                                              grad_scale)


def invertible(hyper: StepHyper) -> bool:
    """Whether :func:`invert_` can undo a step with these scalars (module docstring): every decay
    rate nonzero and ``lr * weight_decay <= MAX_LR_WD``."""
    lr_wd = -float(hyper.neg_lr) * float(hyper.weight_decay)
    if not (abs(lr_wd) <= MAX_LR_WD):
        return False
    if isinstance(hyper, AdamWStep):
        return hyper.b1 != 0 and hyper.b2 != 0
    if isinstance(hyper, LionStep):
        return hyper.b2 != 0
    return isinstance(hyper, MomentumStep) and hyper.momentum != 0


def _check_args(fn: str, hyper, master, moments, grad) -> tuple[str, ...]:
    names = _MOMENTS.get(type(hyper))
    if names is None:
        raise ValueError(f"{fn}: hyper must come from step_hyper, got {type(hyper).__name__}")
    if len(moments) != len(names):
        raise ValueError(f"{fn}: {type(hyper).__name__} needs {len(names)} moment buffers, got {len(moments)}")
    if not invertible(hyper):
        raise ValueError(f"{fn}: this step is not invertible (a zero decay rate or lr * weight_decay > "
                         f"{MAX_LR_WD}): back the state up instead ({hyper})")
    n = _check_vec("master", master, [MASTER_DTYPE], None, True).size
    _check_vec("grad", grad, [BF16_BITS_DTYPE, MASTER_DTYPE], n, False)
    for name, a in zip(names, moments):
        _check_vec(name, a, [MASTER_DTYPE], n, True)
    return names


def _grads(grad):
    is_bf16 = grad.dtype == BF16_BITS_DTYPE
    return (grad, np.empty(0, MASTER_DTYPE), True) if is_bf16 else (np.empty(0, BF16_BITS_DTYPE), grad, False)


def invert_(hyper: StepHyper, master: np.ndarray, moments: tuple[np.ndarray, ...], grad: np.ndarray,
            grad_scale: float | tuple[float, float] = 1.0) -> None:
    """Undo one :func:`chunkjax.kernels.update_` of one chunk, in place (module docstring).

    Args:
      hyper: the undone step's scalars (:func:`chunkjax.kernels.step_hyper` at the count
        *before* that step); :func:`invertible` must hold.
      master: (n,) float32 master params after the step, put back in place.
      moments: the (n,) float32 moment buffers after the step (``(m, v)``, ``(m,)`` or
        ``(trace,)``), put back in place.
      grad: (n,) the gradient that step applied, bf16 bits as np.uint16 or np.float32.
      grad_scale: the factor that step applied (a float or the pair of
        :func:`chunkjax.kernels.clip_scale`).

    The step count and the compute params are the caller's (:func:`chunkjax.host_update.host_invert_`).

    Raises:
      ValueError: as :func:`chunkjax.kernels.update_`, or ``hyper`` not :func:`invertible`.
    """
    names = _check_args("invert_", hyper, master, moments, grad)
    _check_distinct({"master": master, **dict(zip(names, moments)), "grad": grad})
    scale, hp, n = _scale_factors(grad_scale), tuple(hyper), master.size
    if n <= _BLOCK:  # one block: this thread
        if isinstance(hyper, AdamWStep):
            _adamw_inv_range(0, n, master, *moments, grad, scale, hp)
        elif isinstance(hyper, LionStep):
            _lion_inv_range(0, n, master, *moments, grad, scale, hp)
        else:
            _momentum_inv_range(0, n, master, *moments, grad, scale, bool(hyper.nesterov), hp[:3])
        return
    with _LAUNCH_LOCK:
        if isinstance(hyper, AdamWStep):
            _adamw_inv_kernel(master, *moments, *_grads(grad), scale, hp)
        elif isinstance(hyper, LionStep):
            _lion_inv_kernel(master, *moments, *_grads(grad), scale, hp)
        else:
            _momentum_inv_kernel(master, *moments, *_grads(grad), scale, bool(hyper.nesterov), hp[:3])


def canonical_(hyper: StepHyper, master: np.ndarray, moments: tuple[np.ndarray, ...], grad: np.ndarray,
               params_bits_out: np.ndarray | None, guess, right) -> None:
    """The update of a chunk that did not speculate on a step whose factor is not the guessed one,
    in place, in one pass: forward with ``guess``, :func:`invert_`'s inverse, then forward with
    ``right`` (None: a skipped step, no second forward and no ``params_bits_out``), each element in
    registers. Gives the bits a speculated chunk gets from :func:`chunkjax.kernels.update_` with
    ``guess``, :func:`invert_`, then ``update_`` with ``right``: rollback by inversion then
    depends on no timing (:mod:`chunkjax.speculate`).

    Args:
      hyper: the step's scalars (:func:`chunkjax.kernels.step_hyper` at the state's count);
        :func:`invertible` must hold.
      master, moments, grad, params_bits_out: as :func:`chunkjax.kernels.update_`.
      guess, right: factors as ``update_``'s ``grad_scale``; ``right`` None for a skip.

    Raises:
      ValueError: as :func:`invert_`.
    """
    names = _check_args("canonical_", hyper, master, moments, grad)
    if params_bits_out is not None:
        _check_vec("params_bits_out", params_bits_out, [BF16_BITS_DTYPE], master.size, True)
    _check_distinct({"master": master, **dict(zip(names, moments)), "grad": grad, "params_bits_out": params_bits_out})
    final = right is not None
    out = params_bits_out if final else None
    g_s, r_s, hp = _scale_factors(guess), _scale_factors(right if final else 1.0), tuple(hyper)
    if master.size <= _BLOCK:
        if isinstance(hyper, AdamWStep):
            _adamw_canon_range(0, master.size, master, *moments, grad, out, g_s, r_s, final, hp)
        elif isinstance(hyper, LionStep):
            _lion_canon_range(0, master.size, master, *moments, grad, out, g_s, r_s, final, hp)
        else:
            _momentum_canon_range(0, master.size, master, *moments, grad, out, g_s, r_s, final,
                                  bool(hyper.nesterov), hp[:3])
        return
    with _LAUNCH_LOCK:
        if isinstance(hyper, AdamWStep):
            _adamw_canon_kernel(master, *moments, *_grads(grad), out, g_s, r_s, final, hp)
        elif isinstance(hyper, LionStep):
            _lion_canon_kernel(master, *moments, *_grads(grad), out, g_s, r_s, final, hp)
        else:
            _momentum_canon_kernel(master, *moments, *_grads(grad), out, g_s, r_s, final, bool(hyper.nesterov),
                                   hp[:3])


def gradient_finite(grad: np.ndarray, grad_scale: float | tuple[float, float] = 1.0) -> bool:
    """Whether every element ``g = (grad * a) * b`` (the kernels' arithmetic) has a finite square:
    the condition for :func:`invert_` to recover a chunk after a step with this factor (a NaN or
    inf ``g``, or an overflowing ``g^2``, leaves NaN or inf in the moments). Reads the (n,)
    gradient (bf16 bits or float32) once, on all numba threads.

    Raises:
      ValueError: ``grad`` is not a 1-D C-contiguous uint16 or float32 array.
    """
    _check_vec("grad", grad, [BF16_BITS_DTYPE, MASTER_DTYPE], None, False)
    scale = _scale_factors(grad_scale)
    if grad.size <= _BLOCK:
        return bool(_finite_range(0, grad.size, grad, scale))
    out = np.empty(min(256, -(-grad.size // _BLOCK)), np.bool_)
    with _LAUNCH_LOCK:
        _finite_kernel(*_grads(grad), scale, out)
    return bool(out.all())


__all__ = ["MAX_LR_WD", "canonical_", "gradient_finite", "invert_", "invertible"]
