"""Gradient accumulation over micro-batches (reported case 3): one update from the mean gradient
of ``micro_batches`` equal parts of a batch, the same update as the whole batch at once to the
compute dtype's rounding (optax's ``MultiSteps`` inside one step call).
"""
from __future__ import annotations

import concurrent.futures

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


class HostSums:
    """Sums host-updated chunks' micro-batch gradients in float32 on a host thread of its own, so
    the device runs on while they are summed. :meth:`add` of the last micro-batch returns, per
    chunk, a Future of ``(mean gradient in the compute dtype as numpy, its squared norm as a
    float32)``; the host updates of :mod:`chunkjax.speculate` take those futures.

    Host memory: one float32 chunk per host-updated chunk."""

    def __init__(self, n: int, compute_dtype, topology):
        self.n, self.cd, self.topology = n, np.dtype(compute_dtype), topology
        self.total: dict = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chunkjax-host-sums")

    def _add(self, c, g, last: bool):
        g32 = self.topology.whole(g).astype(np.float32)
        a = self.total[c] = g32 if c not in self.total else np.add(self.total[c], g32, out=self.total[c])
        if not last:
            return None
        del self.total[c]
        mean = (a * np.float32(1.0 / self.n)).astype(self.cd)
        return mean, np.sum(np.square(mean.astype(np.float32)), dtype=np.float32)

    def add(self, i: int, grads: dict) -> dict:
        """Hand over micro-batch ``i``'s gradients ``{c: gradient}``; returns ``{c: Future}``."""
        return {c: self.pool.submit(self._add, c, g, i == self.n - 1) for c, g in grads.items()}


def mean_gradients(step, state, batch, scale=None, on_host=None):
    """The mean gradients of ``step`` (a :class:`chunkjax.ChunkedStep`) over its
    ``micro_batches`` equal parts of ``batch`` (the global batch), their squared norms and the
    mean loss: ``({c: gradient}, {c: () f32}, () f32)``. Device gradients are summed in float32 on
    the device; gradients in pinned host memory in float32 numpy (host-updated chunks keep the
    numpy mean). Host memory: one float32 chunk per offloaded gradient.

    With ``on_host`` (one process): host-updated chunks' gradients are summed by :class:`HostSums`
    and, in the last micro-batch, ``on_host({c: Future})`` is called as each program ends, so
    their updates overlap that micro-batch's backward."""
    n = step.micro_batches
    size = jax.tree.leaves(batch)[0].shape[0] // n
    first, add, finish = step.jit_accumulate
    host = set(step.host_chunks)
    sums = HostSums(n, step.compute_dtype, step.topology) if on_host is not None and jax.process_count() == 1 else None
    futures: dict = {}

    def sink(i):
        def take(mine):
            f = sums.add(i, mine)
            futures.update(f)
            if i == n - 1:
                on_host(f)
        return take

    total, losses = {}, []
    for i in range(n):
        part = step.topology.put_batch(jax.tree.map(lambda a: a[i * size:(i + 1) * size], batch))
        grads, _, loss = step.run_programs(state, part, scale, None if sums is None else sink(i))
        losses.append(loss)
        for c, g in grads.items():
            if sums is not None and c in host:
                continue
            if isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE):
                total[c] = first(g) if c not in total else add(total[c], g)
            else:
                g32 = step.topology.whole(g).astype(np.float32)
                total[c] = g32 if c not in total else np.add(total[c], g32, out=total[c])
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
    if sums is not None:
        sums.pool.shutdown(wait=False)
        for c, f in futures.items():  # the mean gradient is the host thread's alone (dropped once consumed)
            sq[c] = jnp.asarray(f.result()[1])
    elif on_host is not None:
        on_host({c: grads[c] for c in host})
    return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))
