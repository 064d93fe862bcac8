"""An interrupted step never leaves a silently mixed state (helper ``ctrlc22``): with host chunks
updated in place without waiting for the global norm (no clipping, skip or loss scaling), a
Ctrl-C in the backward completes the step exactly as an uninterrupted one would (signals held from
the first in-place host update to the end of the commit), and any other exception after that
update started marks the state so that its next use raises :class:`chunkjax.PartialStepError`.

Each test compares with an uninterrupted twin bit for bit."""
import signal

import jax
import numpy as np
import pytest

import chunkjax as cj
from tests.test_disk_tier import setup  # noqa: F401 (the fixture: a 3-layer micro GPT)
from tests.test_fresh22 import _masters, _tiny_nnx


def _pair(spec):
    from flax import nnx
    Net, loss_fn, batches = _tiny_nnx()
    twin = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    st = cj.offload(Net(nnx.Rngs(3)), spec, loss_fn, batches[0], device_budget="min", chunk_size=32)
    assert st.step.host_chunks and (st.step.device_chunks or st.step.streamed_chunks), st.step.schedule.counts()
    assert float(st(batches[0])) == float(twin(batches[0]))
    return Net, batches, twin, st


def _first_hand_over_then(monkeypatch, act):
    """``HostWork.hand_over`` patched: the first call hands its gradients over (the host thread
    updates them in place), then runs ``act()`` in the main thread, inside the backward."""
    from chunkjax.host_work import HostWork
    real, calls = HostWork.hand_over, []

    def hand_over(self, *a, **k):
        real(self, *a, **k)
        calls.append(1)
        if len(calls) == 1:
            act()
    monkeypatch.setattr(HostWork, "hand_over", hand_over)
    return lambda: monkeypatch.setattr(HostWork, "hand_over", real)


def test_ctrl_c_in_the_backward_with_host_updates_not_waiting_for_the_norm_completes_the_step(
        monkeypatch, default_sigint):
    """fresh22 left it open: host AdamW without clipping (``AdamW(3e-3)``) updates each host chunk
    in place as its gradient arrives, no backup kept; a Ctrl-C later in the backward raised with
    those chunks updated and the device chunks and ``metrics`` as before, and a loop retrying the
    batch trained on that mix, silently (loss 5.243 against 5.297 at step 3). Right: from the first
    in-place host update the signal waits for the commit, the step ends as an uninterrupted one
    (equal to a twin bit for bit), then KeyboardInterrupt is raised with the note that the step is
    applied."""
    from chunkjax.host_update import AdamW
    Net, batches, twin, st = _pair(AdamW(1e-2, weight_decay=0.1))
    want = float(twin(batches[1]))
    before = st.metrics
    undo = _first_hand_over_then(monkeypatch, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as e:
        st(batches[1])
    undo()
    assert st.metrics is not before and float(st.metrics["loss"]) == want  # the step committed
    assert any("the step is applied" in n for n in getattr(e.value, "__notes__", ()))
    st.wait()
    twin.wait()
    for a, b in zip(_masters(st), _masters(twin), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(st(batches[2])) == float(twin(batches[2]))  # and it trains on
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing left holding Ctrl-C


def test_error_in_the_backward_after_an_in_place_host_update_refuses_the_state(monkeypatch, tmp_path):
    """The same step with an exception (not a signal) in the backward after a host chunk took its
    update in place: it cannot be undone (no backup), and the next step trained on the mix
    silently. Right: the error is raised, then every use of the state raises PartialStepError (one
    line: restore the last checkpoint); restored, the run equals the twin bit for bit."""
    from flax import nnx
    from chunkjax.host_update import AdamW
    Net, batches, twin, st = _pair(AdamW(1e-2, weight_decay=0.1))
    cj.save_checkpoint(tmp_path / "ck", 1, st)
    want = float(twin(batches[1]))

    def fail():
        raise RuntimeError("injected: a program failed")
    undo, term = _first_hand_over_then(monkeypatch, fail), signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="injected"):
        st(batches[1])
    undo()
    assert signal.getsignal(signal.SIGTERM) is term  # the step's signal hold ended with the error
    for use in (lambda: st(batches[1]), lambda: st.sync(Net(nnx.Rngs(3))), lambda: st.evaluate(batches[1])):
        with pytest.raises(cj.PartialStepError, match=r"half updated.*RuntimeError: injected.*restore the last "
                                                      r"checkpoint") as e:
            use()
        assert "\n" not in str(e.value)
    cj.restore_checkpoint(tmp_path / "ck", st)
    assert float(st(batches[1])) == want
    st.wait()
    twin.wait()
    for a, b in zip(_masters(st), _masters(twin), strict=True):
        np.testing.assert_array_equal(a, b)


def test_ctrl_c_after_an_early_storage_send_completes_the_step(monkeypatch, default_sigint, tmp_path, setup):
    """Storage chunks on the early path (AdamW without clipping) send their gradients to the
    workers as the programs end, before the norm; the workers' new params land in the state's
    pinned buffers while the files stay at the committed step until the step commits. A Ctrl-C
    right after such a send raised from ``begin`` and abandoned the disk step, leaving host chunks
    handed over and any storage params already written ahead of their files. Right: the signal
    waits for the commit (a caller that stores inside ``interrupts_deferred``), the step ends as an
    uninterrupted one: master params, the storage files and the next step equal a twin bit for bit."""
    from chunkjax.host_update import AdamW
    from chunkjax.storage.updater import StorageOptions, StorageRun
    from chunkjax.step_commit import interrupts_deferred
    from tests.test_disk_tier import _three_tier_schedule
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    disk_c = [c for c, u in enumerate(sched.update_locations) if u == "storage"]
    assert disk_c and "host" in sched.update_locations
    spec = AdamW(3e-3, weight_decay=0.1)

    def make(d):
        step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jax.numpy.float32,
                                    storage=StorageOptions((str(d / "a"), str(d / "b")), fsync=False,
                                                           early_updates=True))
        st, _ = step(step.init(params), batches[0])
        return step, st

    (tw, tst), (step, st) = make(tmp_path / "t"), make(tmp_path / "i")
    tst, tm = tw(tst, batches[1])
    real, calls = StorageRun.on_program, []

    def on_program(self, grads):
        sent = self.sends_early(grads)
        real(self, grads)
        if sent and not calls:
            calls.append(1)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C right after the first early storage send
    monkeypatch.setattr(StorageRun, "on_program", on_program)
    m = None
    with pytest.raises(KeyboardInterrupt):
        pending = step.begin(st, batches[1])
        with interrupts_deferred():  # stores the new state before the held Ctrl-C is delivered
            st, m = pending.commit()
    monkeypatch.setattr(StorageRun, "on_program", real)
    assert calls and m is not None and float(m["loss"]) == float(tm["loss"])  # the step committed
    got, ref = (jax.tree.map(np.asarray, s.master_params(x)) for s, x in ((step, st), (tw, tst)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    for c in disk_c:
        for a, b in zip(st.master[c].read(c), tst.master[c].read(c), strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    (st, m), (tst, tm) = step(st, batches[2]), tw(tst, batches[2])
    assert float(m["loss"]) == float(tm["loss"])  # and it trains on
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing left holding Ctrl-C
    st.master[disk_c[0]].close()
    tst.master[disk_c[0]].close()


def _dropin_pair():
    """Two equal ChunkedOptimizers with device, streamed and host chunks (host AdamW without
    clipping), the params and a gradient function."""
    import jax.numpy as jnp
    from chunkjax.host_update import AdamW
    rng = np.random.default_rng(22)
    sizes = dict(a=150, b=40, c=100, d=64, e=30, f=128, g=90)
    params = {k: jnp.asarray(rng.normal(size=(n,)), jnp.float32) for k, n in sizes.items()}
    target = {k: jnp.asarray(rng.normal(size=(n,)), jnp.float32) for k, n in sizes.items()}
    grad_fn = jax.jit(jax.grad(lambda p: sum(jnp.sum(jnp.sin(p[k] - target[k]) * (p[k] - target[k])) for k in p)))
    spec = AdamW(1e-2, weight_decay=0.1)
    probe = cj.ChunkedOptimizer(params, spec, device_budget="1GiB", chunk_size=64)
    state = probe.device_state_bytes // probe.layout.n_chunks
    make = lambda: cj.ChunkedOptimizer(params, spec, device_budget=probe.working_bytes + 2 * state + 2 * 4 * 64,  # noqa: E731
                                       chunk_size=64, host_chunks=6, pipeline_depth=2)
    a, b = make(), make()
    assert a.host_chunks and a.streamed_chunks and a.placement.state_kinds.count("device") >= 1, a.summary()
    return a, b, params, grad_fn


def _patch_kernel(monkeypatch, act):
    """``dropin.host_chunk_step`` (the host kernel, on the update's kernel thread) patched: its
    first call updates its chunk, then runs ``act()``; and ``DuplexUpdate.start`` returns only once
    that has happened (at most 60 s), so ``act`` lands at one point every run: after the update's
    threads started and updated a host chunk, before the caller dispatched any other chunk's
    update (session 22's failures: a Ctrl-C sent by the kernel thread landed before or after the
    update's signal hold started, by timing)."""
    import threading
    from chunkjax import dropin, duplex
    real, real_start, calls, acted = dropin.host_chunk_step, duplex.DuplexUpdate.start, [], threading.Event()

    def kernel(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == 1:
            try:
                act()
            finally:
                acted.set()

    def start(self):
        out = real_start(self)
        assert acted.wait(60), "the first host kernel did not run"
        return out
    monkeypatch.setattr(dropin, "host_chunk_step", kernel)
    monkeypatch.setattr(duplex.DuplexUpdate, "start", start)

    def undo():
        monkeypatch.setattr(dropin, "host_chunk_step", real)
        monkeypatch.setattr(duplex.DuplexUpdate, "start", real_start)
    return undo


def _same_master(a, b):
    for k, x in a.master_params().items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(b.master_params()[k]), err_msg=k)


def test_dropin_ctrl_c_during_an_update_completes_it(monkeypatch, default_sigint):
    """ChunkedOptimizer.update updates its chunks in place one after another (device chunks
    donated, host chunks by the host kernel, streamed ones written back): a Ctrl-C midway left
    some chunks updated, the others and the step count not, and the next update trained on that
    mix silently. Right: the Ctrl-C waits for the whole update, then KeyboardInterrupt says the
    update is applied; the master params equal an uninterrupted twin's bit for bit, and so do the
    next updates."""
    opt, twin, params, grad_fn = _dropin_pair()
    p = opt.update(grad_fn(params))
    assert all(np.array_equal(p[k], v) for k, v in twin.update(grad_fn(params)).items())
    g = grad_fn(p)
    q = twin.update(g)
    undo = _patch_kernel(monkeypatch, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as e:
        opt.update(g)
    undo()
    assert opt.step == twin.step == 2
    _same_master(opt, twin)
    assert any("optimizer took the update" in n for n in getattr(e.value, "__notes__", ()))
    p = opt.update(grad_fn(q))
    q = twin.update(grad_fn(q))
    for k in q:
        np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(q[k]), err_msg=k)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_dropin_error_during_an_update_refuses_the_optimizer(monkeypatch, tmp_path):
    """The same update with an exception (not a signal) after the first host chunk's kernel ran:
    some chunks updated, others not. Right: the error is raised, then every later use raises
    PartialStepError (one line: restore the last checkpoint); restored, it equals the twin."""
    from chunkjax import checkpoint as ck
    opt, twin, params, grad_fn = _dropin_pair()
    p = opt.update(grad_fn(params))
    twin.update(grad_fn(params))
    ck.save_checkpoint(tmp_path, 1, opt)
    g = grad_fn(p)

    def fail():
        raise RuntimeError("injected: the kernel failed")
    undo, term = _patch_kernel(monkeypatch, fail), signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="injected"):
        opt.update(g)
    undo()
    assert signal.getsignal(signal.SIGTERM) is term  # the update's signal hold ended with the error
    for use in (lambda: opt.update(g), opt.master_params, opt.wait, lambda: ck.save_checkpoint(tmp_path / "no", 2, opt)):
        with pytest.raises(cj.PartialStepError, match=r"half updated: an update failed midway \(RuntimeError: "
                                                      r"injected.*restore the last checkpoint") as e:
            use()
        assert "\n" not in str(e.value)
    ck.restore_checkpoint(tmp_path, opt)
    p, q = opt.update(g), twin.update(g)
    for k in q:
        np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(q[k]), err_msg=k)
    _same_master(opt, twin)


def test_nnx_optimizer_ctrl_c_during_an_update_updates_the_model_too(monkeypatch, default_sigint):
    """NnxOptimizer: the Ctrl-C held through the optimizer's update is delivered once the model
    took the new params too (not between the two: the model would be a step behind its
    optimizer). Its params then equal an uninterrupted twin's bit for bit."""
    from flax import nnx
    from chunkjax.host_update import AdamW
    Net, loss_fn, batches = _tiny_nnx()
    models = [Net(nnx.Rngs(3)) for _ in range(2)]
    probe = cj.NnxOptimizer(Net(nnx.Rngs(3)), AdamW(1e-2, weight_decay=0.1), device_budget="1GiB", chunk_size=32).chunked
    budget = probe.working_bytes + 2 * (probe.device_state_bytes // probe.layout.n_chunks) + 2 * 4 * 32
    opts = [cj.NnxOptimizer(m, AdamW(1e-2, weight_decay=0.1), device_budget=budget, chunk_size=32, host_chunks=2)
            for m in models]
    assert opts[0].chunked.host_chunks and len(opts[0].chunked.host_chunks) < opts[0].chunked.layout.n_chunks
    grads = nnx.grad(loss_fn)(models[1], batches[0])
    opts[1].update(models[1], grads)
    undo = _patch_kernel(monkeypatch, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as e:
        opts[0].update(models[0], nnx.grad(loss_fn)(models[0], batches[0]))
    undo()
    for a, b in zip(jax.tree.leaves(nnx.state(models[0], nnx.Param)), jax.tree.leaves(nnx.state(models[1], nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any("model and the optimizer took it" in n for n in getattr(e.value, "__notes__", ()))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing left holding Ctrl-C
