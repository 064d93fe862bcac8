"""MoE blocks returning (x, aux) with a load-balancing aux loss summed over blocks; and a block list
called twice per forward (universal-transformer style). offload vs nnx.Optimizer."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from mymodel import MoEBlock


class AuxBlock(MoEBlock):
    def __call__(self, x, aux):
        y = self.norm(x)
        gate = jax.nn.softmax(self.router(y), axis=-1)
        hid = jax.nn.gelu(jnp.einsum("btd,edh->bteh", y, self.w_in))
        out = jnp.einsum("bteh,ehd->bted", hid, self.w_out)
        load = gate.mean(axis=(0, 1))
        return x + jnp.einsum("bte,bted->btd", gate, out), aux + (load * load).sum() * gate.shape[-1]


class M(nnx.Module):
    def __init__(self, twice, rngs):
        self.twice = twice
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.blocks = nnx.List([AuxBlock(32, 48, 4, rngs) for _ in range(3)])
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, t):
        x, aux = self.embed(t), jnp.zeros(())
        for _ in range(2 if self.twice else 1):
            for b in self.blocks:
                x, aux = b(x, aux)
        return self.head(x), aux


def lf(model, batch):
    logits, aux = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean() + 0.1 * aux


twice = "twice" in sys.argv
data = batches(20)
ref, ref_losses = reference(optax.adam(3e-3), data, M(twice, nnx.Rngs(0)), loss=lf)
m = M(twice, nnx.Rngs(0))
step = chunkjax.offload(m, optax.adam(3e-3), lf, data[0], device_budget="min")
print(step.summary()[:200])
cj = [float(step(b)) for b in data]
step.sync(m)
for i, (a, b) in enumerate(zip(ref_losses, cj)):
    print(i, a, b, abs(a - b) / abs(a))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("max param diff", compare_params(ref, m))
print("OK")
