"""Released parameters: an NNX model's parameter values given up once the step holds them (issue 22).

After :func:`chunkjax.offload` has copied a model's parameters into chunks (float32 masters and
compute params, PatrickStar's chunks, arXiv 2108.05818 section 3), the model's own arrays are a
second copy of the model: for a 3B float32 model 11.2 GiB of host memory beside the chunks
(docs/benchmarks.md, tenth session). :func:`release` replaces the value of each chunked
``nnx.Variable`` by a :class:`ReleasedParam`, the leaf's shape and dtype without its data, so the
arrays are freed as soon as nothing else holds them.

The model keeps its structure: ``nnx.state``, ``nnx.split`` / ``merge`` / ``update``, printing
and counting parameters by shape (``x.size``, ``np.size``) work. Reading a value raises
:class:`ReleasedParamsError` in one line that says to call ``step.sync(model)`` first: the model's
forward (eagerly, under ``nnx.jit`` / ``jax.jit`` / ``nnx.grad``), ``np.asarray``, ``jnp``
functions, indexing, arithmetic, ``jax.device_put``. ``OffloadedStep.sync(model)`` writes the
step's parameters back (``nnx.update``), which makes the model concrete again.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np


class ReleasedParamsError(RuntimeError):
    """A released parameter's value was read (see the module docstring): sync the model first."""


def _message(path: str) -> str:
    return (f"parameter {path!r} of this model was released by chunkjax.offload (the step holds it in its chunks): "
            "call step.sync(model) first (or offload with keep_model=True)")


def _raise(self, *args, **kwargs):
    raise ReleasedParamsError(_message(self.path))


class ReleasedParam:
    """The value of a released ``nnx.Variable``: its ``shape`` (tuple of ints), ``dtype``
    (``np.dtype``), ``path`` (``"blocks/0/wq/kernel"``) and ``sharding`` (where the released
    array lived, None for a numpy value: ``sync`` puts the parameter back there), no data.
    ``size`` and ``ndim`` as an array's; any read of the data raises :class:`ReleasedParamsError`
    (one line).

    JAX reads the data through ``__jax_array__`` (``jnp`` functions, and abstractification for
    ``jax.jit`` arguments, which looks the attribute up: here a property that raises), NumPy
    through ``__array__``; indexing, iteration, conversion and arithmetic raise as well.
    """

    __slots__ = ("shape", "dtype", "path", "sharding")

    def __init__(self, shape, dtype, path: str, sharding=None):
        self.shape, self.dtype, self.path = tuple(int(n) for n in shape), np.dtype(dtype), str(path)
        self.sharding = sharding

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def __jax_array__(self):
        raise ReleasedParamsError(_message(self.path))

    def __getattr__(self, name: str):
        # array attributes the placeholder lacks (sharding, nbytes, astype, block_until_ready, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        raise ReleasedParamsError(_message(self.path))

    def __repr__(self) -> str:
        return f"ReleasedParam(shape={self.shape}, dtype={self.dtype}, path={self.path!r})"

    __array__ = __getitem__ = __setitem__ = __iter__ = __len__ = _raise
    __float__ = __int__ = __index__ = __complex__ = __bool__ = _raise


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
            "rshift", "divmod"):
    setattr(ReleasedParam, f"__{_op}__", _raise)
    setattr(ReleasedParam, f"__r{_op}__", _raise)
for _op in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"):
    setattr(ReleasedParam, f"__{_op}__", _raise)
del _op


def is_released(value) -> bool:
    """``value`` is a :class:`ReleasedParam`."""
    return isinstance(value, ReleasedParam)


def trim_host_heap() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``; nothing elsewhere), so
    that released arrays that were below glibc's mmap threshold leave the process's RSS too
    (measured on the CPU: without it about 60 % of a 0.6 GiB model's bytes left the RSS, with it
    all of them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
