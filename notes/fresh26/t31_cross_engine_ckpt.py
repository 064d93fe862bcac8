"""A checkpoint of the front door's step restored into an NnxOptimizer (and back): refused in one
line, or continued exactly?"""
import sys, tempfile
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(8)
tx = lambda: optax.adam(3e-3)
d = tempfile.mkdtemp()
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(m, tx(), loss_fn, data[0], device_budget="min")
full = [float(step(b)) for b in data]
m1 = TiedMoE(rngs=nnx.Rngs(0), count=False)
s1 = chunkjax.offload(m1, tx(), loss_fn, data[0], device_budget="min")
for b in data[:4]:
    s1(b)
chunkjax.save_checkpoint(d, 4, s1)
m2 = TiedMoE(rngs=nnx.Rngs(0), count=False)
opt = chunkjax.NnxOptimizer(m2, tx(), wrt=is_float_param, device_budget="64KiB")
try:
    params, extra = chunkjax.restore_checkpoint(d, opt)
    nnx.update(m2, params)
    g_of = nnx.jit(lambda mm, b: nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, is_float_param))(mm, b))
    cont = []
    for b in data[4:]:
        l, g = g_of(m2, b); opt.update(m2, g); cont.append(float(l))
    print("offload ckpt -> NnxOptimizer: continued", cont, "uninterrupted", full[4:],
          "max rel", max(abs(a - b) / a for a, b in zip(cont, full[4:])))
except Exception as e:
    print("offload ckpt -> NnxOptimizer:", type(e).__name__, str(e)[:400])
