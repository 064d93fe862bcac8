"""The fit path's batch: its rows, one rank's micro-batch of it, and the step's training FLOPs.

:func:`chunkjax.fit.prepare` takes the step's batch as any pytree of arrays (or
``ShapeDtypeStruct`` s) whose leaves share the leading (row) axis, global over ranks;
:func:`batch_rows` checks that and gives the rows, :func:`rows_of` the abstract batch one rank
traces (its micro-batch), and :func:`step_flops` the whole step's training FLOPs for the cost model
(:mod:`chunkjax.cost`: the MFU and the compute time). Shapes only: nothing is allocated.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.flops import matmul_flops


def batch_rows(batch) -> int:
    """The rows of a batch: the leading size every leaf shares (arrays or ``ShapeDtypeStruct`` s).

    Raises:
      ValueError: no leaves, a single array that is not at least 2-D (tokens are (B, T+1)), a
        scalar leaf, or leaves with different leading sizes (one line each).
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("the batch has no arrays: pass tokens (B, T+1) or a pytree of arrays with the batch axis "
                         "first")
    if not isinstance(batch, (tuple, list, dict)) and len(leaves) == 1 and len(leaves[0].shape) < 2:
        raise ValueError(f"a batch of shape {tuple(leaves[0].shape)}: pass tokens as (B, T+1), or a dict/tuple of "
                         "arrays whose first axis is the batch")
    lead = {tuple(np.shape(a)[:1]) for a in leaves}
    if () in lead or len(lead) != 1:
        shapes = ", ".join(f"{jax.tree_util.keystr(p, simple=True, separator='/')!r} {tuple(np.shape(a))}"
                           for p, a in jax.tree_util.tree_leaves_with_path(batch))
        raise ValueError(f"batch leaves have shapes {shapes}: every leaf needs the batch axis first, of one size "
                         "(a per-batch scalar: an array of it repeated in every row)")
    return int(next(iter(lead))[0])


def rows_of(batch, rows: int):
    """``batch`` (``ShapeDtypeStruct`` s) with ``rows`` rows."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows,) + tuple(a.shape[1:]), a.dtype), batch)


def step_flops(loss_of, aparams, gbatch, tbatch, parts: int) -> float:
    """Training FLOPs of a whole step (all ranks): 6 x params x tokens for a token batch (one int
    (B, T+1) array), else 3 x the forward's matrix-product FLOPs counted in the traced loss on
    one rank's micro-batch (:func:`chunkjax.flops.matmul_flops`), times the ``parts`` (ranks x
    micro-batches)."""
    if not isinstance(gbatch, (tuple, list, dict)) and len(gbatch.shape) == 2 \
            and jnp.issubdtype(gbatch.dtype, jnp.integer):
        rows, t1 = gbatch.shape
        return 6.0 * sum(math.prod(a.shape) for a in jax.tree.leaves(aparams)) * rows * (t1 - 1)
    return 3.0 * matmul_flops(jax.make_jaxpr(loss_of)(aparams, tbatch)) * parts
