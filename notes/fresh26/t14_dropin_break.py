"""Drop-in optimizer: bad budgets, a NaN gradient, grads of the wrong structure, update after a
failed update, checkpoint round trip with the model's counter."""
import sys, tempfile
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

data = batches(6)
wrt = is_float_param
def case(name, fn):
    try:
        r = fn(); print(f"{name}: no error:", repr(r)[:200])
    except Exception as e:
        msg = str(e); print(f"{name}: {type(e).__name__} (lines={msg.count(chr(10))+1}): {msg[:400]}")

mk = lambda: TiedMoE(rngs=nnx.Rngs(0))
case("budget 1KiB", lambda: chunkjax.NnxOptimizer(mk(), optax.adam(1e-3), wrt=wrt, device_budget="1KiB"))
case("budget auto", lambda: chunkjax.NnxOptimizer(mk(), optax.adam(1e-3), wrt=wrt, device_budget="auto").summary()[:200])
case("budget min", lambda: chunkjax.NnxOptimizer(mk(), optax.adam(1e-3), wrt=wrt, device_budget="min").summary()[:200])
case("no budget", lambda: chunkjax.NnxOptimizer(mk(), optax.adam(1e-3), wrt=wrt))

m = mk()
opt = chunkjax.NnxOptimizer(m, optax.adam(1e-3), wrt=wrt, device_budget="64KiB")
@nnx.jit
def grads_of(model, b):
    return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, b)
l, g = grads_of(m, data[0])
case("grads of nnx.Param (int leaf included)", lambda: opt.update(m, nnx.state(m, nnx.Param)))
case("grads missing a leaf", lambda: opt.update(m, nnx.State({k: v for k, v in g.items() if k != "temp"})))
gnan = jax.tree.map(lambda x: x * jnp.nan, g)
before = np.asarray(m.embed.embedding[...]).copy()
case("NaN grads", lambda: opt.update(m, gnan))
print("params NaN after NaN update:", bool(np.isnan(np.asarray(m.embed.embedding[...])).any()))
