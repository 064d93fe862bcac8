"""Odd pytrees: bf16 params (whole model), an nnx.Dict with int-like keys, a frozen submodule."""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

which = sys.argv[1]
data = batches(20)

if which == "bf16":
    # the whole model in bf16; compare with an fp32-master loop: fp32 copy, forward on bf16 rounding
    class M(nnx.Module):
        def __init__(self, dtype, rngs):
            self.embed = nnx.Embed(64, 32, param_dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(32, 32, param_dtype=dtype, dtype=jnp.bfloat16, rngs=rngs) for _ in range(3)])
            self.head = nnx.Linear(32, 64, param_dtype=dtype, dtype=jnp.bfloat16, rngs=rngs)
        def __call__(self, t):
            x = self.embed(t).astype(jnp.bfloat16)
            for b in self.blocks:
                x = x + jax.nn.gelu(b(x))
            return self.head(x).astype(jnp.float32)
    m = M(jnp.bfloat16, nnx.Rngs(0))
    # reference: float32 masters initialised from the bf16 init, forward on bf16 rounding of them
    ref = M(jnp.float32, nnx.Rngs(0))
    nnx.update(ref, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(m, nnx.Param)))
    def ref_loss(model, batch):
        st = nnx.state(model, nnx.Param)
        g = nnx.graphdef(model)
        mm = nnx.merge(g, jax.tree.map(lambda x: x.astype(jnp.bfloat16), st), nnx.state(model, nnx.Not(nnx.Param)))
        return loss_fn(mm, batch)
    tx = lambda: optax.adam(1e-3)
    ref, ref_losses = reference(tx(), data, ref, loss=ref_loss)
    step = chunkjax.offload(m, tx(), loss_fn, data[0], device_budget="min")
    print(step.summary()[:300])
    cj = [float(step(b)) for b in data]
    step.sync(m)
    print("dtype after sync", m.head.kernel[...].dtype)
    for i, (a, b) in enumerate(zip(ref_losses, cj)):
        print(i, a, b, abs(a - b) / abs(a))
    np.testing.assert_allclose(cj, ref_losses, rtol=2e-3)   # bf16 compute: bf16-appropriate tolerance
    # masters rounded to bf16 vs fp32 reference rounded to bf16
    for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(ref, nnx.Param)),
                              jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))):
        d = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float32) - np.asarray(y, np.float32))
        print(jax.tree_util.keystr(p), d.max())
    print("OK")

if which == "intkeys":
    class M(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(64, 32, rngs=rngs)
            self.experts = nnx.Dict({"0": nnx.Linear(32, 32, rngs=rngs), "1": nnx.Linear(32, 32, rngs=rngs)})
            self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])
            self.head = nnx.Linear(32, 64, rngs=rngs)
        def __call__(self, t):
            x = self.embed(t)
            x = x + self.experts["0"](x) * self.experts["1"](x)
            for b in self.blocks:
                x = x + jax.nn.gelu(b(x))
            return self.head(x)
    ref, ref_losses = reference(optax.adam(1e-3), data, M(nnx.Rngs(0)))
    m = M(nnx.Rngs(0))
    step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min")
    cj = [float(step(b)) for b in data]
    step.sync(m)
    np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
    print("max param diff", compare_params(ref, m))
    print("OK")

if which == "frozen":
    # freeze the embedding submodule with trainable=
    mk = lambda: TiedMoE(rngs=nnx.Rngs(0))
    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("blocks")))
    trainable = nnx.All(is_float_param, nnx.PathContains("blocks"))   # train the blocks only
    ref = mk()
    opt = nnx.Optimizer(ref, optax.adam(1e-3), wrt=trainable)
    @nnx.jit
    def ts(model, opt, b):
        l, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))(model, b)
        opt.update(model, g); return l
    ref_losses = [float(ts(ref, opt, b)) for b in data]
    m = mk()
    e0 = np.asarray(m.embed.embedding[...]).copy()
    step = chunkjax.offload(m, optax.adam(1e-3), loss_fn, data[0], device_budget="min", trainable=trainable)
    print(step.schedule.counts())
    cj = [float(step(b)) for b in data]
    step.sync(m)
    np.testing.assert_allclose(cj, ref_losses, rtol=2e-5)
    assert (np.asarray(m.embed.embedding[...]) == e0).all()
    print("max param diff", compare_params(ref, m))
    print("OK")
