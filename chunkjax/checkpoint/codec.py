"""The ``extra`` dict of a checkpoint as JSON: numbers, strings, None, lists, tuples, dicts with
string keys, numpy / jax arrays (dtype, shape, base64 bytes) and typed PRNG keys (their
implementation and key data)."""
from __future__ import annotations

import base64

import jax
import jax.numpy as jnp
import numpy as np


def encode(x, where="extra"):
    """``x`` as JSON-serialisable data (arrays and PRNG keys tagged). Raises a one-line TypeError
    naming the path ``where`` of a value that cannot be saved (an object, a dict key not a string)."""
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be strings, got {k!r}")
        return {k: encode(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return {"__prng_key__": str(jax.random.key_impl(x)), "data": encode(np.asarray(jax.random.key_data(x)))}
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        a = np.asarray(x)  # not ascontiguousarray: it makes a 0-d array 1-d (tobytes is C order anyway)
        if a.dtype == object:
            raise TypeError(f"{where}: object arrays cannot be saved")
        return {"__ndarray__": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
    raise TypeError(f"{where}: {type(x).__name__} cannot be saved in extra (use numbers, strings, lists, "
                    "dicts, numpy/jax arrays or PRNG keys)")


def decode(x):
    """The inverse of :func:`encode`: arrays as numpy (writable), PRNG keys as typed key arrays,
    tuples as tuples."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        if "__tuple__" in x:
            return tuple(decode(v) for v in x["__tuple__"])
        if "__ndarray__" in x:
            dt = jnp.dtype(x["__ndarray__"])  # knows bfloat16 etc. (ml_dtypes)
            return np.frombuffer(base64.b64decode(x["data"]), dt).reshape(x["shape"]).copy()
        if "__prng_key__" in x:
            return jax.random.wrap_key_data(decode(x["data"]), impl=x["__prng_key__"])
        return {k: decode(v) for k, v in x.items()}
    return x

