"""save_checkpoint_async of the front door's step at step 5 while training goes on; restore in a
fresh step: losses of steps 6.. equal the uninterrupted run's bit for bit."""
import sys, tempfile
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW
data = batches(10)
kind = sys.argv[1] if len(sys.argv) > 1 else "optax"
mk_tx = (lambda: optax.adamw(3e-3)) if kind == "optax" else (lambda: AdamW(3e-3))
d = tempfile.mkdtemp()
m = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(m, mk_tx(), loss_fn, data[0], device_budget="min")
full = []
for i, b in enumerate(data):
    full.append(float(step(b)))
    if i == 4:
        try:
            job = chunkjax.save_checkpoint_async(d, 5, step, extra={"pos": 5})
        except Exception as e:
            print("async save:", type(e).__name__, str(e)[:300]); sys.exit(0)
job.wait()
s2 = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0)), mk_tx(), loss_fn, data[0], device_budget="min")
_, extra = chunkjax.restore_checkpoint(d, s2)
res = [float(s2(b)) for b in data[extra["pos"]:]]
print(full[5:], res)
assert res == full[5:]
m2 = TiedMoE(rngs=nnx.Rngs(0)); s2.sync(m2); step.sync(m)
assert int(m2.calls[...]) == int(m.calls[...]) == 10
print("OK")
