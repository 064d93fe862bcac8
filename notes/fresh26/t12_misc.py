"""Misc user moves: evaluate vs the model's own loss, micro_batches not dividing the batch,
the released model, sync into a model built with another size, restore of another model's ckpt."""
import sys, tempfile
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

data = batches(4)
def case(name, fn):
    try:
        r = fn(); print(f"{name}: no error:", repr(r)[:200])
    except Exception as e:
        msg = str(e); print(f"{name}: {type(e).__name__} (lines={msg.count(chr(10))+1}): {msg[:400]}")

m = TiedMoE(rngs=nnx.Rngs(0), count=False)
step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min")
step(data[0])
ev = float(step.evaluate(data[1]))
case("model forward after offload", lambda: m(data[1][:, :-1]))
step.sync(m)
own = float(loss_fn(m, data[1]))
print("evaluate", ev, "own loss after sync", own, abs(ev - own) / own)
assert abs(ev - own) / own < 2e-6
case("micro_batches=3 with 8 rows", lambda: chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.adam(1e-3), loss_fn, data[0], micro_batches=3))
case("micro_batches=0", lambda: chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.adam(1e-3), loss_fn, data[0], micro_batches=0))
case("sync into another size", lambda: step.sync(TiedMoE(d=16, rngs=nnx.Rngs(0), count=False)))
d = tempfile.mkdtemp()
chunkjax.save_checkpoint(d, 1, step)
other = chunkjax.offload(TiedMoE(n_blocks=2, rngs=nnx.Rngs(0), count=False), optax.adam(1e-3), loss_fn, data[0], device_budget="min")
case("restore another model's ckpt", lambda: chunkjax.restore_checkpoint(d, other))
o2 = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.sgd(1e-3, momentum=0.9), loss_fn, data[0], device_budget="min")
case("restore with another optimizer", lambda: chunkjax.restore_checkpoint(d, o2))
case("restore from an empty dir", lambda: chunkjax.restore_checkpoint(tempfile.mkdtemp(), step))
case("restore from a missing dir", lambda: chunkjax.restore_checkpoint("/nonexistent/ck", step))
case("offload a released model", lambda: (step.release(m), chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0]))[1])
case("lamb", lambda: chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.lamb(1e-3), loss_fn, data[0]))
case("adamw with mask", lambda: chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0), count=False), optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), loss_fn, data[0]))
case("batch as list of arrays", lambda: step([data[1]]))
