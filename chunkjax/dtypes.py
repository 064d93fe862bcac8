"""Compute-dtype spellings: one parser for the API (``compute_dtype=``) and the planner CLI
(``--compute-dtype``), so that both accept the same names (section "mixed precision" of
``docs/own_model.md``: bf16 compute params and gradients, float32 master weights)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

#: accepted string spellings (case-insensitive) -> dtype name
SPELLINGS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "f32": "float32",
             "float16": "float16", "fp16": "float16", "f16": "float16"}


def compute_dtype_of(x: Any):
    """The floating compute dtype that ``x`` names.

    Args:
      x: None (returned as None: the caller's default), a dtype or scalar type
        (``jnp.bfloat16``, ``np.float32``...) or a string of :data:`SPELLINGS` (e.g. ``"bf16"``).

    Returns:
      ``jnp.dtype`` (bfloat16, float16 or float32, or another floating dtype given as a dtype), or None.

    Raises:
      ValueError: an unknown spelling, a non-floating dtype, or a 64-bit one while
        ``jax_enable_x64`` is off (one line listing the accepted spellings).
    """
    if x is None:
        return None
    accepted = "use jnp.bfloat16, jnp.float16, jnp.float32 or one of " + ", ".join(repr(s) for s in SPELLINGS)
    if isinstance(x, str):
        if x.lower() not in SPELLINGS:
            raise ValueError(f"compute_dtype={x!r}: {accepted}")
        return jnp.dtype(SPELLINGS[x.lower()])
    try:
        dt = jnp.dtype(x)
    except TypeError:
        raise ValueError(f"compute_dtype={x!r} is not a dtype: {accepted}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"compute_dtype={dt}: use a floating dtype ({accepted})")
    if dt.itemsize > 4 and not jax.config.jax_enable_x64:  # JAX would compute it in float32, silently
        raise ValueError(f"compute_dtype={dt} needs jax.config.update('jax_enable_x64', True) (off: JAX computes "
                         f"in float32); or {accepted}")
    return dt


def params_compute_dtype(avals: dict):
    """The compute dtype of parameters ``avals`` (``{path: array or ShapeDtypeStruct}``) when none
    is given: their one floating dtype (float32 without floating leaves).

    Raises:
      ValueError: the floating leaves have several dtypes (one line naming a leaf of each and what
        each ``compute_dtype=`` choice then trains: the step computes in one dtype).
    """
    first: dict = {}
    for k, a in avals.items():
        if jnp.issubdtype(a.dtype, jnp.floating):
            first.setdefault(jnp.dtype(a.dtype).name, k)
    if len(first) > 1:
        names = sorted(first)
        raise ValueError(
            f"the parameters have dtypes {names} ({', '.join(f'{first[n]} is {n}' for n in names)}) and the step "
            "computes in one: pass compute_dtype=jnp.float32 (every leaf computed in float32, so the losses are "
            "those of this model with all its leaves float32) or jnp.bfloat16 (every leaf rounded to bfloat16); "
            "chunkjax.NnxOptimizer trains the model with each leaf in its own dtype")
    return jnp.dtype(next(iter(first), "float32"))
