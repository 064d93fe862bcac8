"""Per-element conversions inside the host kernels (:mod:`chunkjax.kernels`,
:mod:`chunkjax.kernels_inverse`): a gradient element read as float32 (from bf16 bits or float32),
a new param written in its output's form (bf16 bits, round to nearest even as XLA; or float32), in
numba ``@overload`` form so that each kernel is specialised on its arrays' dtypes (a branch on a
dtype, not a flag inside the loop).

bf16 values are carried as their raw bits (``np.uint16``): numpy and numba have no bfloat16.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from chunkjax.kernel_threads import kernel_jit as _jit


def as_f32(x):
    """A gradient element as float32; implemented for numba below."""
    raise NotImplementedError


@overload(as_f32)
def as_f32_impl(x):
    if x == types.uint16:  # bf16 bits: widening is exact
        return lambda x: np.uint32(np.uint32(x) << 16).view(np.float32)
    if x == types.float32:
        return lambda x: x
    return None


@_jit(parallel=False)
def bf16_bits_of(x):
    """bf16 bits of float32 x, round to nearest even; NaN -> quiet NaN with x's sign (as XLA)."""
    b = np.float32(x).view(np.uint32)
    if x != x:
        return np.uint16(((b >> 16) & 0x8000) | 0x7FC0)
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


def param_out(out, p):
    """The new param ``p`` (float32) as ``out`` stores it; implemented for numba below."""
    raise NotImplementedError


@overload(param_out)
def param_out_impl(out, p):
    if out.dtype == types.uint16:  # bf16 bits, round to nearest even
        def bits(out, p):
            return bf16_bits_of(p)
        return bits
    if out.dtype == types.float32:  # float32 compute params: the master's own value
        def same(out, p):
            return p
        return same
    return None


__all__ = ["as_f32", "bf16_bits_of", "param_out"]
