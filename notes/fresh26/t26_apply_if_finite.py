"""optax.apply_if_finite (skip the whole update when any gradient is non-finite) and optax.MultiSteps
through offload, with a NaN in one leaf's gradient on step 3 only: vs nnx.Optimizer."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

BAD = 3
data = batches(8)
data[BAD] = data[BAD].at[0, 0].set(-1)
def lf(model, batch):
    l = loss_fn(model, jnp.maximum(batch, 0))
    # a NaN gradient in temp only, on the marked batch: 0 * sqrt(-1 * temp) has d/dtemp = NaN
    # (lax.cond: the forward stays finite, the gradient of temp is inf on that batch only)
    t = model.temp[...]
    poison = jax.lax.cond(batch[0, 0] < 0, lambda t: jnp.sqrt(t - jax.lax.stop_gradient(t)), lambda t: 0.0 * t, t)
    return l + poison
kind = sys.argv[1]
mk = {"aif": lambda: optax.apply_if_finite(optax.adam(3e-3), max_consecutive_errors=5),
      "multi": lambda: optax.MultiSteps(optax.adam(3e-3), every_k_schedule=2),
      "plain": lambda: optax.adam(3e-3),
      "multigt": lambda: optax.MultiSteps(optax.adam(3e-3), every_k_schedule=2).gradient_transformation()}[kind]
ref, ref_losses = reference(mk(), data, TiedMoE(rngs=nnx.Rngs(0), count=False), loss=lf)
m = TiedMoE(rngs=nnx.Rngs(0), count=False)
try:
    step = chunkjax.offload(m, mk(), lf, data[0], device_budget="min")
except Exception as e:
    print(kind, "refused:", type(e).__name__, str(e)[:400]); sys.exit()
cj = [float(step(b)) for b in data]
step.sync(m)
print(kind, "ref", np.round(ref_losses, 5))
print(kind, "cj ", np.round(cj, 5))
print(kind, "ref temp", float(ref.temp[...]), "cj temp", float(m.temp[...]))
np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
print(kind, "max param diff", compare_params(ref, m))
print(kind, "OK")
