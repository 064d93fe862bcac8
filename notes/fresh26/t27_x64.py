"""A user with jax_enable_x64 on (float32 model, int64 tokens): offload vs nnx.Optimizer."""
import sys
import jax
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW
data = batches(8)
print("batch dtype", data[0].dtype)
kind = sys.argv[1] if len(sys.argv) > 1 else "optax"
mk = (lambda: optax.adamw(3e-3)) if kind == "optax" else (lambda: AdamW(3e-3))
ref, ref_losses = reference(mk() if kind == "optax" else mk().optax(), data, TiedMoE(rngs=nnx.Rngs(0)))
m = TiedMoE(rngs=nnx.Rngs(0))
try:
    step = chunkjax.offload(m, mk(), loss_fn, data[0], device_budget="min")
    cj = [float(step(b)) for b in data]
    step.sync(m)
    print(kind, np.max(np.abs(np.array(cj) - ref_losses) / np.array(ref_losses)))
    print(kind, "max param diff", compare_params(ref, m))
    print("param dtype after sync", m.embed.embedding[...].dtype)
except Exception as e:
    import traceback; traceback.print_exc()
