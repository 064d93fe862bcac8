"""Step 1: chunkjax.offload vs plain nnx.Optimizer on TiedMoE, 20 steps, a budget forcing offload."""
import sys, numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
import chunkjax
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mymodel import TiedMoE, loss_fn, batches

data = batches(20)
tx = lambda: optax.adamw(3e-3, weight_decay=0.1)
budget = sys.argv[1] if len(sys.argv) > 1 else "min"

# reference: plain NNX loop (int Param excluded from wrt: optax cannot differentiate ints)
ref = TiedMoE(rngs=nnx.Rngs(0))
is_float_param = nnx.All(nnx.Param, lambda path, v: jnp.issubdtype(v.value.dtype, jnp.floating))
opt = nnx.Optimizer(ref, tx(), wrt=is_float_param)

@nnx.jit
def train_step(model, opt, batch):
    diff = nnx.DiffState(0, is_float_param)
    loss, g = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch)
    opt.update(model, g)
    return loss

ref_losses = [float(train_step(ref, opt, b)) for b in data]

model = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(model, tx(), loss_fn, data[0], device_budget=budget)
print(step.summary())
print(step.schedule.counts())
cj_losses = [float(step(b)) for b in data]
step.sync(model)
for i, (a, b) in enumerate(zip(ref_losses, cj_losses)):
    print(i, a, b, abs(a - b) / abs(a))
np.testing.assert_allclose(cj_losses, ref_losses, rtol=2e-5)
ra, ma = nnx.state(ref, nnx.Param), nnx.state(model, nnx.Param)
for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(ra), jax.tree_util.tree_leaves_with_path(ma)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-5, err_msg=str(p))
print("calls ref", ref.calls.value, "cj", model.calls.value)
assert int(ref.calls.value) == int(model.calls.value)
print("OK")
