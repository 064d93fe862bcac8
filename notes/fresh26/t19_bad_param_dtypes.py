"""Params of odd dtypes: complex64, bool, uint8, float16 among float32, an empty (0,) leaf."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(3)

class M(TiedMoE):
    def __init__(self, extra, rngs):
        super().__init__(rngs=rngs, count=False)
        self.extra = nnx.Param(extra)
    def __call__(self, t):
        out = super().__call__(t)
        e = self.extra[...]
        if e.size:
            out = out + 0.0 * jnp.real(jnp.sum(e.astype(jnp.complex64))).astype(out.dtype)
        return out

for name, val in [("complex64", jnp.ones((4,), jnp.complex64)), ("bool", jnp.ones((4,), bool)),
                  ("uint8", jnp.ones((4,), jnp.uint8)), ("float16", jnp.ones((4,), jnp.float16)),
                  ("empty", jnp.zeros((0,), jnp.float32)), ("empty2d", jnp.zeros((3, 0), jnp.float32))]:
    try:
        m = M(val, nnx.Rngs(0))
        step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min")
        l = [float(step(b)) for b in data]
        step.sync(m)
        print(name, "-> ran", l[-1], "extra now", m.extra[...])
    except Exception as e:
        print(name, "->", type(e).__name__, str(e)[:300])
