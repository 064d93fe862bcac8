"""nonfinite='skip' with an lr schedule: a NaN batch at step 5 must change nothing, the schedule's
count included. Reference: the plain loop that does not call opt.update on that step."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

data = batches(12)
BAD = 5
def lf(model, batch):   # batch[0,0] == -1 marks a poisoned batch
    l = loss_fn(model, jnp.maximum(batch, 0))
    return l * jnp.where(batch[0, 0] < 0, jnp.nan, 1.0) if "mulnan" in sys.argv else jnp.where(batch[0, 0] < 0, jnp.nan, l)
data[BAD] = data[BAD].at[0, 0].set(-1)
sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 12, 3e-4)
kind = sys.argv[1] if len(sys.argv) > 1 else "optax"
mk_tx = (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.1))) if kind == "optax" else None

ref = TiedMoE(rngs=nnx.Rngs(0), count=False)
tx = mk_tx() if kind == "optax" else AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0).optax()
opt = nnx.Optimizer(ref, tx, wrt=is_float_param)
@nnx.jit
def grads(model, b):
    return nnx.value_and_grad(lf, argnums=nnx.DiffState(0, is_float_param))(model, b)
@nnx.jit
def upd(model, opt, g):
    opt.update(model, g)
ref_losses = []
for b in data:
    l, g = grads(ref, b)
    ref_losses.append(float(l))
    if np.isfinite(float(l)):
        upd(ref, opt, g)

m = TiedMoE(rngs=nnx.Rngs(0), count=False)
t = mk_tx() if kind == "optax" else AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
step = chunkjax.offload(m, t, lf, data[0], device_budget="min", nonfinite="skip")
cj = []
for b in data:
    cj.append(float(step(b)))
    print(len(cj) - 1, cj[-1], ref_losses[len(cj) - 1], "skipped" if bool(step.metrics.get("skipped", False)) else "")
step.sync(m)
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print("max param diff", compare_params(ref, m))
print("OK")
