"""Is ZeRO's 2e-5 parameter difference summation order? Reference: the mean of 8 shards' gradient means."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW
data = batches(12, B=16)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)
ref = TiedMoE(rngs=nnx.Rngs(0), count=False)
opt = nnx.Optimizer(ref, spec.optax(), wrt=is_float_param)
@nnx.jit
def ts(model, opt, batch):
    diff = nnx.DiffState(0, is_float_param)
    gs, ls = [], []
    for k in range(8):
        l, g = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch[2 * k:2 * k + 2])
        gs.append(g); ls.append(l)
    g = jax.tree.map(lambda *x: sum(x) / 8, *gs)
    opt.update(model, g)
    return sum(ls) / 8
ref_losses = [float(ts(ref, opt, b)) for b in data]
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(m, spec, loss_fn, data[0], device_budget="min", mesh=chunkjax.data_mesh(), zero_stage=3)
cj = [float(step(b)) for b in data]
step.sync(m)
print("max rel loss", max(abs(a - b) / a for a, b in zip(ref_losses, cj)))
print("max param diff", compare_params(ref, m, rtol=1e-3, atol=1e-4))
for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(ref, nnx.Param)),
                          jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size and np.issubdtype(x.dtype, np.floating):
        d = np.abs(x - y); i = np.unravel_index(np.argmax(d), d.shape)
        print(jax.tree_util.keystr(p), "max", d.max(), "at", i, "n>1e-6:", int((d > 1e-6).sum()), "of", d.size)
