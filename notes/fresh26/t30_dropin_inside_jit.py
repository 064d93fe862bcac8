"""The most likely drop-in mistake: keep optimizer.update(model, grads) inside the nnx.jit step, as
with nnx.Optimizer."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(3)
m = TiedMoE(rngs=nnx.Rngs(0))
opt = chunkjax.NnxOptimizer(m, optax.adam(1e-3), wrt=is_float_param, device_budget="64KiB")
@nnx.jit
def train_step(model, batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, is_float_param))(model, batch)
    opt.update(model, grads)
    return loss
try:
    print(float(train_step(m, data[0])))
except Exception as e:
    msg = str(e)
    print(type(e).__name__, "lines", msg.count("\n") + 1, msg[:500])
@nnx.jit
def train_step2(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, is_float_param))(model, batch)
    opt.update(model, grads)
    return loss
try:
    print(float(train_step2(m, opt, data[0])))
except Exception as e:
    msg = str(e)
    print(type(e).__name__, "lines", msg.count("\n") + 1, msg[:500])
