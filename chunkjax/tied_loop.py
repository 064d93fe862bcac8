"""A micro-batch loop whose buffers come into existence with its inputs (issue 24).

``jax.lax.scan`` lowers to an XLA while loop whose carry starts from buffers XLA fills before the
loop: the carry's initial values and the stacked outputs' (``ys``) buffers, which ``lax.scan`` makes
itself from constants. Constants depend on nothing: XLA shares one fill between loops, copy insertion
gives each loop its own copy, and the scheduler puts those copies at the program's start. In a
program of several in-program moments (:mod:`chunkjax.plan_micro`) every later loop's float32 gradient
sums and stacked cotangents were then live from the program's first moment (on the H200 +3.5e9 bytes,
18 % of a backward program; ``docs/storage.md``).

:func:`tied_scan` runs the same loop with every buffer it fills derived from its first scanned input:
a float32 zero computed from that input's first element (:func:`tied_zero`), the fresh zeros (carry
leaves given as ``jax.ShapeDtypeStruct``) and the stacked outputs' buffers broadcasts of it, carried
by the loop and written in place (``dynamic_update_index_in_dim``). None of the loop's buffers can be
filled before that input exists (for a backward moment: the incoming cotangent, the previous loop's
output), so the scheduler cannot hoist them. The arithmetic is the scan's, in the same order: results
are bit-identical. (An ``optimization_barrier`` tying the zero to the inputs did the same on the
compile, but on the CPU, where the barriers are expanded before the last CSE, a donated step then
returned a device buffer for a pinned_host gradient at run time.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _is_spec(a) -> bool:
    return isinstance(a, jax.ShapeDtypeStruct)


def _fill(zero, spec):
    """Zeros of ``spec``'s shape and dtype, a broadcast of the tied scalar ``zero``."""
    return jnp.broadcast_to(zero.astype(spec.dtype), spec.shape)


def tied_zero(x) -> jax.Array:
    """A float32 scalar +0.0 that XLA cannot compute before ``x`` (an array) exists: ``|x[0]| * 0``
    where that is finite, else 0 (exactly +0.0 for every value of ``x``; arithmetic the compiler
    cannot fold, where an ``optimization_barrier`` on the CPU, expanded before its last CSE, let
    a pinned_host output alias a device buffer at run time)."""
    v = jnp.abs(x.reshape(-1)[0].astype(jnp.float32))
    return jnp.where(jnp.isfinite(v), v * 0.0, 0.0).astype(jnp.float32)


def tied_scan(body, init, xs, *, unroll: bool = False):
    """``jax.lax.scan(body, init, xs)`` whose buffers cannot be filled before its inputs exist.

    Args:
      body: ``(carry, x) -> (carry, y)`` as for ``jax.lax.scan``.
      init: the initial carry (a pytree); a ``jax.ShapeDtypeStruct`` leaf stands for zeros of its
        shape and dtype, made after the tie (a ``jnp.zeros`` passed in is a constant XLA may fill at
        the program's start).
      xs: the scanned inputs, leaves ``[M, ...]`` (M >= 1 the same for all); the buffers wait for
        the first leaf (put the loop's incoming cotangent or activation first).
      unroll: trace the loop unrolled (``jax.lax.scan(..., unroll=True)``: straight-line code, no
        loop buffers; the zeros are plain ``jnp.zeros``).

    Returns:
      ``(carry, ys)`` as ``jax.lax.scan``: ys leaves ``[M, ...]``, bit-identical to it.

    Raises:
      ValueError: ``xs`` has no array leaf (the loop's length would be unknown)."""
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("tied_scan needs at least one scanned array in xs (its first axis is the loop's length)")
    if unroll:
        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if _is_spec(a) else a, init, is_leaf=_is_spec)
        return jax.lax.scan(body, init, xs, unroll=True)
    m = leaves[0].shape[0]
    specs = jax.tree.map(lambda a: a if _is_spec(a) else jax.ShapeDtypeStruct(a.shape, a.dtype), init, is_leaf=_is_spec)
    _, y_spec = jax.eval_shape(body, specs, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs))
    zero = tied_zero(leaves[0])
    carry = jax.tree.map(lambda a: _fill(zero, a) if _is_spec(a) else a, init, is_leaf=_is_spec)
    ys = jax.tree.map(lambda s: _fill(zero, jax.ShapeDtypeStruct((m,) + tuple(s.shape), s.dtype)), y_spec)

    def step(c, x):
        i, c, ys = c
        c, y = body(c, x)
        ys = jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0), ys, y)
        return (i + 1, c, ys), None

    (_, carry, ys), _ = jax.lax.scan(step, (jnp.zeros((), jnp.int32), carry, ys), xs, unroll=1)
    return carry, ys
