import sys, numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
from mymodel import TiedMoE, loss_fn, batches

is_float_param = nnx.All(nnx.Param, lambda path, v: jnp.issubdtype(v[...].dtype, jnp.floating))


def reference(tx, data, model=None, loss=loss_fn):
    ref = model if model is not None else TiedMoE(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(ref, tx, wrt=is_float_param)

    @nnx.jit
    def train_step(model, opt, batch):
        diff = nnx.DiffState(0, is_float_param)
        l, g = nnx.value_and_grad(loss, argnums=diff)(model, batch)
        opt.update(model, g)
        return l

    return ref, [float(train_step(ref, opt, b)) for b in data]


def compare_params(ref, model, rtol=1e-4, atol=1e-5):
    ra, ma = nnx.state(ref, nnx.Param), nnx.state(model, nnx.Param)
    la, lb = jax.tree_util.tree_leaves_with_path(ra), jax.tree_util.tree_leaves_with_path(ma)
    assert len(la) == len(lb)
    worst = 0.0
    for (p, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol, err_msg=str(p))
        worst = max(worst, float(np.max(np.abs(x - y)))) if x.size else worst
    return worst
