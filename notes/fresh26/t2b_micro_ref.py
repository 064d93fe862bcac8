"""Is the mb=2 param difference summation order? Reference that averages 2 micro-batch grads."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

data = batches(20, B=8)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)
ref = TiedMoE(rngs=nnx.Rngs(0), count=False)
opt = nnx.Optimizer(ref, spec.optax(), wrt=is_float_param)
@nnx.jit
def train_step(model, opt, batch):
    diff = nnx.DiffState(0, is_float_param)
    l1, g1 = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch[:4])
    l2, g2 = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch[4:])
    g = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    opt.update(model, g)
    return (l1 + l2) / 2
ref_losses = [float(train_step(ref, opt, b)) for b in data]
model = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(model, spec, loss_fn, data[0], device_budget="min", micro_batches=2)
cj = [float(step(b)) for b in data]
step.sync(model)
print(max(abs(a - b) / abs(a) for a, b in zip(ref_losses, cj)))
ra, ma = nnx.state(ref, nnx.Param), nnx.state(model, nnx.Param)
for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(ra), jax.tree_util.tree_leaves_with_path(ma)):
    print(jax.tree_util.keystr(p), float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))))
