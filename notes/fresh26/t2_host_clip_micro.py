"""host AdamW spec with clipping, micro_batches=2, vs optax chain on the whole batch."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

data = batches(20, B=8)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)
ref, ref_losses = reference(spec.optax(), data, TiedMoE(rngs=nnx.Rngs(0), count=False))
model = TiedMoE(rngs=nnx.Rngs(0), count=False)
mb = int(sys.argv[1]) if len(sys.argv) > 1 else 2
step = chunkjax.offload(model, spec, loss_fn, data[0], device_budget="min", micro_batches=mb)
print(step.summary())
cj, norms = [], []
for b in data:
    cj.append(float(step(b))); norms.append(float(step.metrics["grad_norm"]))
print("norms", norms[:5])
step.sync(model)
for i, (a, b) in enumerate(zip(ref_losses, cj)):
    print(i, a, b, abs(a - b) / abs(a))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("max param diff", compare_params(ref, model))
print("OK")
