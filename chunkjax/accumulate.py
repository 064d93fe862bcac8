"""Gradient accumulation over micro-batches (reported case 3): one update from the mean gradient
of ``micro_batches`` equal parts of a batch, the same update as the whole batch at once to the
compute dtype's rounding (optax's ``MultiSteps`` inside one step call).

A plain loss: the mean of the parts' gradients. A weighted loss (:mod:`chunkjax.loss_weight`):
each part's gradient (its token mean over every rank) times the part's weight ``W_i``, summed and
multiplied by ``1 / sum(W_i)``: the gradient of the whole batch's token mean (MaxText's gradient
accumulation, which adds each micro-batch's gradient times its ``total_weights``).
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


#: Device gradients: the float32 sum's first term and each further term (``w``: the part's
#: weight, () float32, or None for a plain loss), then :func:`_finish`.
_first = jax.jit(lambda g, w: _times(g.astype(jnp.float32), w))
_add = jax.jit(lambda a, g, w: a + _times(g.astype(jnp.float32), w), donate_argnums=(0,))


@functools.partial(jax.jit, static_argnums=(2,))
def _finish(a, inv, compute_dtype):
    """The mean ``a * inv`` in the compute dtype and its squared norm (as the programs compute it)."""
    g = (a * inv).astype(compute_dtype)
    return g, jnp.sum(jnp.square(g.astype(jnp.float32)))


def _np_weight(w) -> np.float32 | None:
    return None if w is None else np.float32(np.asarray(w))


class HostSums:
    """Sums host-updated chunks' micro-batch gradients in float32 on a host thread of its own, so
    the device runs on while they are summed. :meth:`add` of the last micro-batch returns, per
    chunk, a Future of ``(mean gradient in the compute dtype as numpy, its squared norm as a
    float32)``; the host updates of :mod:`chunkjax.speculate` take those futures. With weights
    (a weighted loss) each gradient is multiplied by its part's weight and the sum by ``inv``.

    Host memory: one float32 chunk per host-updated chunk."""

    def __init__(self, n: int, compute_dtype, topology):
        self.n, self.cd, self.topology = n, np.dtype(compute_dtype), topology
        self.total: dict = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chunkjax-host-sums")

    def _add(self, c, g, last: bool, weight, inv):
        g32 = self.topology.whole(g).astype(np.float32)
        if weight is not None:
            g32 *= _np_weight(weight)
        a = self.total[c] = g32 if c not in self.total else np.add(self.total[c], g32, out=self.total[c])
        if not last:
            return None
        del self.total[c]
        mean = (a * (np.float32(1.0 / self.n) if inv is None else _np_weight(inv))).astype(self.cd)
        return mean, np.sum(np.square(mean.astype(np.float32)), dtype=np.float32)

    def add(self, i: int, grads: dict, weight=None, inv=None) -> dict:
        """Hand over micro-batch ``i``'s gradients ``{c: gradient}``; returns ``{c: Future}``.
        ``weight``: the part's weight (() float32, on the device; None: a plain loss); ``inv``
        (last part, weighted loss): 1 / the batch's weight."""
        return {c: self.pool.submit(self._add, c, g, i == self.n - 1, weight, inv) for c, g in grads.items()}


def mean_gradients(step, state, batch, scale=None, on_host=None):
    """The mean gradients of ``step`` (a :class:`chunkjax.ChunkedStep`) over its
    ``micro_batches`` equal parts of ``batch`` (the global batch), their squared norms and the
    mean loss: ``({c: gradient}, {c: () f32}, () f32)``. Device gradients are summed in float32 on
    the device; gradients in pinned host memory in float32 numpy (host-updated chunks keep the
    numpy mean). Host memory: one float32 chunk per offloaded gradient.

    A weighted loss (:class:`chunkjax.loss_weight.WeightedLoss`): the gradients are the parts'
    gradients weighted by their weights over the sum of the weights and the loss the batch's
    token mean (module docstring); a batch whose weights sum to 0 is refused before the last
    micro-batch hands any gradient on (no update has started).

    With ``on_host`` (one process): host-updated chunks' gradients are summed by :class:`HostSums`
    and, in the last micro-batch, ``on_host({c: Future})`` is called as each program ends, so
    their updates overlap that micro-batch's backward.

    Raises:
      ValueError: a weighted loss whose batch scores no token (:data:`chunkjax.loss_weight.NO_SCORED_TOKENS`).
    """
    n = step.micro_batches
    size = jax.tree.leaves(batch)[0].shape[0] // n
    host = set(step.host_chunks)
    sums = HostSums(n, step.compute_dtype, step.topology) if on_host is not None and jax.process_count() == 1 else None
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

    def sink(i):
        def take(mine):
            w = weights[i] if weights else None
            f = sums.add(i, mine, w, inv[0] if w is not None and i == n - 1 else None)
            futures.update(f)
            if i == n - 1:
                on_host(f)
        return take

    total, losses = {}, []
    try:
        for i in range(n):
            part = step.topology.put_batch(jax.tree.map(lambda a: a[i * size:(i + 1) * size], batch))
            grads, _, loss = step.run_programs(state, part, scale, None if sums is None else sink(i), on_loss=seen(i))
            losses.append(loss)
            w = weights[i] if weights else None
            for c, g in grads.items():
                if sums is not None and c in host:
                    continue
                if isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE):
                    total[c] = _first(g, w) if c not in total else _add(total[c], g, w)
                else:
                    g32 = step.topology.whole(g).astype(np.float32)
                    if w is not None:
                        g32 *= _np_weight(w)
                    total[c] = g32 if c not in total else np.add(total[c], g32, out=total[c])
    except BaseException:
        if sums is not None:  # nothing handed to an update yet: the sums' thread ends
            sums.pool.shutdown(wait=False, cancel_futures=True)
        raise
    inv_dev = inv[0] if weights else jnp.float32(1.0 / n)
    cd = np.dtype(step.compute_dtype)
    grads, sq = {}, {}
    for c, a in total.items():
        if isinstance(a, np.ndarray):
            g = (a * (_np_weight(inv_dev) if weights else np.float32(1.0 / n))).astype(cd)
            sq[c] = jnp.asarray(np.sum(np.square(g.astype(np.float32)), dtype=np.float32))
            grads[c] = g if c in host else step.topology.put(g, step.topology.grad_sharding(
                step.placement.grad_kind(c)))
        else:
            grads[c], sq[c] = _finish(a, inv_dev, cd)
    if sums is not None:
        sums.pool.shutdown(wait=False)
        for c, f in futures.items():  # the mean gradient is the host thread's alone (dropped once consumed)
            sq[c] = jnp.asarray(f.result()[1])
    elif on_host is not None:
        on_host({c: grads[c] for c in host})
    if weights:
        return grads, sq, lw.token_mean(lw.combine(losses))
    return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))
