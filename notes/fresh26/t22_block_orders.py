"""Blocks called in an unusual order or with long skip connections: reversed, U-Net skips,
every other block, heterogeneous widths. offload vs nnx.Optimizer."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax


class B(nnx.Module):
    def __init__(self, d, h, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class M(nnx.Module):
    def __init__(self, mode, rngs):
        self.mode = mode
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        hs = [16, 64, 32, 48, 24, 40] if mode == "hetero" else [48] * 6
        self.blocks = nnx.List([B(32, h, rngs) for h in hs])
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, t):
        x = self.embed(t)
        bl = list(self.blocks)
        if self.mode == "reversed":
            for b in reversed(bl):
                x = b(x)
        elif self.mode == "unet":
            saved = []
            for b in bl[:3]:
                x = b(x); saved.append(x)
            for b in bl[3:]:
                x = b(x) + saved.pop()
        elif self.mode == "skip":
            for b in bl[::2]:
                x = b(x)
        else:
            for b in bl:
                x = b(x)
        return self.head(x)


mode = sys.argv[1]
data = batches(10)
ref, ref_losses = reference(optax.adam(3e-3), data, M(mode, nnx.Rngs(0)))
m = M(mode, nnx.Rngs(0))
try:
    step = chunkjax.offload(m, optax.adam(3e-3), loss_fn, data[0], device_budget="min")
except Exception as e:
    print(mode, "refused:", type(e).__name__, str(e)[:300]); sys.exit()
print(mode, step.summary()[:120])
cj = [float(step(b)) for b in data]
step.sync(m)
d = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, cj))
print(mode, "max rel loss diff", d)
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print(mode, "max param diff", compare_params(ref, m))
print(mode, "OK")
