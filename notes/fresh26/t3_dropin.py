"""NnxOptimizer drop-in on TiedMoE (with an int Param) vs nnx.Optimizer; clipping chain; 20 steps."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

data = batches(20)
mk_tx = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, weight_decay=0.1))
ref, ref_losses = reference(mk_tx(), data)

model = TiedMoE(rngs=nnx.Rngs(0))
wrt = nnx.All(nnx.Param, lambda path, x: jnp.issubdtype(x.dtype, jnp.floating)) if "filter" in sys.argv else nnx.Param
optimizer = chunkjax.NnxOptimizer(model, mk_tx(), wrt=wrt, device_budget=sys.argv[1] if len(sys.argv) > 1 else "64KiB")

@nnx.jit
def train_step(model, batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch)
    return loss, grads

cj = []
for b in data:
    loss, grads = train_step(model, b)
    optimizer.update(model, grads)
    cj.append(float(loss))
optimizer.wait()
print(optimizer.chunked.last_update)
for i, (a, b) in enumerate(zip(ref_losses, cj)):
    print(i, a, b, abs(a - b) / abs(a))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("max param diff", compare_params(ref, model))
print("temp", model.temp[...], "pos", model.pos[...][:4])
print("OK")
