"""A data loader's batch as chunkjax.offload gets it: numpy int64 tokens and float64 weights
(numpy's defaults) as the example batch and every step's batch. With x64 off they are the
int32/float32 arrays ``jnp.asarray`` makes; the step trains on them and its losses equal an
``nnx.Optimizer`` loop's (plain optax, float32, 1e-5 relative). A python scalar leaf in the batch
is refused in one line (no row axis) instead of an AttributeError."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import chunkjax


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.fc = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(x))


class _Tagger(nnx.Module):  # token in, weighted per-token class out
    def __init__(self, rngs, vocab=32, d=16):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([_Block(d, rngs) for _ in range(3)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loss(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["labels"])
    return (ce * batch["weight"]).sum() / batch["weight"].sum()


def _numpy_batch(i):
    rng = np.random.default_rng(i)
    return {"tokens": rng.integers(0, 32, (4, 8)), "labels": rng.integers(0, 32, (4, 8)),
            "weight": rng.random((4, 8))}  # int64, int64, float64


def test_numpy_int64_float64_batches_train_like_nnx_optimizer():
    batches = [_numpy_batch(i) for i in range(4)]
    assert batches[0]["tokens"].dtype == np.int64 and batches[0]["weight"].dtype == np.float64
    step = chunkjax.offload(_Tagger(nnx.Rngs(0)), optax.adam(1e-2), _loss, batches[0], device_budget="min")
    assert any("pinned_host" in k for k in step.schedule.counts())
    got = [float(step(b)) for b in batches]

    ref = _Tagger(nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        opt.update(model, grads)
        return loss

    want = [float(train_step(ref, opt, jax.tree.map(jnp.asarray, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the same batch as jnp arrays (int32/float32) is the planned one too
    assert np.isfinite(float(step(jax.tree.map(jnp.asarray, batches[0]))))


def test_python_scalar_batch_leaf_is_one_line():
    batch = dict(jax.tree.map(jnp.asarray, _numpy_batch(0)), scale=1.0)
    with pytest.raises(ValueError, match="batch axis first"):
        chunkjax.offload(_Tagger(nnx.Rngs(0)), optax.adam(1e-2), lambda m, b: _loss(m, b) * b["scale"], batch,
                         device_budget="min")
