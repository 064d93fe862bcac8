"""What a new user found trying chunkjax with their own small NNX model (helper ``newuser``).

Each test asserts the right value or behaviour against a reference (plain optax, float32 on the
CPU) where it is numeric. A test of a failure not fixed here is ``xfail(strict=True)`` with the
exact reason, so the lead can assign it."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj


def _lnf_mask(tree):
    """A mask by leaf name, as a user writes it: weight decay on the final layer norm only."""
    return jax.tree_util.tree_map_with_path(lambda path, x: "lnf" in jax.tree_util.keystr(path), tree)


def _masked_by_name():
    return optax.chain(optax.masked(optax.add_decayed_weights(0.5), _lnf_mask), optax.sgd(1e-2))


def test_mask_by_a_leaf_name_outside_the_probe_tree_is_refused():
    """A mask by a name the elementwise probe's tree does not have ('lnf') passed the probe, and
    the chunks (flat arrays with no names) then never got the masked transformation: the run
    silently trained without the decay (my decoder: loss 1.5e-3 relative off nnx.Optimizer after 4
    steps, the final layer norm's scale 3.5e-2 off). The README promises such masks are refused."""
    params = {"w": jnp.ones((4, 3)), "lnf": jnp.ones((3,))}
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
    ref_upd, _ = _masked_by_name().update(grads, _masked_by_name().init(params), params)
    np.testing.assert_allclose(ref_upd["lnf"], -1e-2 * (0.1 + 0.5), rtol=1e-6)  # decayed on the whole tree
    np.testing.assert_allclose(ref_upd["w"], -1e-2 * 0.1, rtol=1e-6)
    with pytest.raises(ValueError, match="not elementwise") as e:
        cj.ChunkedOptimizer(params, _masked_by_name(), device_budget="1GiB")
    assert "\n" not in str(e.value)
    for tx in (optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: True, p)),
               optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(1e-2)},
                                     lambda p: jax.tree_util.tree_map_with_path(
                                         lambda k, x: "b" if "lnf" in jax.tree_util.keystr(k) else "a", p))):
        with pytest.raises(ValueError, match="not elementwise"):
            cj.ChunkedOptimizer(params, tx, device_budget="1GiB")


# ---- the main job (experiments/train.py) ----

def test_out_dir_the_filesystem_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    """``--out-dir`` on a folder that exists but where the filesystem refuses a new folder (as
    root on /sys/kernel: os.access says writable) gave a PermissionError traceback and exit 1,
    after the model was loaded and fitted. Right: exit 2, one line, nothing written."""
    import os
    from experiments import train
    out = tmp_path / "ro"
    out.mkdir()
    real_mkdir = os.mkdir

    def refusing_mkdir(path, *a, **k):
        if os.fspath(path).startswith(os.fspath(out)):
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    rc = train.main(["--init-from", "tests/fixtures/hf_llama3", "--steps", "2", "--batch", "2", "--seq", "16",
                     "--out-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--out-dir" in err[0] and "not writable" in err[0], err
    assert list(out.iterdir()) == []


def test_resume_past_a_corrupt_newest_checkpoint_can_save_that_step_again(tmp_path):
    """``--resume`` of a run whose newest checkpoint (step 4) is corrupt restores step 2, as
    documented, but the resumed run then died at step 4 ("checkpoint step 4 already exists"), exit
    1, and its advice (resume again) failed the same way forever. Right: the skipped checkpoint is
    out of the way when the resumed run starts, and saving step 4 again succeeds."""
    import warnings
    from chunkjax import checkpoint as ck
    from experiments import train
    run = tmp_path / "20260101-000000-mine.partial"
    ckpt = run / train.CHECKPOINT_DIR
    ckpt.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "tokens": 0}\n')
    opt = cj.ChunkedOptimizer({"w": jnp.ones((64,)), "b": jnp.zeros((8,))}, optax.adam(1e-2), device_budget="1GiB")
    for n in (2, 4):
        opt.update({"w": jnp.ones((64,)), "b": jnp.ones((8,))})
        ck.save_checkpoint(ckpt, n, opt, extra={"config": {"steps": 6}, "data_position": n, "step": n})
    victim = max((p for p in (ckpt / "step_00000004").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "checkpoint step 4 skipped"
        rp = train.find_resume_point(str(run))
    assert rp.step == 2
    train.drop_skipped_checkpoints(rp.ckpt_dir, rp.step)  # what the resumed run does before its first step
    ck.save_checkpoint(ckpt, 4, opt, extra={"config": {"steps": 6}, "data_position": 4, "step": 4})
    assert ck.latest_step(ckpt) == 4 and ck.all_steps(ckpt) == [2, 4]


# ---- the front door (chunkjax.offload) ----

def _tiny_nnx(width: int = 8, dropout: bool = True):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(width, width, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs) if dropout else (lambda x: x)

        def __call__(self, x):
            return x + self.drop(jnp.tanh(self.fc(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(4, width, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.out = nnx.Linear(width, 1, rngs=rngs)

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


def test_offloaded_step_checkpoints_and_resumes_exactly(tmp_path):
    from flax import nnx
    Net, loss_fn, batches = _tiny_nnx()
    first = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    for b in batches[:2]:
        first(b)
    cj.save_checkpoint(tmp_path, 2, first)
    want = [float(first(b)) for b in batches[2:]]  # the uninterrupted run
    second = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    cj.restore_checkpoint(tmp_path, second)
    assert [float(second(b)) for b in batches[2:]] == want


def test_offloaded_step_restore_of_another_checkpoint_is_one_line_and_changes_nothing(tmp_path):
    """Restoring a checkpoint of another model (a leaf of another shape), of a model whose loss
    changes no non-parameter state (no dropout), or of another optimizer into an OffloadedStep:
    one line naming what differs, and the step keeps its state and trains on."""
    from flax import nnx
    from chunkjax.checkpoint import CheckpointError
    Net, loss_fn, batches = _tiny_nnx()
    saved = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    saved(batches[0])
    cj.save_checkpoint(tmp_path, 1, saved)
    nodrop = _tiny_nnx(dropout=False)[0]
    cases = [(_tiny_nnx(width=6)[0], optax.adam(1e-2), r"another parameter tree: leaf blocks/0/fc/bias is \(8,\) float32 in the checkpoint but \(6,\)"),
             (nodrop, optax.adam(1e-2), r"non-parameter state 'blocks/0/drop/rngs/count', which this model's loss"),
             (Net, optax.sgd(1e-2, momentum=0.9), r"optimizer moments \['mu', 'nu'\] .* \['trace'\]")]
    for make, tx, msg in cases:
        other = cj.offload(make(nnx.Rngs(1)), tx, loss_fn, batches[0], device_budget="min", check_compiled=False)
        before = jax.tree.map(np.asarray, other.step.master_params(other.state))
        state, side = other.state, other._side
        with pytest.raises(CheckpointError, match=msg) as e:
            cj.restore_checkpoint(tmp_path, other)
        assert "\n" not in str(e.value)
        assert other.state is state and other._side is side
        for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, other.step.master_params(other.state))),
                        jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
        assert np.isfinite(float(other(batches[1])))
        if make is nodrop:  # and the other way round
            cj.save_checkpoint(tmp_path / "nodrop", 1, other)
            with pytest.raises(CheckpointError, match=r"non-parameter state 'blocks/0/drop/rngs/count' of this model "
                                                      r"is not in checkpoint step 1 in .*nodrop \(0 vs 2 leaves\)"):
                cj.restore_checkpoint(tmp_path / "nodrop", saved)


def test_chunked_step_interrupted_before_or_during_its_commit_keeps_a_usable_state(monkeypatch, default_sigint):
    """The main job's kind (a ChunkedStep called directly, ``state, m = step(state, b)``): Ctrl-C
    while the streamed pipeline finishes (after the backward) left the input state's device
    chunks donated and the pipeline's threads waiting. Right: the input state as it was, every
    thread ended; and a Ctrl-C during the commit (the donating device updates) is held until the
    front door's step has stored the new state."""
    import signal
    import threading
    from flax import nnx
    from chunkjax import streamed
    from chunkjax.updaters import Updater
    Net, loss_fn, batches = _tiny_nnx()
    st = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="auto", chunk_size=32)
    step, state = st.step, st.state
    assert step.device_chunks and step.streamed_chunks
    before = jax.tree.map(np.asarray, step.master_params(state))

    def interrupted_close(self):
        raise KeyboardInterrupt  # the pipeline's threads still wait for chunks

    real_close = streamed.Pipeline.close
    monkeypatch.setattr(streamed.Pipeline, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt):
        step(state, st._step_batch(batches[1]))
    monkeypatch.setattr(streamed.Pipeline, "close", real_close)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("chunkjax-streamed")]
    assert not alive, alive
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, step.master_params(state))), jax.tree.leaves(before),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    new, m = step(state, st._step_batch(batches[1]))  # the input state trains on
    assert np.isfinite(float(m["loss"]))
    st.state = new

    real = step.updaters["device"]

    def ctrl_c_on_dispatch(pk):
        fn = real.update(pk)

        def dispatch(*args):
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the commit dispatches the donating updates
            return fn(*args)
        return dispatch

    monkeypatch.setitem(step.updaters, "device", Updater(real.init, ctrl_c_on_dispatch))
    was = jax.tree.map(np.asarray, step.master_params(st.state))
    with pytest.raises(KeyboardInterrupt):
        st(batches[2])
    monkeypatch.setitem(step.updaters, "device", real)
    assert not any(a.is_deleted() for a in jax.tree.leaves(st.state.params))  # the committed state, stored
    now = jax.tree.map(np.asarray, step.master_params(st.state))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(was)))
    assert np.isfinite(float(st(batches[3])))

    # compute params an interrupted step donated (an early-streamed chunk's, on the device) come
    # back from the chunk's master params, bit for bit
    from chunkjax.step_commit import recover
    st.wait()
    c = step.device_chunks[0]
    want = np.asarray(st.state.params[c])
    st.state.params[c].delete()
    got = recover(step, st.state)
    np.testing.assert_array_equal(np.asarray(got.params[c]), want)
    assert all(got.params[k] is st.state.params[k] for k in range(len(got.params)) if k != c)
    assert recover(step, got) is got


def test_scanned_blocks_with_a_constant_in_the_carry():
    """A scanned block whose carry starts as a constant (``(x, jnp.zeros(()))``: an auxiliary sum
    beside the residual stream) crashed discovery with ``TypeError: unhashable type: 'Literal'``
    (the jaxpr holds the zero as a literal). Right: stages found, losses equal nnx.Optimizer's."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, xa):
            x, aux = xa
            h = jnp.tanh(self.fc(x))
            return x + h, aux + jnp.mean(h ** 2)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(4, 8, rngs=rngs)

            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)
            self.layers = make(rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(xa, layer):
                return layer(xa)
            x, aux = body((self.inp(x), jnp.zeros((), jnp.float32)), self.layers)
            return self.out(x)[:, 0], aux

    def loss_fn(model, batch):
        pred, aux = model(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2) + 1e-2 * aux

    keys = jax.random.split(jax.random.key(1), 3)
    batches = [{"x": jax.random.normal(k, (8, 4)), "y": jax.random.normal(k, (8,))} for k in keys]
    ref_model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    want = [float(ref_step(ref_model, opt, b)) for b in batches]
    step = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    assert [s.name for s in step.stages] == ["pre", "block_0", "block_1", "block_2", "post"]
    np.testing.assert_allclose([float(step(b)) for b in batches], want, rtol=1e-5)


def test_nnx_optimizer_integer_param_message_names_wrt():
    """An integer ``nnx.Param`` (a step id kept in the model) refused by ``NnxOptimizer`` said
    "pass only the trainable params (nnx.state(model, nnx.Param) ...)": what it had just done. Right:
    the message names the ``wrt=`` filter that works, and that filter trains."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(3, 2, rngs=rngs)
            self.step_id = nnx.Param(jnp.array(7, jnp.int32))

    with pytest.raises(TypeError, match=r"leaf 'step_id/value' has dtype int32: .*wrt="):
        cj.NnxOptimizer(Net(nnx.Rngs(0)), optax.sgd(0.1), device_budget="1GiB")
    floats = nnx.All(nnx.Param, lambda path, x: jnp.issubdtype(x.dtype, jnp.floating))
    opt = cj.NnxOptimizer(Net(nnx.Rngs(0)), optax.sgd(0.1), wrt=floats, device_budget="1GiB")
    assert opt.chunked.layout.n_chunks >= 1


@pytest.mark.parametrize("steps", [1, 6])
def test_job_without_warmup_steps_at_lr_from_the_first_step(steps):
    """``--warmup 0`` gave the first update learning rate 0 (a one-step ramp from 0: the first step
    changed no parameter), and with ``--steps 1`` the job died ("cosine_decay_schedule requires
    positive decay_steps"). Right: no warm-up means the first update is plain AdamW's at ``--lr``
    (then the cosine decay to lr/10 at ``--steps``)."""
    from experiments import train
    cfg = dataclasses.replace(train.TrainConfig(), lr=1e-2, warmup=0, steps=steps, weight_decay=0.1, clip=0.0)
    tx = train.host_spec(cfg).optax()
    params = {"w": jnp.arange(1.0, 7.0)}
    grads = {"w": jnp.linspace(-1.0, 1.0, 6)}
    ref = optax.adamw(1e-2, weight_decay=0.1)
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


def test_planner_factory_with_other_parameters_is_one_line(tmp_path, monkeypatch, capsys):
    """``python -m experiments.plan --model mymodel:loss_fn`` (a function of the module that is not
    a factory: it takes (model, batch)) died in a TypeError traceback, exit 1. Right: exit 2 and
    one line saying what parameters the factory must take."""
    from experiments import plan as plan_cli
    (tmp_path / "usermodels_nr.py").write_text("def loss_fn(model, batch):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = plan_cli.main(["--model", "usermodels_nr:loss_fn", "--batch", "4", "--seq", "16", "--device-budget", "1MiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "factory" in err[0] and "batch and seq" in err[0], err


def test_schedule_plot_title_fits_the_figure(tmp_path):
    """The schedule figure's title (budget, the chunk counts per kind as a dict, fetches, programs)
    ran off the figure's left edge with three kinds of chunks ("edule at 593 KiB: {'params_..."):
    Right: the whole title inside the figure."""
    from chunkjax import plots
    from chunkjax.host_update import AdamW
    from models import gpt
    cfg = gpt.get_config("micro")
    f = cj.fit_step(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((4, 33), jnp.int32),
                    host_optimizer=AdamW(3e-4), device_budget=4 * 2**20)
    assert len(f.report.schedule.counts()) >= 2
    fig = plots.plot_schedule(f, path=tmp_path / "schedule.png")
    fig.canvas.draw()
    box, page = fig.axes[0].title.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (box, page)


# ---- Ctrl-C ----

@pytest.mark.parametrize("where", ["start", "submit"])
def test_ctrl_c_while_a_streamed_pipeline_starts_leaves_no_thread_waiting(monkeypatch, where):
    """Ctrl-C in my NnxOptimizer loop (1 in 3 tries): the KeyboardInterrupt landed while the
    drop-in's update started its threads (or handed chunks over), and the threads that had
    started waited for chunks forever; they are not daemons, so the interpreter never exited
    (a hung terminal after Ctrl-C). Right: every started thread ends (chunkjax.duplex)."""
    import threading
    from chunkjax import duplex
    started = []
    real_start = threading.Thread.start

    def start(self):
        if where == "start" and len(started) == 2:
            raise KeyboardInterrupt
        real_start(self)
        started.append(self)

    def update(c, x):  # "submit": the interrupt lands while the first chunk's update is handed over
        if where == "submit":
            raise KeyboardInterrupt
        return (x,)

    monkeypatch.setattr(threading.Thread, "start", start)
    run = duplex.DuplexUpdate([0, 1, 2], [3], 2, fetch=lambda c: (c,), update=update, store=lambda c, x: None,
                              send_grads=lambda c: c, kernel=lambda c, g: None, send_params=lambda c: c)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert started
    for t in started:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in started), [t.name for t in started if t.is_alive()]


def test_offloaded_step_survives_ctrl_c_mid_step(monkeypatch):
    from flax import nnx
    from chunkjax import streamed
    Net, loss_fn, batches = _tiny_nnx()
    st = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="auto", chunk_size=32)
    assert "device" in st.schedule.update_locations and "streamed" in st.schedule.update_locations
    st(batches[0])
    before = jax.tree.map(np.asarray, st.step.master_params(st.state))
    real = streamed.StepStream.finish

    def interrupted(self, *a, **k):  # Ctrl-C after the device chunks' updates are dispatched
        self.pipe.abort()  # (its threads ended: an interrupted finish() leaves them waiting, the process hangs at exit)
        raise KeyboardInterrupt

    monkeypatch.setattr(streamed.StepStream, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        st(batches[1])
    monkeypatch.setattr(streamed.StepStream, "finish", real)
    after = jax.tree.map(np.asarray, st.step.master_params(st.state))  # the state before the interrupted step
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(float(st(batches[1])))


def test_offload_micro_batches_below_one_is_one_line():
    from flax import nnx
    Net, loss_fn, batches = _tiny_nnx(dropout=False)
    with pytest.raises(ValueError, match=r"micro_batches=0: pass an int >= 1") as e:
        cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min", micro_batches=0)
    assert "\n" not in str(e.value)


def test_checkpoint_directory_that_cannot_be_created_is_one_line(tmp_path):
    from flax import nnx
    from chunkjax.checkpoint import CheckpointWriteError
    Net, loss_fn, batches = _tiny_nnx()
    step = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min")
    step(batches[0])
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where, msg in ((afile, "is a file, not a directory"), (afile / "sub", "cannot be created")):
        with pytest.raises(CheckpointWriteError, match=msg + ".*give a directory this process can write") as e:
            cj.save_checkpoint(where, 1, step)
        assert "\n" not in str(e.value)
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_compute_dtype_spellings_are_the_planner_clis(tmp_path):
    """``compute_dtype="bf16"`` works in offload as ``--compute-dtype bf16`` does in the planner CLI
    (one parser); an unknown spelling is one line listing the accepted ones."""
    from flax import nnx
    from experiments.plan import step_options
    Net, loss_fn, batches = _tiny_nnx(dropout=False)
    step = cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min",
                      compute_dtype="bf16", check_compiled=False)
    assert step.problem.compute_dtype == jnp.bfloat16 == step_options("bf16")["compute_dtype"]
    assert np.isfinite(float(step(batches[0])))
    with pytest.raises(ValueError, match=r"compute_dtype='bf61': use jnp.bfloat16, .*'bf16'") as e:
        cj.offload(Net(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches[0], device_budget="min", compute_dtype="bf61")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"--compute-dtype 'bf61': use one of auto, bfloat16, bf16,"):
        step_options("bf61")


def test_ctrl_c_after_the_norm_with_host_clipping_ends_the_step_as_after_it(monkeypatch, default_sigint):
    """fresh20: host AdamW with clipping (host chunks take the global norm in place once it is
    known) and a Ctrl-C after the norm, before the commit, left host chunks updated and device
    chunks not: parameters matching neither the state before the step nor after it, silently.
    Right: from the moment host chunks may take the norm, the signal waits for the commit, so the
    step ends as after it (equal to an uninterrupted twin, bit for bit) and then raises."""
    import signal
    from flax import nnx
    from chunkjax.host_update import AdamW
    from chunkjax.storage import updater as disk
    Net, loss_fn, batches = _tiny_nnx(dropout=False)
    spec = AdamW(1e-2, max_grad_norm=1e-3)  # clipping fires: the host updates depend on the norm
    twin = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    st = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    assert st.step.host_chunks and (st.step.device_chunks or st.step.streamed_chunks), st.step.schedule.counts()
    real_send = disk.StorageRun.send

    def ctrl_c_after_the_norm(self, work, grads):
        signal.raise_signal(signal.SIGINT)  # the norm is known and handed to the host thread
        return real_send(self, work, grads)

    twin(batches[1])
    monkeypatch.setattr(disk.StorageRun, "send", ctrl_c_after_the_norm)
    with pytest.raises(KeyboardInterrupt):
        st(batches[1])
    monkeypatch.setattr(disk.StorageRun, "send", real_send)
    st.wait()
    twin.wait()
    got, want = (jax.tree.map(np.asarray, s.step.master_params(s.state)) for s in (st, twin))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(st(batches[2])) == float(twin(batches[2]))  # and it trains on


def test_error_after_the_norm_with_host_clipping_refuses_the_half_updated_state(monkeypatch, tmp_path):
    """ux21: host AdamW with clipping (host chunks take the global norm in place once it is known)
    and an exception (not a signal) after the norm, before the commit: host chunks were updated,
    device chunks not, and the next step trained on that mix silently. Right: the step's error is
    raised, then every use of the half-updated state (a step, a save, ``sync``, ``evaluate``)
    raises PartialStepError, one line saying to restore the last checkpoint; restored, the run
    continues equal to an untouched twin bit for bit. Both places the failure can come from are
    tried: after the norm is handed over (``StorageRun.send``) and while it is
    (``StorageRun.set_norm``, inside ``hand_norm``)."""
    from flax import nnx
    from chunkjax.host_update import AdamW
    from chunkjax.storage import updater as disk
    Net, loss_fn, batches = _tiny_nnx(dropout=False)
    spec = AdamW(1e-2, max_grad_norm=1e-3)  # clipping fires: the host updates depend on the norm
    twin = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    st = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    assert st.step.host_chunks and (st.step.device_chunks or st.step.streamed_chunks), st.step.schedule.counts()
    assert float(st(batches[0])) == float(twin(batches[0]))
    cj.save_checkpoint(tmp_path / "ck", 1, st)
    want = float(twin(batches[1]))
    real = {"send": disk.StorageRun.send, "set_norm": disk.StorageRun.set_norm}

    def fails_send(self, work, grads):
        raise OSError("injected: the disk went away")

    def fails_set_norm(self, norm):
        if norm is not None:  # the norm is known: the host thread already has it
            raise OSError("injected: the disk went away")
        return real["set_norm"](self, norm)

    for name, broken in (("send", fails_send), ("set_norm", fails_set_norm)):
        monkeypatch.setattr(disk.StorageRun, name, broken)
        with pytest.raises(OSError, match="injected"):
            st(batches[1])
        monkeypatch.setattr(disk.StorageRun, name, real[name])
        for use in (lambda: st(batches[1]), lambda: cj.save_checkpoint(tmp_path / "no", 2, st),
                    lambda: st.sync(Net(nnx.Rngs(3))), lambda: st.evaluate(batches[1]),
                    lambda: st.step.master_params(st.state)):
            with pytest.raises(cj.PartialStepError, match=r"half updated: a step failed after its global norm was "
                               r"known \(OSError: injected.*restore the last checkpoint") as e:
                use()
            assert "\n" not in str(e.value)
        assert not (tmp_path / "no").exists()  # nothing half-written either
        cj.restore_checkpoint(tmp_path / "ck", st)
        assert float(st(batches[1])) == want  # as the twin's second step
        cj.restore_checkpoint(tmp_path / "ck", st)  # back to step 1 for the next failure
    st(batches[1])
    got, ref = (jax.tree.map(np.asarray, s.step.master_params(s.state)) for s in (st, twin))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(st(batches[2])) == float(twin(batches[2]))  # and it trains on


def test_offload_micro_batches_mean_the_parts_and_the_token_mean_recipe_equals_optax():
    """ux21: with ``micro_batches`` a masked mean loss through ``offload`` is the mean of the
    micro-batches' means (README, offload's docstring), not the mean over every scored row of the
    batch (a WeightedLoss, which does that in chunkjax.fit_step, is refused by the front door).
    The documented recipe, the masked sum over the whole batch's count (a batch leaf) times the
    number of micro-batches, trains on the whole batch's mean: equal to optax on the full batch
    at float32 tolerance; the plain masked mean's loss is the mean of the two halves' means."""
    from flax import nnx
    Net, _, batches = _tiny_nnx(dropout=False)
    mask = jnp.asarray([1, 0, 0, 0, 1, 1, 1, 0], jnp.float32)  # 1 scored row in the first half, 3 in the second
    data = [dict(b, mask=mask, n=jnp.full((8,), jnp.sum(mask))) for b in batches[:3]]

    def sq(model, b):
        return (model(b["x"]) - b["y"]) ** 2 * b["mask"]

    def recipe(model, b):  # the mean over the whole batch's scored rows, whatever the micro-batches
        return jnp.sum(sq(model, b)) / b["n"][0] * 2

    def masked_mean(model, b):
        return jnp.sum(sq(model, b)) / jnp.sum(b["mask"])

    ref = Net(nnx.Rngs(5))
    halves = [float(masked_mean(ref, jax.tree.map(lambda a: a[h], data[0]))) for h in (slice(0, 4), slice(4, 8))]
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    want = []
    for b in data:
        loss, g = nnx.value_and_grad(masked_mean)(ref, b)
        opt.update(ref, g)
        want.append(float(loss))
    kw = dict(device_budget="min", micro_batches=2, check_compiled=False)  # nothing to check on the CPU
    st = cj.offload(Net(nnx.Rngs(5)), optax.adam(1e-2), recipe, data[0], **kw)
    np.testing.assert_allclose([float(st(b)) for b in data], want, rtol=1e-5)
    model = Net(nnx.Rngs(0))
    st.sync(model)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    plain = cj.offload(Net(nnx.Rngs(5)), optax.adam(1e-2), masked_mean, data[0], **kw)
    got = float(plain(data[0]))
    np.testing.assert_allclose(got, np.mean(halves), rtol=1e-5)
    assert abs(got - want[0]) > 1e-3 * abs(want[0])  # a mean of means, not the whole batch's mean
