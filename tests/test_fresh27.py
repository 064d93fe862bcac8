"""What a new user found bringing their own NNX model (a ViT-style classifier with ``nnx.scan``-ed
blocks, dropout, LayerNorm) to chunkjax (helper ``fresh27``, session 27).

Each test asserts the right value or behaviour against a reference (``nnx.Optimizer``, float32 on
the CPU) or the documented one-line error."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import chunkjax as cj


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.fc2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(jax.nn.gelu(self.fc1(x))))


def _loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _batch(i):
    k1, k2 = jax.random.split(jax.random.key(100 + i))
    return jax.random.normal(k1, (8, 16)), jax.random.randint(k2, (8,), 0, 4)


@nnx.jit
def grad_step(model, batch):
    """The README's drop-in loop: the jitted function returns the gradients."""
    return nnx.value_and_grad(_loss)(model, batch)


@nnx.jit
def ref_step(model, optimizer, batch):
    """The reference: nnx.Optimizer updated inside nnx.jit."""
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert "optimizer.update(model, grads)" in msg and "outside" in msg and "chunkjax.offload" in msg, msg


@pytest.mark.parametrize("how", ["argument", "closure"])
def test_nnx_optimizer_inside_nnx_jit_one_line_then_trains_as_nnx_optimizer(how):
    """The usual NNX pattern, ``optimizer.update(model, grads)`` inside ``@nnx.jit`` (the optimizer
    as the jitted function's argument, or captured by closure), is refused in one line saying what
    to do; the model and optimizer are untouched, and the README's pattern then trains exactly as
    ``nnx.Optimizer`` does."""
    tx = optax.adamw(1e-2)
    model = _Net(nnx.Rngs(0))
    ref_model = _Net(nnx.Rngs(0))
    opt = cj.NnxOptimizer(model, tx, device_budget="min")
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    if how == "argument":
        @nnx.jit
        def bad_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(_loss)(model, batch)
            optimizer.update(model, grads)
            return loss
        with pytest.raises(TypeError) as err:
            bad_step(model, opt, _batch(0))
    else:
        @nnx.jit
        def bad_step(model, batch):
            loss, grads = nnx.value_and_grad(_loss)(model, batch)
            opt.update(model, grads)
            return loss
        with pytest.raises(TypeError) as err:
            bad_step(model, _batch(0))
    _one_line(err)
    assert opt.step == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), nnx.state(model, nnx.Param), before)

    ref_opt = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)

    for i in range(5):
        loss, grads = grad_step(model, _batch(i))
        opt.update(model, grads)
        ref = ref_step(ref_model, ref_opt, _batch(i))
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))


def test_nnx_optimizer_as_static_jit_argument_still_works():
    """An optimizer given to nnx.jit / jax.jit as a static argument (read, not updated, inside)
    keeps working as before the in-jit refusal: the step count it reads is the optimizer's."""
    model = _Net(nnx.Rngs(0))
    opt = cj.NnxOptimizer(model, optax.adam(1e-3), device_budget="min")
    f = lambda o, x: x * (o.step + 2)
    np.testing.assert_array_equal(np.asarray(nnx.jit(f, static_argnums=0)(opt, jnp.ones(2))), [2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(jax.jit(f, static_argnums=0)(opt, jnp.ones(2))), [2.0, 2.0])


@pytest.mark.parametrize("api", ["NnxOptimizer", "ChunkedOptimizer"])
def test_dropin_multisteps_refusal_advises_what_it_takes_and_that_trains_as_nnx_optimizer(api):
    """optax.MultiSteps given to a drop-in optimizer: the one-line refusal names
    tx.gradient_transformation() and no micro_batches= (which the drop-ins do not take: that advice
    is the front door's), and what it advises trains as nnx.Optimizer with the MultiSteps does."""
    tx = lambda: optax.MultiSteps(optax.adamw(1e-2), 2)
    model = _Net(nnx.Rngs(0))
    with pytest.raises(TypeError) as err:
        if api == "NnxOptimizer":
            cj.NnxOptimizer(model, tx(), device_budget="min")
        else:
            cj.ChunkedOptimizer(nnx.state(model, nnx.Param), tx(), device_budget="min")
    msg = str(err.value)
    assert "\n" not in msg and "tx.gradient_transformation()" in msg and "micro_batches" not in msg, msg

    ref_model = _Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, tx(), wrt=nnx.Param)
    opt = cj.NnxOptimizer(model, tx().gradient_transformation(), device_budget="min")

    for i in range(6):
        loss, grads = grad_step(model, _batch(i))
        opt.update(model, grads)
        np.testing.assert_allclose(float(loss), float(ref_step(ref_model, ref_opt, _batch(i))), rtol=1e-5)
