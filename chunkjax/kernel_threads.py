"""How a host kernel runs on the numba threads: its jit options, the launch lock, and a dynamic
(guided) division of a chunk's elements among the threads.

The host optimizer kernels (:mod:`chunkjax.kernels`: PatrickStar's host update location, Fang et
al., arXiv 2108.05818, section 5; Smart-Infinity's near-storage update, Jang et al., arXiv
2403.06664) are bound by host memory bandwidth and run on every core. numba's ``prange`` divides
the iterations statically, one equal range per thread; inside a training step other threads (the
runtime's transfer threads, the Python thread that dispatches programs) take a core from time to
time, and the whole launch then waits for the thread that lost it. Here each thread instead
*claims* ranges of blocks from a shared counter (an atomic fetch-and-add) until none is left, and
the ranges shrink towards the end (guided scheduling: each is about ``remaining / (2 * threads)``
blocks), so a slowed thread takes fewer ranges and the others finish the chunk.

The division changes nothing in the arithmetic: each element is updated once, by the same
per-element code, whichever thread runs it (``tests/test_kernel_threads.py``).

Parallel launches are serialised by :data:`LAUNCH_LOCK` (numba's ``workqueue`` threading layer
aborts the process on concurrent ones; each launch already uses every numba thread).

Use inside a ``parallel=True`` njit kernel::

    bounds = guided_bounds(n_blocks(n), threads)  # both passed in by the caller: threads =
    # numba.get_num_threads(), ctr = np.zeros(1, np.int64) (allocated outside the kernel: numba's
    # parfor passes do not see the claims' atomic writes, so an array made inside is not safe to read)
    for _ in prange(bounds_threads(bounds, threads)):
        k = claim(ctr)
        while k < bounds.size - 1:
            lo, hi = block_range(bounds, k, n)
            ...  # the per-element loop over [lo, hi)
            k = claim(ctr)
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

#: Held around every parallel kernel launch (see the module docstring).
LAUNCH_LOCK = threading.Lock()

#: Elements in one block: the smallest range a thread claims (16 KiB of float32 per stream).
BLOCK = 4096


def kernel_jit(fn=None, *, parallel=True):
    """njit with IEEE float semantics (no fast-math), no GIL, numpy's error model (x/0 gives inf, not
    an exception); cached in ``__pycache__`` when a cache location is writable, else compiled per
    process. Usable bare (``@kernel_jit``) or with ``parallel=False``."""
    def deco(f):
        opts = dict(parallel=parallel, nogil=True, fastmath=False, error_model="numpy")
        try:
            return numba.njit(cache=True, **opts)(f)
        except RuntimeError:  # no writable cache location
            return numba.njit(cache=False, **opts)(f)
    return deco if fn is None else deco(fn)


@intrinsic
def _fetch_add(typingctx, counter, delta):
    """Atomically add ``delta`` to ``counter[0]`` (a 1-D int64 array); returns the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None
    sig = types.int64(counter, delta)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        value = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", ary.data, value, "monotonic")
    return sig, codegen


@kernel_jit(parallel=False)
def claim(counter):
    """The next unclaimed range index of ``counter`` (a (1,) int64 array, 0 before the first claim):
    an atomic fetch-and-add of 1, safe from every numba thread of one launch."""
    return _fetch_add(counter, 1)


@kernel_jit(parallel=False)
def n_blocks(n):
    """Blocks of :data:`BLOCK` elements covering ``n`` elements (the last may be short)."""
    return (n + BLOCK - 1) // BLOCK


@kernel_jit(parallel=False)
def guided_bounds(nb, threads):
    """Range boundaries, in blocks, of a guided division of ``nb`` blocks among ``threads`` threads.

    Args:
      nb: blocks (>= 0). threads: numba threads of the launch (>= 1).

    Returns:
      (k + 1,) int64, increasing from 0 to ``nb``: range ``i`` is blocks ``[b[i], b[i+1])``, of
      ``max(1, remaining // (2 * threads))`` blocks (large ranges first, single blocks last).
    """
    out = np.empty(nb + 1, np.int64)
    out[0] = 0
    k, start = 0, 0
    step = 2 * max(1, threads)
    while start < nb:
        size = max(1, (nb - start) // step)
        start = min(nb, start + size)
        k += 1
        out[k] = start
    return out[: k + 1]


@kernel_jit(parallel=False)
def bounds_threads(bounds, threads):
    """How many claiming loops to start: ``threads`` (the launch's numba threads, read with
    ``numba.get_num_threads()`` by the caller: inside a kernel it would stop numba's cache), at most
    one per range."""
    return max(1, min(threads, bounds.size - 1))


@kernel_jit(parallel=False)
def block_range(bounds, k, n):
    """Elements ``(lo, hi)`` of range ``k`` of ``bounds`` over ``n`` elements."""
    return bounds[k] * BLOCK, min(bounds[k + 1] * BLOCK, n)


__all__ = ["BLOCK", "LAUNCH_LOCK", "block_range", "bounds_threads", "claim", "guided_bounds", "kernel_jit", "n_blocks"]
