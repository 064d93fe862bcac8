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


#: Elements per block of :func:`mean_in_place` (its float32 scratch: 4 MiB).
MEAN_BLOCK = 1 << 20
#: Host threads of :class:`HostSums` (numpy releases the GIL in its adds: chunks sum in parallel).
SUM_THREADS = 4


def add_into(total, g) -> np.ndarray:
    """``total += g`` in float32, in place (``total``: a float32 numpy chunk, or None for the first
    micro-batch: a new one); ``g``: a gradient chunk as numpy (any float dtype, cast element by
    element inside the add: no float32 copy of ``g`` is made). Bit-equal to
    ``total + g.astype(float32)``. Returns ``total``."""
    if total is None:
        total = np.empty(g.shape, np.float32)
        np.copyto(total, g, casting="unsafe")
        return total
    return np.add(total, g, out=total, casting="unsafe")


def mean_in_place(total: np.ndarray, n: int, compute_dtype) -> tuple[np.ndarray, np.float32]:
    """The mean ``total / n`` rounded to ``compute_dtype``, written over the float32 sum's own bytes
    (block by block; block k's output ends before block k+1's input begins), and its squared norm
    in float32: ``(mean, sq)``. ``mean`` is a contiguous view of ``total``'s buffer (``total``'s
    values are gone): the mean costs no host bytes beyond the sum's. Bit-equal, element by
    element, to ``(total * float32(1 / n)).astype(compute_dtype)``; ``sq`` sums float32 squares
    block by block (as the step's float32 norms, not bit-equal to one ``np.sum``).

    Args:
      total: float32 numpy array, contiguous (the micro-batch sum of one chunk).
      n: micro-batches (> 0).
      compute_dtype: the mean's dtype, at most 4 bytes per element.
    """
    cd, inv = np.dtype(compute_dtype), np.float32(1.0 / n)
    flat = total.reshape(-1)
    out = flat.view(cd)[:flat.size]
    sq, tmp = np.float32(0.0), np.empty(min(MEAN_BLOCK, flat.size), np.float32)
    for s in range(0, flat.size, MEAN_BLOCK):
        e = min(flat.size, s + MEAN_BLOCK)
        t = tmp[:e - s]
        np.multiply(flat[s:e], inv, out=t)
        out[s:e] = t  # rounds to the compute dtype; writes bytes [s, e) * itemsize, read already
        np.copyto(t, out[s:e], casting="unsafe")  # the rounded values, as float32
        sq = np.float32(sq + np.dot(t, t))
    return out.reshape(total.shape), sq


class HostSums:
    """Sums micro-batch gradients of chunks updated in host memory (host-updated chunks; with the
    disk tier also storage chunks) in float32 on host threads of their own (:data:`SUM_THREADS`),
    so the device runs on while they are summed. :meth:`add` of the last micro-batch returns, per
    chunk, a Future of ``(mean gradient in the compute dtype as numpy, its squared norm as a
    float32)``; the host updates of :mod:`chunkjax.speculate` and the storage workers take those.

    Host memory (issue 24 item 1): one float32 chunk per summed chunk (:func:`add_into`: the
    micro-batch's gradient is cast inside the add, no float32 copy of it), and the mean is
    written over the sum's own bytes (:func:`mean_in_place`): the same 4 bytes per parameter,
    what :func:`chunkjax.host_memory.schedule_host_need` counts. Each :meth:`add` waits (as
    :meth:`chunkjax.updaters.HostWork.hand_over` does) until the one before it is summed, so the
    gradients of at most :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` hand-overs wait at once."""

    def __init__(self, n: int, compute_dtype, topology, threads: int = SUM_THREADS):
        self.n, self.cd, self.topology = n, np.dtype(compute_dtype), topology
        self.total: dict = {}
        self._last: dict = {}  # chunk -> its previous add's future (a chunk's adds run in order)
        self._previous: list = []  # the futures of the previous add call (the hand-over window)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="chunkjax-host-sums")

    def _add(self, c, g, last: bool, before):
        if before is not None:
            before.result()
        a = self.total[c] = add_into(self.total.get(c), self.topology.whole(g))
        del g
        if not last:
            return None
        del self.total[c]
        return mean_in_place(a, self.n, self.cd)

    def add(self, i: int, grads: dict) -> dict:
        """Hand over micro-batch ``i``'s gradients ``{c: gradient}``; returns ``{c: Future}``
        (after the previous call's gradients are summed)."""
        out = {}
        for c, g in grads.items():
            out[c] = self._last[c] = self.pool.submit(self._add, c, g, i == self.n - 1, self._last.get(c))
        grads = None
        concurrent.futures.wait(self._previous)
        self._previous = list(out.values())
        return out

    def close(self) -> None:
        """Stop the threads once the work submitted is done (the futures stay readable)."""
        self.pool.shutdown(wait=False)
        self._last, self._previous = {}, []


def mean_gradients(step, state, batch, scale=None, on_host=None):
    """The mean gradients of ``step`` (a :class:`chunkjax.ChunkedStep`) over its
    ``micro_batches`` equal parts of ``batch`` (the global batch), their squared norms and the
    mean loss: ``({c: gradient}, {c: () f32}, () f32)``. Device gradients are summed in float32 on
    the device; gradients in pinned host memory in float32 numpy (host-updated chunks keep the
    numpy mean). Host memory: one float32 chunk per offloaded gradient, the mean written over it
    (:func:`mean_in_place`).

    With ``on_host`` (one process): host-updated chunks' gradients are summed by :class:`HostSums`
    and, in the last micro-batch, ``on_host({c: Future})`` is called as each program ends, so
    their updates overlap that micro-batch's backward. Storage chunks' gradients (one process)
    are summed by :class:`HostSums` too, their means (numpy) returned for the storage workers."""
    n = step.micro_batches
    size = jax.tree.leaves(batch)[0].shape[0] // n
    first, add, finish = step.jit_accumulate
    host = set(step.host_chunks)
    disk = {c for c in range(step.layout.n_chunks) if step.location(c) == "storage"}  # their sums: HostSums too
    threaded = jax.process_count() == 1 and (on_host is not None or disk)
    sums = HostSums(n, step.compute_dtype, step.topology) if threaded else None
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
        grads, _, loss = step.run_programs(state, part, scale, None if on_host is None or sums is None else sink(i))
        losses.append(loss)
        if sums is not None and disk:
            futures.update(sums.add(i, {c: grads.pop(c) for c in disk if c in grads}))
        for c, g in grads.items():
            if sums is not None and c in host:
                continue
            if isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE):
                total[c] = first(g) if c not in total else add(total[c], g)
            else:
                total[c] = add_into(total.get(c), step.topology.whole(g))
        grads = g = None
    grads, sq = {}, {}
    for c in list(total):
        a = total.pop(c)  # each sum freed once its mean is placed
        if isinstance(a, np.ndarray):
            g, q = mean_in_place(a, n, step.compute_dtype)
            sq[c] = jnp.asarray(q)
            grads[c] = g if c in host or c in disk else step.topology.put(g, step.topology.grad_sharding(
                step.placement.grad_kind(c)))
        else:
            grads[c], sq[c] = finish(a, jnp.float32(1.0 / n))
    if sums is not None:
        sums.close()
        for c, f in futures.items():  # a host chunk's mean is the host thread's alone (dropped once consumed)
            g, q = f.result()
            sq[c] = jnp.asarray(q)
            if c in disk:  # the storage workers' (StorageRun.send)
                grads[c] = g
        g = None
    elif on_host is not None:
        on_host({c: grads[c] for c in host})
    return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))
