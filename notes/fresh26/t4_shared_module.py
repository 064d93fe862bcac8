"""A module instance shared by every block (ALBERT-style weight sharing inside a block list)
plus a per-block bias: offload vs nnx.Optimizer."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax


class Block(nnx.Module):
    def __init__(self, shared, d, rngs):
        self.shared = shared                      # the same nnx.Linear object in every block
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.own = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.own(self.shared(self.norm(x))))


class Albert(nnx.Module):
    def __init__(self, vocab=64, d=32, n=4, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        shared = nnx.Linear(d, d, rngs=rngs)
        self.blocks = nnx.List([Block(shared, d, rngs) for _ in range(n)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, t):
        x = self.embed(t)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


data = batches(20)
tx = lambda: optax.adamw(3e-3)
ref, ref_losses = reference(tx(), data, Albert(rngs=nnx.Rngs(0)))
model = Albert(rngs=nnx.Rngs(0))
step = chunkjax.offload(model, tx(), loss_fn, data[0], device_budget=sys.argv[1] if len(sys.argv) > 1 else "min")
print(step.summary())
cj = [float(step(b)) for b in data]
step.sync(model)
for i, (a, b) in enumerate(zip(ref_losses, cj)):
    print(i, a, b, abs(a - b) / abs(a))
assert model.blocks[0].shared is model.blocks[3].shared
print("max param diff", compare_params(ref, model))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("OK")
