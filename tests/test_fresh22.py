"""What a new user found bringing their own model (an encoder-decoder with a shared embedding, a
frozen sub-module, a bf16 leaf and a masked loss) to chunkjax (helper ``fresh22``).

Each test asserts the right value or behaviour against a reference (an uninterrupted twin, plain
optax, float32 on the CPU)."""
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj


def _tiny_nnx():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.fc(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(4, 8, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)[:, 0]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    keys = jax.random.split(jax.random.key(1), 4)
    batches = [{"x": jax.random.normal(k, (8, 4)), "y": jax.random.normal(k, (8,))} for k in keys]
    return Net, loss_fn, batches


def _masters(st):
    return jax.tree.leaves(jax.tree.map(np.asarray, st.step.master_params(st.state)))


def test_ctrl_c_as_the_step_hands_over_to_its_commit_ends_it_as_after_it(monkeypatch, default_sigint):
    """Host AdamW with clipping: the host chunks take the global norm in place, and signals are held
    from then on. But the hold ended as the engine's ``begin`` returned, before the caller's commit
    held them again: a Ctrl-C in that gap (my loop, Ctrl-C at random times, 1 run in 3) raised
    KeyboardInterrupt with the step's metrics and device chunks as before it, its host chunks
    updated: retrying the batch then trained on a state that was neither (losses 5.009 against
    5.032 uninterrupted, silently). Right: the signal waits for the commit, so the step ends as
    after it (equal to an uninterrupted twin, bit for bit) and then raises, with ``metrics`` the
    step's and a note on the KeyboardInterrupt saying the step is applied (the loop must not repeat
    its batch: nothing else told it so)."""
    from flax import nnx
    from chunkjax.host_update import AdamW
    from chunkjax.step import ChunkedStep
    Net, loss_fn, batches = _tiny_nnx()
    spec = AdamW(1e-2, max_grad_norm=1e-3)  # clipping fires: the host updates depend on the norm
    twin = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    st = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    assert st.step.host_chunks and (st.step.device_chunks or st.step.streamed_chunks), st.step.schedule.counts()
    assert float(st(batches[0])) == float(twin(batches[0]))
    want = float(twin(batches[1]))
    real_begin = ChunkedStep.begin

    def begin_then_ctrl_c(self, *a, **k):
        pending = real_begin(self, *a, **k)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C as begin returns, before the caller commits
        return pending

    before = st.metrics
    monkeypatch.setattr(ChunkedStep, "begin", begin_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as e:
        st(batches[1])
    monkeypatch.setattr(ChunkedStep, "begin", real_begin)
    assert st.metrics is not before and float(st.metrics["loss"]) == want  # the step committed
    assert any("the step is applied" in n and "do not repeat its batch" in n for n in getattr(e.value, "__notes__", ()))
    st.wait()
    twin.wait()
    for a, b in zip(_masters(st), _masters(twin), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(st(batches[2])) == float(twin(batches[2]))  # and it trains on
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing left holding Ctrl-C


def test_chunks_inside_one_leaf_share_their_update_programs():
    """NnxOptimizer at a budget small enough to stream (my 161k-parameter encoder-decoder at 16KiB:
    1243 chunks of 128 elements) spent 235 CPU s in its first update compiling 233 update
    programs, one per chunk shape, each leaf offset a constant: every chunk inside a leaf that
    spans many (an embedding) compiled its own. Right: the offsets are arguments, so the chunks
    inside one leaf share one program, device-resident and streamed alike, and the updates equal
    plain optax on the whole tree."""
    import optax
    rng = np.random.default_rng(7)
    params = {"emb": jnp.asarray(rng.normal(size=(40, 32)), jnp.float32),  # 1280 elements: 10 chunks of 128
              "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
    grads = [jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), params) for _ in range(3)]
    tx = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))  # noqa: E731
    on_dev = cj.ChunkedOptimizer(params, tx(), device_budget="1GiB", chunk_size=128)
    streamed = cj.ChunkedOptimizer(params, tx(), device_budget=on_dev.working_bytes, chunk_size=128)
    emb = {s.path: s for s in on_dev.layout.slots}["emb"]
    inside = [c for c, p in zip(emb.chunks, emb.pieces) if p.size == 128]  # chunks holding emb only
    assert len(inside) >= 8 and streamed.streamed_chunks
    ref_p, ref_s, t = params, tx().init(params), tx()
    for g in grads:
        u, ref_s = t.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        p, ps = on_dev.update(g), streamed.update(g)
    streamed.wait()
    for got in (p, ps):
        for k in params:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref_p[k]), rtol=2e-6, atol=2e-7)
    for opt in (on_dev, streamed):
        fns = {id(opt._update_of[c]): opt._update_of[c] for c in inside}
        assert len(fns) == 1, len(fns)  # one program object for the chunks inside the leaf ...
        assert next(iter(fns.values()))._cache_size() == 1  # ... compiled once


def test_resume_of_a_stopped_run_with_steps_below_its_checkpoint_is_one_line():
    """``--resume runs/<name>.partial --steps 10`` on a run stopped at checkpoint step 25 of 300
    trained nothing and finished the run as a 10-step one: the folder renamed as done, its report
    saying steps 10, tokens 10240 (25 steps were trained) and the validation loss before training
    as the last. Right: refused before anything is loaded (exit 2, one line saying which --steps
    work); --steps equal to the checkpoint's still finishes the run, and a finished run still needs
    more steps than its checkpoint."""
    from experiments import train
    meta = {"extra": {"config": {"steps": 300}}}
    stopped = train.ResumePoint("runs/x.partial", "runs/x.partial/checkpoints", 25, meta)
    with pytest.raises(train.UsageError, match=r"checkpoint step 25 is past --steps 10: leave --steps out "
                                                r"\(the run's: 300\) or pass --steps >= 25$") as e:
        train.check_resume_steps(stopped, 10)
    assert "\n" not in str(e.value)
    for steps in (25, 26, 300):
        train.check_resume_steps(stopped, steps)  # finish, or train on
    finished = train.ResumePoint("runs/x", "runs/x/checkpoints", 25, meta)
    for steps in (10, 25):
        with pytest.raises(train.UsageError, match="it is a finished run"):
            train.check_resume_steps(finished, steps)
    train.check_resume_steps(finished, 26)


def test_mixed_dtype_model_refusal_says_what_each_compute_dtype_trains():
    """My model has a bfloat16 leaf (a norm scale) among float32 ones: ``offload`` said only
    ``the parameters have dtypes ['bfloat16', 'float32']: pass compute_dtype=``, and with
    ``compute_dtype=jnp.float32`` it trained (silently) the model with that leaf in float32: losses
    1.6e-4 relative off NnxOptimizer on the same model (which keeps the leaf bf16) by step 3. Right:
    the refusal names a leaf of each dtype and says what each choice trains; and the float32 choice
    does train the all-float32 model (equal to nnx.Optimizer on it)."""
    import optax
    from flax import nnx
    Net, loss_fn, batches = _tiny_nnx()

    def mixed(rngs):
        m = Net(rngs)
        m.out.bias.value = m.out.bias.value.astype(jnp.bfloat16)
        return m

    with pytest.raises(ValueError, match=r"dtypes \['bfloat16', 'float32'\] \(out/bias is bfloat16, blocks/0/fc/bias is "
                                         r"float32\) and the step computes in one: pass compute_dtype=jnp.float32 "
                                         r"\(every leaf computed in float32") as e:
        cj.offload(mixed(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    assert "\n" not in str(e.value)
    st = cj.offload(mixed(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min",
                    compute_dtype=jnp.float32)
    ref = Net(nnx.Rngs(0))  # the same init, the bias's bf16 rounding kept, as a float32 leaf
    ref.out.bias.value = ref.out.bias.value.astype(jnp.bfloat16).astype(jnp.float32)
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(m, o, b):
        loss, g = nnx.value_and_grad(loss_fn)(m, b)
        o.update(m, g)
        return loss

    got = [float(st(b)) for b in batches]
    want = [float(ref_step(ref, opt, b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_train_job_started_with_sigint_ignored_says_how_to_stop_it(monkeypatch, default_sigint):
    """``python -m experiments.train ... &`` from a shell script: the shell starts it with SIGINT
    ignored, so ``kill -INT`` (what Ctrl-C sends) did nothing, silently; 20 s later it was still
    training. Right: the job says at its start that it ignores SIGINT and to use ``kill -TERM <pid>``
    (which keeps the checkpoint); with SIGINT as usual it says nothing (:func:`experiments.train.interrupt_note`)."""
    import os
    from experiments import train
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN if s == signal.SIGINT else signal.SIG_DFL)
    note = train.interrupt_note()
    assert note.startswith("note: SIGINT") and f"kill {os.getpid()}" in note and "SIGTERM" in note
    assert "\n" not in note
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.default_int_handler)
    assert train.interrupt_note() is None
