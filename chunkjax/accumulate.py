"""Gradient accumulation over micro-batches (reported case 3): one update from the mean gradient
of ``micro_batches`` equal parts of a batch, the same update as the whole batch at once to the
compute dtype's rounding (optax's ``MultiSteps`` inside one step call).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.memory import DEVICE


def jit_sums(compute_dtype):
    """(first, add, finish) for device gradients: float32 sums, then the mean in the compute
    dtype and its squared norm (as the programs compute it)."""
    first = jax.jit(lambda g: g.astype(jnp.float32))
    add = jax.jit(lambda a, g: a + g.astype(jnp.float32), donate_argnums=(0,))

    def finish(a, inv):
        g = (a * inv).astype(compute_dtype)
        return g, jnp.sum(jnp.square(g.astype(jnp.float32)))

    return first, add, jax.jit(finish)


def mean_gradients(step, state, batch, scale=None):
    """The mean gradients of ``step`` (a :class:`chunkjax.ChunkedStep`) over its
    ``micro_batches`` equal parts of ``batch`` (the global batch), their squared norms and the
    mean loss: ``({c: gradient}, {c: () f32}, () f32)``. Device gradients are summed in float32 on
    the device; gradients in pinned host memory in float32 numpy (host-updated chunks keep the
    numpy mean). Host memory: one float32 chunk per offloaded gradient."""
    n = step.micro_batches
    size = jax.tree.leaves(batch)[0].shape[0] // n
    first, add, finish = step._jit_accumulate
    total, losses = {}, []
    for i in range(n):
        part = step.topology.put_batch(jax.tree.map(lambda a: a[i * size:(i + 1) * size], batch))
        grads, _, loss = step._run_programs(state, part, scale, None)
        losses.append(loss)
        for c, g in grads.items():
            if isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE):
                total[c] = first(g) if c not in total else add(total[c], g)
            else:
                g32 = step.topology.whole(g).astype(np.float32)
                total[c] = g32 if c not in total else np.add(total[c], g32, out=total[c])
    host = set(step.host_chunks)
    cd = np.dtype(step.compute_dtype)
    grads, sq = {}, {}
    for c, a in total.items():
        if isinstance(a, np.ndarray):
            g = (a * np.float32(1.0 / n)).astype(cd)
            sq[c] = jnp.asarray(np.sum(np.square(g.astype(np.float32)), dtype=np.float32))
            grads[c] = g if c in host else step.topology.put(g, step.topology.grad_sharding(
                step.placement.grad_kind(c)))
        else:
            grads[c], sq[c] = finish(a, jnp.float32(1.0 / n))
    return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))
