"""(a) offload with compute_dtype=float16 and no loss scaling; (b) NnxOptimizer over a bf16 model
against nnx.Optimizer over the same bf16 model."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(10)
which = sys.argv[1]
if which == "fp16":
    m = TiedMoE(rngs=nnx.Rngs(0), count=False)
    try:
        step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min", compute_dtype="fp16")
        print([round(float(step(b)), 4) for b in data], step.metrics)
    except Exception as e:
        print(type(e).__name__, str(e)[:300])
    try:
        step = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.adam(1e-3), loss_fn, data[0], device_budget="min", compute_dtype="fp16", loss_scaling=True)
        print("loss_scaling=True:", float(step(data[0])))
    except Exception as e:
        print("loss_scaling=True:", type(e).__name__, str(e)[:300])
if which == "bf16":
    class M(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(64, 32, param_dtype=jnp.bfloat16, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(32, 32, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs) for _ in range(3)])
            self.head = nnx.Linear(32, 64, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
        def __call__(self, t):
            x = self.embed(t)
            for b in self.blocks:
                x = x + jax.nn.gelu(b(x))
            return self.head(x).astype(jnp.float32)
    ref, ref_losses = reference(optax.adam(1e-3), data, M(nnx.Rngs(0)))
    m = M(nnx.Rngs(0))
    opt = chunkjax.NnxOptimizer(m, optax.adam(1e-3), device_budget="16KiB")
    g_of = nnx.jit(lambda mm, b: nnx.value_and_grad(loss_fn)(mm, b))
    cj = []
    for b in data:
        l, g = g_of(m, b); opt.update(m, g); cj.append(float(l))
    opt.wait()
    print("dtype", m.head.kernel[...].dtype)
    for a, b in zip(ref_losses, cj):
        print(a, b, abs(a - b) / a)
