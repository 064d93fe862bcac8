"""Batches with a python scalar, a () array, a None leaf, a string."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(2)
def lf(model, batch):
    return loss_fn(model, batch["tokens"]) * batch["w"]
for name, w in [("python float", 1.0), ("() array", jnp.float32(1.0)), ("(B,) array", jnp.ones((8,), jnp.float32))]:
    try:
        step = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.adam(1e-3), lambda m, b: loss_fn(m, b["tokens"]) * jnp.mean(b["w"]),
                                {"tokens": data[0], "w": w}, device_budget="min")
        print(name, "->", float(step({"tokens": data[1], "w": w})))
    except Exception as e:
        print(name, "->", type(e).__name__, str(e)[:300])
