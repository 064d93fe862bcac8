"""The plain-optax reference of the chunked step's equality tests (fp32, on the device): one
jitted step per batch whose gradient is the float32 mean of ``micro_batches`` equal parts'
gradients, summed in order (as optax's ``MultiSteps`` inside one step)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import gpt


def micro_batch_reference(cfg, params, batches, tx, micro_batches=1, rows=None):
    """Train ``params`` of the GPT ``cfg`` with ``tx`` on ``batches``; with one micro-batch and
    ``rows`` given, each batch's first ``rows`` rows only. Returns (final params, losses (steps,),
    global gradient norms (steps,)) as numpy arrays."""
    def grads_of(p, b):
        return jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, b, jnp.float32))(p)

    @jax.jit
    def step(p, o, b):
        ls, gs = zip(*[grads_of(p, x) for x in jnp.split(b, micro_batches)])
        total = gs[0]
        for g in gs[1:]:
            total = jax.tree.map(jnp.add, total, g)
        g = jax.tree.map(lambda a: a * jnp.float32(1.0 / micro_batches), total)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, jnp.mean(jnp.stack(ls)), optax.tree.norm(g)

    p, o, losses, norms = params, tx.init(params), [], []
    for b in batches:
        p, o, l, n = step(p, o, b if micro_batches > 1 or rows is None else b[:rows])
        losses.append(float(l))
        norms.append(float(n))
    return p, np.asarray(losses), np.asarray(norms)
