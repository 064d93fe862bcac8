"""The plain-optax reference of the chunked step's equality tests (fp32, on the device): per
batch, the gradient is the float32 mean of ``micro_batches`` equal parts' gradients, summed in
order (as optax's ``MultiSteps`` inside one step), then ``tx`` updates the params.

The loss and gradient program (the expensive compile: the whole model's forward and backward,
with several micro-batches one ``jax.lax.scan`` over them, the sum its carry: one forward and
backward to trace and compile, not one per micro-batch) is jitted once per (config, micro-batches,
compute dtype) for the test process and shared by every reference run and test file that asks
(only the small optax update is compiled per transformation)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import gpt

_GRADS = {}


def mean_grads(cfg, micro_batches=1, compute_dtype=jnp.float32):
    """The jitted ``(params, batch) -> (mean loss, mean gradient, its global norm)`` of the GPT
    ``cfg``: the batch split into ``micro_batches`` equal parts (rows), their float32 gradients
    summed in order and scaled by ``1 / micro_batches``; one per (cfg, micro_batches, dtype)."""
    key = (cfg, micro_batches, jnp.dtype(compute_dtype).name)
    if key not in _GRADS:
        def grads_of(p, b):
            return jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, b, compute_dtype))(p)

        @jax.jit
        def grads(p, b):
            if micro_batches == 1:
                l, total = grads_of(p, b)
            else:  # the parts in order (jnp.split's rows), each gradient added to the float32 sum
                def body(acc, x):
                    l, g = grads_of(p, x)
                    return jax.tree.map(jnp.add, acc, g), l

                parts = b.reshape((micro_batches, b.shape[0] // micro_batches) + b.shape[1:])
                zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p)
                total, ls = jax.lax.scan(body, zeros, parts)
                l = jnp.mean(ls)
            g = jax.tree.map(lambda a: a * jnp.float32(1.0 / micro_batches), total)
            return l, g, optax.tree.norm(g)

        _GRADS[key] = grads
    return _GRADS[key]


def micro_batch_reference(cfg, params, batches, tx, micro_batches=1, rows=None, compute_dtype=jnp.float32):
    """Train ``params`` of the GPT ``cfg`` with ``tx`` on ``batches``; with one micro-batch and
    ``rows`` given, each batch's first ``rows`` rows only. Returns (final params, losses (steps,),
    global gradient norms (steps,)) as numpy arrays."""
    grads = mean_grads(cfg, micro_batches, compute_dtype)

    @jax.jit
    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    p, o, losses, norms = params, tx.init(params), [], []
    for b in batches:
        l, g, n = grads(p, b if micro_batches > 1 or rows is None else b[:rows])
        p, o = update(p, o, g)
        losses.append(float(l))
        norms.append(float(n))
    return p, np.asarray(losses), np.asarray(norms)
