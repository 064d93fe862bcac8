"""A trainable complex64 parameter (a learnable complex phase on the logits): plain nnx.Optimizer
trains it; chunkjax.offload silently freezes it (the losses drift apart, no message)."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax


class M(TiedMoE):
    def __init__(self, rngs):
        super().__init__(rngs=rngs, count=False)
        self.z = nnx.Param(jnp.full((64,), 0.5 + 0.5j, jnp.complex64))

    def __call__(self, t):
        return super().__call__(t) * jnp.abs(self.z[...])   # per-vocab gain |z|


data = batches(10)
wrt = nnx.All(nnx.Param, lambda p, v: not jnp.issubdtype(v[...].dtype, jnp.integer))
ref = M(nnx.Rngs(0))
opt = nnx.Optimizer(ref, optax.adam(3e-2), wrt=wrt)
@nnx.jit
def ts(model, opt, b):
    l, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, b)
    opt.update(model, g)
    return l
ref_losses = [float(ts(ref, opt, b)) for b in data]
m = M(nnx.Rngs(0))
z0 = np.asarray(m.z[...]).copy()
step = chunkjax.offload(m, optax.adam(3e-2), loss_fn, data[0], device_budget="min")
print(step.schedule.counts())
cj = [float(step(b)) for b in data]
step.sync(m)
print("ref z moved", float(np.abs(np.asarray(ref.z[...]) - z0).max()), "chunkjax z moved", float(np.abs(np.asarray(m.z[...]) - z0).max()))
print("losses ref", ref_losses[-3:], "chunkjax", cj[-3:])
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
