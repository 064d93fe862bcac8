"""A loss the user already wrapped in nnx.jit (or whose model call is under nnx.jit / jax.checkpoint
at the top): what does discovery make of it, and are the numbers right?"""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(8)
kind = sys.argv[1]
if kind == "nnxjit":
    lf = nnx.jit(loss_fn)
elif kind == "remat_whole":
    def lf(model, batch):
        return nnx.remat(loss_fn)(model, batch)
else:
    lf = loss_fn
ref, ref_losses = reference(optax.adam(3e-3), data, TiedMoE(rngs=nnx.Rngs(0), count=False), loss=loss_fn)
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
import warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        step = chunkjax.offload(m, optax.adam(3e-3), lf, data[0], device_budget="min")
    except Exception as e:
        print(kind, "refused:", type(e).__name__, str(e)[:400]); sys.exit()
    for x in w:
        if "chunkjax" in str(x.filename) or "one stage" in str(x.message):
            print(kind, "warning:", str(x.message)[:300])
print(kind, step.summary()[:160])
cj = [float(step(b)) for b in data]
step.sync(m)
print(kind, "max rel", max(abs(a - b) / a for a, b in zip(ref_losses, cj)))
print(kind, "max param diff", compare_params(ref, m))
