"""Gradient accumulation over micro-batches (reported case 3): one update from the mean gradient
of ``micro_batches`` equal parts of a batch, the same update as the whole batch at once to the
compute dtype's rounding (optax's ``MultiSteps`` inside one step call).

A weighted loss (:mod:`chunkjax.loss_weight`): each part's gradient (its token mean over every
rank) times the part's weight ``W_i``, summed and multiplied by ``1 / sum(W_i)``: the gradient of
the whole batch's token mean (MaxText's gradient accumulation, which adds each micro-batch's
gradient times its ``total_weights``).
"""
from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import loss_weight as lw
from chunkjax.memory import DEVICE


def _times(g32, w):
    return g32 if w is None else g32 * w


#: Device gradients (the step's compute dtype): the float32 sum's first term and each further term
#: (``w``: the part's weight, () float32, or None for a plain loss), then :func:`_finish`.
_first = jax.jit(lambda g, w: _times(g.astype(jnp.float32), w))
_add = jax.jit(lambda a, g, w: a + _times(g.astype(jnp.float32), w), donate_argnums=(0,))


@functools.partial(jax.jit, static_argnums=(2,))
def _finish(a, inv, compute_dtype):
    """The mean ``a * inv`` (``inv``: () float32) in the compute dtype and its squared norm (as the
    programs compute it)."""
    g = (a * inv).astype(compute_dtype)
    return g, jnp.sum(jnp.square(g.astype(jnp.float32)))


def _np_weight(w) -> np.float32 | None:
    """A weight or factor on the device (or None) as a numpy float32 (a device sync on it)."""
    return None if w is None else np.float32(np.asarray(w))


#: Elements per block of :func:`mean_in_place` (its float32 scratch: 4 MiB).
MEAN_BLOCK = 1 << 20
#: Host threads of :class:`HostSums` (numpy releases the GIL in its adds: chunks sum in parallel).
SUM_THREADS = 4


def add_into(total, g, weight=None) -> np.ndarray:
    """``total += g`` in float32, in place (``total``: a float32 numpy chunk, or None for the first
    micro-batch: a new one); ``g``: a gradient chunk as numpy (any float dtype, cast element by
    element inside the add: no float32 copy of ``g`` is made). Bit-equal to
    ``total + g.astype(float32)``. ``weight`` (a weighted loss: the part's weight, numpy float32):
    ``total += g * weight``, bit-equal to ``total + g.astype(float32) * weight``, through a float32
    scratch of :data:`MEAN_BLOCK` elements. Returns ``total``."""
    if total is None:
        total = np.empty(g.shape, np.float32)
        np.copyto(total, g, casting="unsafe")
        return total if weight is None else np.multiply(total, weight, out=total)
    if weight is None:
        return np.add(total, g, out=total, casting="unsafe")
    flat, gf = total.reshape(-1), g.reshape(-1)
    tmp = np.empty(min(MEAN_BLOCK, flat.size), np.float32)
    for s in range(0, flat.size, MEAN_BLOCK):
        e = min(flat.size, s + MEAN_BLOCK)
        np.multiply(gf[s:e], weight, out=tmp[:e - s], casting="unsafe")
        np.add(flat[s:e], tmp[:e - s], out=flat[s:e])
    return total


def mean_in_place(total: np.ndarray, n: int, compute_dtype, inv=None) -> tuple[np.ndarray, np.float32]:
    """The mean ``total / n`` (``total * inv`` when ``inv``, a numpy float32, is given: a weighted
    loss's 1 / the batch's weight) rounded to ``compute_dtype``, written over the float32 sum's own bytes
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
    cd, inv = np.dtype(compute_dtype), np.float32(1.0 / n) if inv is None else np.float32(inv)
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
    what :func:`chunkjax.host_memory.schedule_host_need` counts. With weights (a weighted loss)
    each gradient is multiplied by its part's weight and the sum by ``inv``. Each :meth:`add` waits (as
    :meth:`chunkjax.updaters.HostWork.hand_over` does) until the one before it is summed, so the
    gradients of at most :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` hand-overs wait at once."""

    def __init__(self, n: int, compute_dtype, topology, threads: int = SUM_THREADS):
        self.n, self.cd, self.topology = n, np.dtype(compute_dtype), topology
        self.total: dict = {}
        self._last: dict = {}  # chunk -> its previous add's future (a chunk's adds run in order)
        self._previous: list = []  # the futures of the previous add call (the hand-over window)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="chunkjax-host-sums")

    def _add(self, c, g, last: bool, before, weight, inv):
        if before is not None:
            before.result()
        a = self.total[c] = add_into(self.total.get(c), self.topology.whole(g), _np_weight(weight))
        del g
        if not last:
            return None
        del self.total[c]
        return mean_in_place(a, self.n, self.cd, _np_weight(inv))

    def add(self, i: int, grads: dict, weight=None, inv=None) -> dict:
        """Hand over micro-batch ``i``'s gradients ``{c: gradient}``; returns ``{c: Future}``
        (after the previous call's gradients are summed). ``weight``: the part's weight (() float32
        on the device; None: a plain loss); ``inv`` (the last part of a weighted loss): 1 / the
        batch's weight."""
        out = {}
        for c, g in grads.items():
            out[c] = self._last[c] = self.pool.submit(self._add, c, g, i == self.n - 1, self._last.get(c), weight, inv)
        grads = None
        concurrent.futures.wait(self._previous)
        self._previous = list(out.values())
        return out

    def close(self) -> None:
        """Stop the threads once the work submitted is done (the futures stay readable)."""
        self.pool.shutdown(wait=False)
        self._last, self._previous = {}, []


def mean_gradients(step, state, batch, scale=None, on_host=None):
    """The mean gradients of ``step`` (a :class:`chunkjax.ChunkedStep`) over its ``passes``
    equal parts of ``batch`` (the global batch), their squared norms and the mean loss:
    ``({c: gradient}, {c: () f32}, () f32)``. A part is one micro-batch, or with
    ``micro_group`` G (in-program over groups) G consecutive micro-batches whose programs'
    gradient is already their mean (their factor ``1/G``, or a weighted loss's ``W_i / W_group``:
    :class:`chunkjax.walker.Walk`), so the mean over the parts is the batch's. Device gradients
    are summed in float32 on the device; gradients in pinned host memory in float32 numpy
    (host-updated chunks keep the numpy mean). Host memory: one float32 chunk per offloaded gradient, the mean written over it
    (:func:`mean_in_place`).

    A weighted loss (:class:`chunkjax.loss_weight.WeightedLoss`): the gradients are the parts'
    gradients weighted by their weights over the sum of the weights and the loss the batch's
    token mean (module docstring); a batch whose weights sum to 0 is refused before the last
    micro-batch hands any gradient on (no update has started).

    With ``on_host`` (one process): host-updated chunks' gradients are summed by :class:`HostSums`
    and, in the last micro-batch, ``on_host({c: Future})`` is called as each program ends, so
    their updates overlap that micro-batch's backward. Storage chunks' gradients (one process)
    are summed by :class:`HostSums` too, their means (numpy) returned for the storage workers.

    Raises:
      ValueError: a weighted loss whose batch scores no token (:data:`chunkjax.loss_weight.NO_SCORED_TOKENS`).
    """
    n = step.passes  # micro-batches, or in-program micro-batch groups (each pass: one group's mean)
    size = jax.tree.leaves(batch)[0].shape[0] // n
    host = set(step.host_chunks)
    disk = {c for c in range(step.layout.n_chunks) if step.location(c) == "storage"}  # their sums: HostSums too
    threaded = jax.process_count() == 1 and (on_host is not None or disk)
    sums = HostSums(n, step.compute_dtype, step.topology) if threaded else None
    futures: dict = {}
    weights: list = []  # per part seen, its weight over every rank (() f32 on the device); weighted losses only
    inv: list = []  # [1 / the batch's weight] once the last part's loss is seen

    def seen(i):
        def check(loss):
            loss = loss[0] if isinstance(loss, tuple) else loss
            if lw.is_weighted(loss):
                if i == n - 1:  # before the last part hands a gradient to an update
                    lw.require_weight(loss, float(sum(np.asarray(w) for w in weights)))
                    inv.append(lw.inverse_weight(sum(weights) + loss.weight))
                weights.append(loss.weight)
        return check

    def part_weight(i):  # (the part's weight, 1 / the batch's for the last part), or (None, None)
        return (weights[i], inv[0] if i == n - 1 else None) if weights else (None, None)

    def sink(i):
        def take(mine):
            f = sums.add(i, mine, *part_weight(i))
            futures.update(f)
            if i == n - 1:
                on_host(f)
        return take

    total, losses = {}, []
    try:
        for i in range(n):
            part = step.topology.put_batch(jax.tree.map(lambda a: a[i * size:(i + 1) * size], batch))
            grads, _, loss = step.run_programs(state, part, scale, None if on_host is None or sums is None else sink(i),
                                               on_loss=seen(i))
            losses.append(loss)
            if sums is not None and disk:
                futures.update(sums.add(i, {c: grads.pop(c) for c in disk if c in grads}, *part_weight(i)))
            w = part_weight(i)[0]
            for c, g in grads.items():
                if sums is not None and c in host:
                    continue
                if isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE):
                    total[c] = _first(g, w) if c not in total else _add(total[c], g, w)
                else:
                    total[c] = add_into(total.get(c), step.topology.whole(g), _np_weight(w))
            grads = g = None
    except BaseException:
        if sums is not None:  # nothing handed to an update yet: the sums' threads end
            sums.pool.shutdown(wait=False, cancel_futures=True)
        raise
    scale_dev = inv[0] if weights else jnp.float32(1.0 / n)
    grads, sq = {}, {}
    for c in list(total):
        a = total.pop(c)  # each sum freed once its mean is placed
        if isinstance(a, np.ndarray):
            g, q = mean_in_place(a, n, step.compute_dtype, _np_weight(inv[0]) if weights else None)
            sq[c] = jnp.asarray(q)
            grads[c] = g if c in host or c in disk else step.topology.put(g, step.topology.grad_sharding(
                step.placement.grad_kind(c)))
        else:
            grads[c], sq[c] = _finish(a, scale_dev, np.dtype(step.compute_dtype))
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
    if weights:
        return grads, sq, lw.token_mean(lw.combine(losses))
    return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))
