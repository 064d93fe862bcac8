"""ZeRO-3 over the 8 forced CPU devices on TiedMoE (host AdamW with clipping, micro-batches 2),
vs single-device optax on the whole batch."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1
data = batches(12, B=16)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)
ref, ref_losses = reference(spec.optax(), data, TiedMoE(rngs=nnx.Rngs(0), count=False))
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(m, spec, loss_fn, data[0], device_budget="min", mesh=chunkjax.data_mesh(), zero_stage=stage,
                        micro_batches=mb)
print(step.summary()[:300])
cj = [float(step(b)) for b in data]
step.sync(m)
for i, (a, b) in enumerate(zip(ref_losses, cj)):
    print(i, a, b, abs(a - b) / abs(a))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("max param diff", compare_params(ref, m, rtol=1e-3, atol=1e-4))
print("OK")
