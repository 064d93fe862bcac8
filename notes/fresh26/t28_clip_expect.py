"""Host AdamW clipping with the speculation policy misjudged: clip_expect='rare' while clipping fires
on every step (speculated host updates must be rolled back), and 'fires' while it never fires."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW
expect, norm = sys.argv[1], float(sys.argv[2])
data = batches(12)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=norm)
ref, ref_losses = reference(spec.optax(), data, TiedMoE(rngs=nnx.Rngs(0), count=False))
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(m, spec, loss_fn, data[0], device_budget="min", clip_expect=expect)
print(step.schedule.counts())
cj, norms = [], []
for b in data:
    cj.append(float(step(b))); norms.append(float(step.metrics["grad_norm"]))
step.sync(m)
print("grad norms", np.round(norms, 3), "clip at", norm)
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print(expect, norm, "max param diff", compare_params(ref, m))
print("OK")
