"""A parameter the loss never reads (a spare head), with adamw weight decay: the plain loop decays
it every step (zero gradient, decay applied); does chunkjax?"""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW


class M(TiedMoE):
    def __init__(self, rngs):
        super().__init__(rngs=rngs, count=False)
        self.spare = nnx.Linear(32, 64, rngs=rngs)     # never called


kind = sys.argv[1] if len(sys.argv) > 1 else "optax"
budget = sys.argv[2] if len(sys.argv) > 2 else "min"
data = batches(10)
mk = (lambda: optax.adamw(3e-3, weight_decay=0.5)) if kind == "optax" else (lambda: AdamW(3e-3, weight_decay=0.5))
ref, ref_losses = reference(mk() if kind == "optax" else mk().optax(), data, M(nnx.Rngs(0)))
m = M(nnx.Rngs(0))
k0 = np.asarray(m.spare.kernel[...]).copy()
step = chunkjax.offload(m, mk(), loss_fn, data[0], device_budget=budget)
print(step.schedule.counts())
cj = [float(step(b)) for b in data]
step.sync(m)
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("ref spare changed by", float(np.abs(np.asarray(ref.spare.kernel[...]) - k0).max()),
      "chunkjax spare changed by", float(np.abs(np.asarray(m.spare.kernel[...]) - k0).max()))
print("max param diff", compare_params(ref, m))
print("OK")
