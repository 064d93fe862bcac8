"""Does step.evaluate advance the loss's non-parameter state (my counter)? and a budget so large
nothing is offloaded."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(4)
m = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min")
step(data[0]); step.evaluate(data[1]); step.evaluate(data[2]); step(data[3])
step.sync(m)
print("counter after 2 steps + 2 evaluates:", int(m.calls[...]))
m2 = TiedMoE(rngs=nnx.Rngs(0))
big = chunkjax.offload(m2, optax.adam(1e-3), loss_fn, data[0], device_budget="8GiB")
print(big.summary()[:300], "released", big.released_bytes)
l = [float(big(b)) for b in data]
print("model usable without sync:", float(loss_fn(m2, data[0])))
