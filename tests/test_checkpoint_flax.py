"""Checkpoints of the drop-in optimizers (chunkjax.flax_api) through the checkpoint protocol.

* NNX, across processes: a training process saves at step K and is SIGKILLed while it trains on;
  a new process resumes from the checkpoint (``restore_checkpoint`` + ``nnx.update``) and its
  losses and final params equal an uninterrupted run's bit for bit (fp32, CPU, AdamW).
* linen-style ChunkedOptimizer, in one process: a restored optimizer (same or another chunk
  size) continues exactly like the one that was saved; another optimizer is a CheckpointError.
"""
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import chunkjax as cj
from chunkjax import checkpoint as ck
from test_flax_api import TinyTransformer, batches, nnx_loss

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "checkpoint_nnx_worker.py")
STEPS, SAVE_AT = 8, 3


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(ckpt, out, save_at=0, resume=False, timeout=300):
    args = [sys.executable, WORKER, str(ckpt), str(out), str(STEPS), str(save_at), "1" if resume else "0"]
    subprocess.run(args, env=_env(), check=True, timeout=timeout, capture_output=True)
    return np.load(out)


def test_nnx_sigkill_after_save_then_resume_is_bit_exact(tmp_path):
    """The uninterrupted reference runs the worker's ``main`` in this process (the same code and,
    through the persistent compilation cache, the same compiled programs as a worker process: one
    process start with jax, flax and chunkjax imports fewer); the killed and the resumed runs are
    processes of their own."""
    from checkpoint_nnx_worker import main as worker_main
    ckpt = tmp_path / "ckpt"
    worker_main(str(ckpt / "unused"), str(tmp_path / "ref.npz"), STEPS, 0, False)
    ref = np.load(tmp_path / "ref.npz")
    proc = subprocess.Popen([sys.executable, WORKER, str(ckpt), str(tmp_path / "never.npz"), str(STEPS),
                             str(SAVE_AT), "0"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the save is complete (or the worker died)
        assert line.startswith("SAVED"), (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)  # while it trains on past the checkpoint
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ck.all_steps(ckpt) == [SAVE_AT]
    meta = ck.read_meta(ckpt)
    assert meta["saved_from"]["step"] == "ChunkedOptimizer" and meta["optimizer_steps"] == SAVE_AT
    assert {cm["saved_from"] for cm in meta["chunks"]} == {"device", "pinned_host"}  # both state kinds saved
    got = _run(ckpt, tmp_path / "resumed.npz", resume=True)
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    np.testing.assert_array_equal(got["losses"], ref["losses"])
    keys = [k for k in ref.files if k != "losses"]
    assert keys and sorted(keys) == sorted(k for k in got.files if k != "losses")
    for k in keys:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def _linen_setup(chunk_size):
    model = TinyTransformer(rngs=nnx.Rngs(0))
    params = jax.tree.map(jnp.asarray, nnx.state(model, nnx.Param))
    graphdef = nnx.graphdef(model)

    def loss(p, tok):
        return nnx_loss(nnx.merge(graphdef, p), tok)
    grad_fn = jax.jit(jax.value_and_grad(loss))
    opt = cj.ChunkedOptimizer(params, optax.adamw(3e-3, weight_decay=0.1), device_budget="1GiB",
                              chunk_size=chunk_size)
    return params, grad_fn, opt


def _train(params, grad_fn, opt, data):
    losses = []
    for tok in data:
        loss, g = grad_fn(params, tok)
        params = opt.update(g)
        losses.append(np.float32(loss))
    return params, losses


@pytest.mark.parametrize("chunk_size", [1024, 2048])
def test_chunked_optimizer_restore_continues_exactly(tmp_path, chunk_size):
    """Saved at step 3 with 1024-element chunks; restored into a fresh optimizer (the same chunk
    size, or 2048: every leaf remapped by path); 4 more steps equal the saved optimizer's."""
    data = batches(2, 7)
    params, grad_fn, opt = _linen_setup(1024)
    params, _ = _train(params, grad_fn, opt, data[:3])
    ck.save_checkpoint(tmp_path, 3, opt, extra={"note": "linen"})
    ref_params, ref_losses = _train(params, grad_fn, opt, data[3:])

    _, grad_fn2, opt2 = _linen_setup(chunk_size)
    restored, extra = ck.restore_checkpoint(tmp_path, opt2)
    assert extra == {"note": "linen"} and opt2.step == 3
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got_params, got_losses = _train(restored, grad_fn2, opt2, data[3:])
    np.testing.assert_array_equal(got_losses, ref_losses)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    exported = ck.export_params(opt2)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(opt2.master_params())):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_chunked_optimizer_refuses_another_optimizer(tmp_path):
    params, grad_fn, opt = _linen_setup(1024)
    _train(params, grad_fn, opt, batches(3, 1))
    ck.save_checkpoint(tmp_path, 1, opt)
    other = cj.ChunkedOptimizer(params, optax.lion(1e-4), device_budget="1GiB", chunk_size=1024)
    with pytest.raises(ck.CheckpointError, match="moments"):
        ck.restore_checkpoint(tmp_path, other)
    with pytest.raises(ck.CheckpointError, match="cannot checkpoint a dict"):
        ck.save_checkpoint(tmp_path, 2, {"not": "an engine"})


class _Count(nnx.Variable):
    """A user counter: non-parameter state the loss changes."""


class _DropBN(nnx.Module):
    """Dense -> BatchNorm -> dropout -> dense, with a call counter: every kind of non-parameter
    state an NNX loop changes (RNG key and count, batch statistics, a user variable)."""

    def __init__(self, rngs):
        self.a = nnx.Linear(6, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.b = nnx.Linear(32, 3, rngs=rngs)
        self.calls = _Count(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.b(self.drop(jax.nn.gelu(self.bn(self.a(x))))) * (1.0 + 0.01 * self.calls[...])


def _dropbn_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _dropbn_setup():
    model = _DropBN(nnx.Rngs(0, dropout=1))
    model.train()
    opt = cj.NnxOptimizer(model, optax.adamw(3e-3, weight_decay=0.1), device_budget=40_000, chunk_size=128)
    return model, opt


def _dropbn_train(model, opt, grad_fn, data):
    losses = []
    for b in data:
        loss, grads = grad_fn(model, b)
        opt.update(model, grads)
        losses.append(np.float32(loss))
    opt.wait()
    return losses


def test_nnx_restore_with_dropout_and_batchnorm_is_bit_exact(tmp_path):
    """Saved after 3 steps of a model with dropout, BatchNorm and a counter; a fresh model and
    optimizer restored from it continue exactly like the uninterrupted run: the checkpoint holds
    the model's non-parameter state (RNG count, batch statistics, counter) too."""
    rng = np.random.default_rng(7)
    data = [{"x": jnp.asarray(rng.normal(size=(16, 6)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)} for _ in range(6)]
    grad_fn = nnx.jit(nnx.value_and_grad(_dropbn_loss))
    model, opt = _dropbn_setup()
    _dropbn_train(model, opt, grad_fn, data[:3])
    ck.save_checkpoint(tmp_path, 3, opt)
    ref = _dropbn_train(model, opt, grad_fn, data[3:])
    ref_state = jax.tree.leaves(nnx.state(model))

    model2, opt2 = _dropbn_setup()
    params, _ = ck.restore_checkpoint(tmp_path, opt2)
    nnx.update(model2, params)
    assert int(model2.calls[...]) == 3
    got = _dropbn_train(model2, opt2, grad_fn, data[3:])
    np.testing.assert_array_equal(got, ref)
    for a, b in zip(jax.tree.leaves(nnx.state(model2)), ref_state):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_restore_refuses_other_non_parameter_state(tmp_path):
    """A checkpoint whose non-parameter state the model lacks: one CheckpointError line naming
    the leaf; the model's state is unchanged."""
    model, opt = _dropbn_setup()
    ck.save_checkpoint(tmp_path, 0, opt)
    model2, opt2 = _dropbn_setup()
    del model2.calls
    before = jax.tree.leaves(nnx.state(model2, nnx.Param))
    with pytest.raises(ck.CheckpointError, match="calls") as e:
        ck.restore_checkpoint(tmp_path, opt2)
    assert "\n" not in str(e.value)
    for a, b in zip(jax.tree.leaves(nnx.state(model2, nnx.Param)), before):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
