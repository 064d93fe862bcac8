"""Checkpoints (issue 8, part 1): exact resume, restore into another schedule, refusal of another
layout, optimizer-state conversion, and faults (SIGKILL in the middle of a save, a full disk).

fp32 compute throughout, so "exact" can be checked bit for bit: resuming under the same schedule
gives the same losses and master params as the uninterrupted run; resuming under another schedule
(device AdamW through optax <-> host AdamW kernel) agrees to float32 rounding.
"""
import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax import portable
from chunkjax import host_update as hu
from chunkjax.host_update import AdamW
from chunkjax.optim import init_chunk_state, state_bytes_per_chunk
from chunkjax.schedule import Placement
from chunkjax.plan import plan_schedule
from models import gpt

B, T = 2, 16
N = 3  # save after N steps, compare steps N+1..2N
SPEC = AdamW(3e-3, weight_decay=0.1)
SEED = 1234


def build_setup(min_chunks=6):
    """Model, layout, batches and abstract stage traces (nothing compiled: params come from numpy,
    the traces' byte figures are zero, which a roomy budget does not need)."""
    cfg = gpt.get_config("micro", n_layers=3)
    rng = np.random.default_rng(SEED)
    shapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32) for _ in range(2 * N)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    layout = cj.build_layout(params, None, order, min_chunks=min_chunks)
    n = layout.n_chunks
    probe = cj.make_chunked_step(stages, layout, Placement(("device",) * n, ("device",) * n), tx=SPEC.optax())
    traces = probe.traces(batches[0])
    return cfg, params, batches, stages, layout, traces


def make_step(setup, resident, spec=SPEC):
    _, _, _, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1, resident=resident)
    return cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)


def run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    return state, losses


def assert_trees(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if tol:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def setup(request):
    if "training_child" in request.fixturenames or any(
            "training_child" in getattr(i, "fixturenames", ()) for i in request.session.items):
        request.getfixturevalue("training_child")  # start the child first (see training_child)
    return build_setup()


@pytest.fixture(scope="module")
def mixed_run(setup, tmp_path_factory):
    """Schedule with chunks 0, 1 resident (device AdamW) and the rest host-updated: trained 2N
    steps from the start, checkpoint saved after step N."""
    params, batches = setup[1], setup[2]
    step = make_step(setup, [0, 1])
    assert set(step.schedule.update_locations) == {"device", "host"}
    d = tmp_path_factory.mktemp("mixed")
    state = step.init(params)
    state, l1 = run(step, state, batches[:N])
    extra = {"rng": jax.random.key(7), "data_position": N, "config": {"model": "micro", "lr": 3e-3}}
    ck.save_checkpoint(d, N, step, state, extra)
    state, l2 = run(step, state, batches[N:])
    return step, d, state, l1 + l2, extra


@pytest.fixture(scope="module")
def host_run(setup, tmp_path_factory):
    """All chunks host-updated: the same 2N steps, checkpoint after step N."""
    params, batches = setup[1], setup[2]
    step = make_step(setup, [])
    assert set(step.schedule.update_locations) == {"host"}
    d = tmp_path_factory.mktemp("host")
    state = step.init(params)
    state, l1 = run(step, state, batches[:N])
    ck.save_checkpoint(d, N, step, state, {"data_position": N})
    state, l2 = run(step, state, batches[N:])
    return step, d, state, l1 + l2


def test_resume_is_exact(setup, mixed_run):
    """Restore step N into a fresh step object of the same schedule and continue to 2N: the same
    losses and master params, bit for bit; extra comes back (PRNG key typed)."""
    step, d, state, losses, extra = mixed_run
    assert ck.latest_step(d) == N and ck.all_steps(d) == [N]
    fresh = make_step(setup, [0, 1])
    restored, got_extra = ck.restore_checkpoint(d, fresh)
    assert got_extra["data_position"] == N and got_extra["config"] == extra["config"]
    np.testing.assert_array_equal(jax.random.key_data(got_extra["rng"]), jax.random.key_data(extra["rng"]))
    restored, l2 = run(fresh, restored, setup[2][N:])
    assert l2 == losses[N:]
    assert_trees(ck.export_params(fresh, restored), ck.export_params(step, state))


def test_restore_into_other_schedule(setup, mixed_run, host_run):
    """Device chunks restored onto the host (optax -> HostAdamState) and host chunks onto the
    device (HostAdamState -> optax): the continued runs agree to float32 rounding."""
    m_step, m_dir, m_state, m_losses, _ = mixed_run
    h_step, h_dir, h_state, h_losses = host_run
    np.testing.assert_allclose(m_losses, h_losses, rtol=1e-5)  # the two schedules agree at all
    # mixed checkpoint -> all-host schedule
    st, _ = ck.restore_checkpoint(m_dir, h_step)
    assert all(isinstance(o, hu.HostAdamState) for o in st.opt_state)
    assert [o.count for o in st.opt_state] == [N] * len(st.opt_state)
    st, l2 = run(h_step, st, setup[2][N:])
    np.testing.assert_allclose(l2, m_losses[N:], rtol=1e-6)
    assert_trees(ck.export_params(h_step, st), ck.export_params(m_step, m_state), rtol=1e-5, atol=1e-7)
    # all-host checkpoint -> mixed schedule
    st, extra = ck.restore_checkpoint(h_dir, m_step)
    assert extra == {"data_position": N}
    assert not isinstance(st.opt_state[0], hu.HostAdamState) and isinstance(st.opt_state[2], hu.HostAdamState)
    st, l2 = run(m_step, st, setup[2][N:])
    np.testing.assert_allclose(l2, h_losses[N:], rtol=1e-6)
    assert_trees(ck.export_params(m_step, st), ck.export_params(h_step, h_state), rtol=1e-5, atol=1e-7)


def test_export_params(setup, mixed_run):
    """export_params is the master params pytree in float32 numpy; the checkpoint export equals it."""
    step, d, state, _, _ = mixed_run
    out = ck.export_params(step, state)
    assert jax.tree.structure(out) == jax.tree.structure(setup[1])
    assert all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in jax.tree.leaves(out))
    assert_trees(out, step.master_params(state))
    restored, _ = ck.restore_checkpoint(d, step)
    assert_trees(ck.export_checkpoint_params(d, step.layout), ck.export_params(step, restored))


def test_other_layout_remapped(setup, mixed_run):
    """A different chunk layout (another chunk size and count) restores leaf by leaf: the same
    master params and step counts (host and device chunks of the checkpoint mixed into new
    chunks); tests/test_checkpoint_zero.py trains on after such restores."""
    _, d, _, _, _ = mixed_run
    other = build_setup(min_chunks=3)
    n = other[4].n_chunks
    assert other[4].chunk_size != setup[4].chunk_size
    step = cj.make_chunked_step(other[3], other[4], Placement(("device",) * n, ("device",) * n), tx=SPEC.optax(),
                                compute_dtype=jnp.float32)
    st, extra = ck.restore_checkpoint(d, step)
    assert extra["data_position"] == N and len(st.master) == n
    assert [portable.optax_to_portable(o, other[4].chunk_size)[0] for o in st.opt_state] == [N] * n
    assert_trees(ck.export_params(step, st), ck.export_checkpoint_params(d, setup[4]))


def test_other_optimizer_refused(setup, mixed_run):
    """AdamW moments cannot become Lion state (device or host): a clear error before any read."""
    _, d, _, _, _ = mixed_run
    for resident in ([], [0]):
        step = make_step(setup, resident, spec=hu.Lion(1e-3))
        with pytest.raises(ck.CheckpointError, match=r"moments \['mu', 'nu'\].*Lion|moments \['mu', 'nu'\].*\['mu'\]"):
            ck.restore_checkpoint(d, step)


@pytest.mark.parametrize("spec", [AdamW(optax.linear_schedule(1e-3, 0.0, 10), max_grad_norm=1.0), hu.Lion(1e-3),
                                  hu.SGDMomentum(1e-2, weight_decay=1e-4)], ids=["adamw_sched_clip", "lion", "sgdm"])
def test_optax_host_state_conversion(spec):
    """optax chunk state -> portable -> host dataclass -> portable -> optax keeps every value
    (counts of every stage, the chunk's moments, the rest-of-model scalars)."""
    n = 256
    rng = np.random.default_rng(0)
    tx = spec.optax()
    st = init_chunk_state(tx, jnp.zeros((n,), jnp.float32))
    leaves, tdef = jax.tree.flatten(st)
    st = jax.tree.unflatten(tdef, [np.full(np.shape(x), 5, np.asarray(x).dtype) if np.ndim(x) == 0 and
                                   np.asarray(x).dtype == np.int32 else rng.standard_normal(np.shape(x)).astype(np.float32)
                                   for x in leaves])
    count, moments, rest = portable.optax_to_portable(st, n)
    host = portable.portable_to_host(type(spec.host_state(1)), count, moments, 0)
    if hasattr(host, "count") and count is not None:
        assert host.count == 5
    c2, m2 = portable.host_to_portable(host)
    template = jax.eval_shape(lambda m: init_chunk_state(tx, m), jax.ShapeDtypeStruct((n,), jnp.float32))
    back = portable.portable_to_optax(template, count, m2, rest, 0)
    assert jax.tree.structure(back) == jax.tree.structure(st)
    assert_trees(back, st)


def test_extra_roundtrip(tmp_path):
    enc = ck.codec.encode({"a": (1, 2.5, "x", None), "k": jax.random.key(3), "arr": np.arange(6, dtype=np.int64).reshape(2, 3),
                      "bf": jnp.ones((2,), jnp.bfloat16), "nest": [{"b": True}]})
    import json
    dec = ck.codec.decode(json.loads(json.dumps(enc)))
    assert dec["a"] == (1, 2.5, "x", None) and dec["nest"] == [{"b": True}]
    assert dec["arr"].dtype == np.int64 and dec["arr"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert dec["bf"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(jax.random.key_data(dec["k"]), jax.random.key_data(jax.random.key(3)))
    with pytest.raises(TypeError, match="extra\\['bad'\\]"):
        ck.codec.encode({"bad": object()})


@pytest.mark.parametrize("where", ["chunk", "meta"])
def test_write_failure_keeps_previous(setup, mixed_run, tmp_path, monkeypatch, where):
    """ENOSPC in the middle of a save: one-line CheckpointWriteError naming the errno and the
    stage, the previous checkpoint restores, no temporary is left behind."""
    step, src, state, _, _ = mixed_run
    d = tmp_path / "ckpts"
    restored, _ = ck.restore_checkpoint(src, step)
    ck.save_checkpoint(d, 1, step, restored, {"tag": "good"})
    before = sorted(os.listdir(d))
    calls = []
    real_chunk = ck.files.write_chunk

    def failing_chunk(ckptr, path, arrays):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_chunk(ckptr, path, arrays)

    def failing_meta(path, meta):
        with open(path, "w") as f:
            f.write('{"format": "chunk')  # a torn write
        raise OSError(errno.ENOSPC, "No space left on device", path)

    if where == "chunk":
        monkeypatch.setattr(ck.files, "write_chunk", failing_chunk)
    else:
        monkeypatch.setattr(ck.files, "write_meta", failing_meta)
    with pytest.raises(ck.CheckpointWriteError) as e:
        ck.save_checkpoint(d, 2, step, restored, {"tag": "bad"})
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert "\n" not in msg and "ENOSPC" in msg and "checkpoints are intact (latest: step 1)" in msg, msg
    assert ("writing chunk 2 of" in msg) if where == "chunk" else ("meta.json" in msg), msg
    assert sorted(os.listdir(d)) == before == ["step_00000001"]
    assert ck.latest_step(d) == 1
    monkeypatch.undo()
    st, extra = ck.restore_checkpoint(d, step)
    assert extra == {"tag": "good"}
    assert_trees(ck.export_params(step, st), ck.export_params(step, restored))
    with pytest.raises(FileExistsError):
        ck.save_checkpoint(d, 1, step, st, {})


def test_failed_save_prints_only_our_line(tmp_path):
    """A fresh user's session-19 report: a full disk or Ctrl-C in the middle of a checkpoint save
    printed our one-line error and then orbax's absl tracebacks (its background threads failing
    on the removed temporary directory, tensorstore's ``Event loop is closed``). The worker
    (tests/checkpoint_noise_worker.py) fails a save inside orbax itself (a file-size limit:
    tensorstore's own writes fail, EFBIG) and interrupts one (SIGINT while orbax's background
    writes are held): stderr is our two lines and nothing else, the errno is named, the first
    checkpoint stays the latest and restores, and no temporary directory is left. The worker is
    started as a background job of a script (``cmd &`` in ``sh -c``), which ignores SIGINT (session
    20's ``make test`` failed here so): its own handler makes its SIGINT a KeyboardInterrupt."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(["sh", "-c", '"$@" & wait $!', "sh",  # a background job: SIGINT inherited ignored
                          sys.executable, os.path.join(here, "checkpoint_noise_worker.py"), str(tmp_path / "ck")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[0] == "inherited SIGINT: ignored", res.stdout
    err = res.stderr.strip().splitlines()
    assert len(err) == 2 and err[1] == "interrupted", res.stderr[-3000:]
    assert err[0].startswith("error: saving checkpoint step 2 ") and "[EFBIG]" in err[0], err[0]
    assert "intact (latest: step 1)" in err[0] and "tensorstore" not in err[0], err[0]
    assert res.stdout.strip().splitlines()[-1] == "OK 1 ['step_00000001']", res.stdout


CHILD = """
import os, sys, time
sys.path[:0] = [{repo}, {tests}]
import test_checkpoint as tc
from chunkjax import checkpoint as ck
setup = tc.build_setup()
step = tc.make_step(setup, [])
state = step.init(setup[1])
ck.save_checkpoint({d}, 1, step, state, {"tag": "first"})
real = ck.files.write_chunk
n = [0]
def slow(ckptr, path, arrays):
    real(ckptr, path, arrays)
    n[0] += 1
    if n[0] == 3:
        print("MIDSAVE", flush=True)
        time.sleep(900)
ck.files.write_chunk = slow
ck.save_checkpoint({d}, 2, step, state, {"tag": "second"})
print("SAVED", flush=True)
"""


def test_sigkill_during_save(setup, host_run, tmp_path):
    """A process SIGKILLed in the middle of saving step 2: step 1 is still the latest complete
    checkpoint and restores exactly; the partial save is not listed and the next save removes it."""
    d = str(tmp_path / "ckpts")
    with _child_at(_start_child(CHILD.replace("{d}", repr(d))), "MIDSAVE"):
        tmps = [n for n in os.listdir(d) if n.startswith(".tmp_step_00000002")]
        assert len(tmps) == 1 and any(n.startswith("chunk_") for n in os.listdir(os.path.join(d, tmps[0])))
    assert ck.all_steps(d) == [1] and ck.latest_step(d) == 1
    step = host_run[0]  # same layout as the child's (deterministic construction)
    st, extra = ck.restore_checkpoint(d, step)
    assert extra == {"tag": "first"}
    assert_trees(ck.export_params(step, st), setup[1])
    assert all(o.count == 0 for o in st.opt_state)
    with pytest.raises(FileNotFoundError, match="complete steps: \\[1\\]"):
        ck.restore_checkpoint(d, step, step_number=2)
    ck.save_checkpoint(d, 2, step, st, {"tag": "again"})  # removes the dead process's temporary
    assert sorted(os.listdir(d)) == ["step_00000001", "step_00000002"]


def test_restore_into_streamed_placement(setup, mixed_run):
    """A Placement without a schedule (state in pinned host memory, update streamed through the
    device): optax state restored in the placement's memory kinds, same values."""
    step, d, _, _, _ = mixed_run
    layout = setup[4]
    n = layout.n_chunks
    kinds = ("device",) * 2 + ("pinned_host",) * (n - 2)
    streamed = cj.make_chunked_step(setup[3], layout, Placement(kinds, kinds), tx=SPEC.optax(), compute_dtype=jnp.float32)
    st, _ = ck.restore_checkpoint(d, streamed)
    ref, _ = ck.restore_checkpoint(d, step)
    for c in range(n):
        assert st.master[c].sharding.memory_kind == kinds[c] == st.params[c].sharding.memory_kind
        assert all(x.sharding.memory_kind == kinds[c] for x in jax.tree.leaves(st.opt_state[c]))
        count, moments, _ = portable.optax_to_portable(st.opt_state[c], layout.chunk_size)
        if c >= 2:  # saved from the host kernel's state
            assert count == ref.opt_state[c].count == N
            np.testing.assert_array_equal(moments["mu"], ref.opt_state[c].m)
            np.testing.assert_array_equal(moments["nu"], ref.opt_state[c].v)
    assert_trees(ck.export_params(streamed, st), ck.export_params(step, ref))


def test_bf16_resume_and_dtype_change(setup, mixed_run, tmp_path):
    """bf16 compute: resuming reproduces the losses bit for bit; a bf16 checkpoint restored into
    an fp32-compute step recasts its compute params from the fp32 master params."""
    params, batches = setup[1], setup[2]
    sched = make_step(setup, [0, 1]).schedule
    step = cj.make_chunked_step(setup[3], setup[4], sched, host_optimizer=SPEC, compute_dtype=jnp.bfloat16)
    state, l1 = run(step, step.init(params), batches[:N])
    ck.save_checkpoint(tmp_path, N, step, state, {})
    state, l2 = run(step, state, batches[N:])
    st, _ = ck.restore_checkpoint(tmp_path, step)
    assert st.params[0].dtype == jnp.bfloat16
    st, l2b = run(step, st, batches[N:])
    assert l2b == l2
    assert_trees(ck.export_params(step, st), ck.export_params(step, state))
    f32_step = mixed_run[0]
    st32, _ = ck.restore_checkpoint(tmp_path, f32_step)
    for p, m in zip(st32.params, st32.master):
        assert p.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m))


def test_host_memory_bounded(setup, host_run, tmp_path):
    """Saving and restoring allocate (numpy, traced) at most about two chunks beyond the state:
    never a second copy of the model."""
    import tracemalloc
    step, _, state, _ = host_run
    lay = step.layout
    total = 4 * lay.chunk_size * lay.n_chunks * 4  # params, master, m, v (fp32)
    per_chunk = 4 * lay.chunk_size * 4
    assert lay.n_chunks >= 6
    ck.save_checkpoint(tmp_path, 0, step, state, {})  # warm orbax
    tracemalloc.start()
    try:
        ck.save_checkpoint(tmp_path, 1, step, state, {})
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        restored, _ = ck.restore_checkpoint(tmp_path, step)
        held, restore_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert save_peak < 2 * per_chunk < total / 2, (save_peak, per_chunk, total)
    assert held - base > 0.7 * total  # the restored host state itself (numpy master, moments)
    assert restore_peak - held < 2 * per_chunk, (restore_peak, held, per_chunk)


CHILD_TRAIN = """
import os, sys, time
sys.path[:0] = [{repo}, {tests}]
import test_checkpoint as tc
from chunkjax import checkpoint as ck
setup = tc.build_setup()
step = tc.make_step(setup, [])
state = step.init(setup[1])
real = step.update_host_chunks
stall = [False]
def host_update(st, grads, scale):
    if stall[0]:  # update some chunks in place, then stall inside the step
        items = list(grads.items())
        real(st, dict(items[:len(items) // 2]), scale)
        print("INSTEP", flush=True)
        time.sleep(900)
    return real(st, grads, scale)
step.__dict__["update_host_chunks"] = host_update
losses = []
for i, b in enumerate(setup[2]):
    stall[0] = i == tc.N
    state, m = step(state, b)
    losses.append(float(m["loss"]))
    ck.save_checkpoint({d}, i + 1, step, state, {"data_position": i + 1, "losses": losses})
print("DONE", flush=True)
"""


def _start_child(code: str) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(code).replace("{repo}", repr(os.path.dirname(here))).replace("{tests}", repr(here))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), text=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def _child_at(proc: subprocess.Popen, marker: str, timeout: float = 90):
    """Wait until the child prints ``marker``; SIGKILL it when the block ends (and on any failure,
    or after ``timeout`` seconds without the marker)."""
    timer = threading.Timer(timeout, proc.kill)  # a hung child ends readline below
    timer.start()
    try:
        line = "-"
        while line and not line.startswith(marker):
            line = proc.stdout.readline()
        timer.cancel()
        assert line.startswith(marker), f"child did not reach {marker} within {timeout} s (rc={proc.poll()})"
        yield proc
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        timer.cancel()
        _kill(proc)


@pytest.fixture(scope="module")
def training_child(tmp_path_factory):
    """The child of the kill-during-a-step test, started with the module's first fixture so that
    it compiles on another core while this process compiles its own steps."""
    d = str(tmp_path_factory.mktemp("killed_in_step"))
    proc = _start_child(CHILD_TRAIN.replace("{d}", repr(d)))
    yield proc, d
    _kill(proc)


def test_sigkill_during_step_resumes_with_nothing_lost(setup, host_run, training_child):
    """Training with a checkpoint after every step, SIGKILLed inside step N+1 (host update half
    done in place): the last complete checkpoint is step N, and resuming from it reproduces the
    uninterrupted run's losses N+1..2N and final master params exactly."""
    proc, d = training_child
    with _child_at(proc, "INSTEP"):
        pass  # killed inside step N+1
    step, _, ref_state, ref_losses = host_run
    assert ck.all_steps(d) == list(range(1, N + 1))
    st, extra = ck.restore_checkpoint(d, step)
    assert extra["data_position"] == N
    np.testing.assert_allclose(extra["losses"], ref_losses[:N], rtol=1e-6)
    st, l2 = run(step, st, setup[2][extra["data_position"]:])
    assert l2 == ref_losses[N:]
    assert_trees(ck.export_params(step, st), ck.export_params(step, ref_state))


@pytest.mark.parametrize("tx,match", [(optax.chain(optax.scale_by_adam(), optax.scale_by_adam()), "two moments named 'mu'"),
                                      (optax.adafactor(1e-3, min_dim_size_to_factor=8), "neither a step count nor")],
                         ids=["two_adams", "adafactor"])
def test_unsupported_optax_state(tx, match):
    """Optimizer states with no per-chunk, per-element form are refused with a clear error."""
    st = init_chunk_state(tx, jnp.zeros((64,), jnp.float32))
    with pytest.raises(ck.CheckpointError, match=match):
        portable.optax_to_portable(st, 64)


def test_relative_directory(setup, mixed_run, tmp_path, monkeypatch):
    """A checkpoint directory relative to the working directory (the main job's default run
    folder is ``runs/...``; orbax itself refuses relative paths) saves, lists and restores."""
    step, _, state, _, _ = mixed_run
    monkeypatch.chdir(tmp_path)
    assert ck.save_checkpoint(os.path.join("runs", "ckpts"), 3, step, state, {"n": 3}) == os.path.join("runs", "ckpts", "step_00000003")
    assert ck.save_checkpoint_async(os.path.join("runs", "ckpts"), 4, step, state).wait().endswith("step_00000004")
    assert ck.latest_step("runs/ckpts") == 4
    st, extra = ck.restore_checkpoint("runs/ckpts", step, 3)
    assert extra == {"n": 3}
    assert_trees(ck.export_params(step, st), ck.export_params(step, state))


def test_step_without_state_is_refused(mixed_run, tmp_path):
    """A step keeps no state of its own: saving or exporting it without one is one line."""
    step = mixed_run[0]
    with pytest.raises(TypeError, match="pass the state it returned"):
        ck.save_checkpoint(tmp_path, 1, step)
    with pytest.raises(TypeError, match="pass the state it returned"):
        ck.save_checkpoint_async(tmp_path, 1, step)
    with pytest.raises(TypeError, match="pass the state it returned"):
        ck.export_params(step)
    assert not os.listdir(tmp_path)


def test_checkpoint_not_found_says_where_they_are(host_run, tmp_path):
    """ux21: restoring from a folder with no checkpoint said only "no complete checkpoint in X".
    Right: one line saying what X is (missing, one checkpoint's step folder, a folder holding the
    checkpoint folder) and what to pass instead: the checkpoint folders found there or beside it,
    with their steps, else the folder save_checkpoint wrote; a missing step names the steps there."""
    import shutil
    step, d = host_run[0], host_run[1]
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(d, ckpts)
    cases = [
        (tmp_path / "run", rf"no complete checkpoint in {tmp_path / 'run'}: it holds no step_<N> folder; checkpoints "
                           rf"found in {ckpts} \(steps \[{N}\]\): pass one of them"),
        (ckpts / f"step_{N:08d}", rf"it is one checkpoint's step folder; pass the folder save_checkpoint wrote, "
                                  rf"its parent: restore_checkpoint\('{ckpts}', ...\)"),
        (tmp_path / "nope", r"it does not exist; pass the folder chunkjax.save_checkpoint\(folder, n, step\) wrote"),
        (tmp_path / "run" / "checkpoint", rf"it does not exist; checkpoints found in {ckpts} \(steps \[{N}\]\)"),
    ]
    shutil.copytree(d, tmp_path / "someone_elses_job")  # beside "run" and "nope", unrelated: not suggested (fresh24)
    for where, needle in cases:
        with pytest.raises(FileNotFoundError, match=needle) as e:
            ck.restore_checkpoint(where, step)
        assert "\n" not in str(e.value) and "someone_elses_job" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=rf"complete steps: \[{N}\]\): pass step_number= one of them"):
        ck.restore_checkpoint(ckpts, step, step_number=N + 1)


def test_keep_deletes_all_but_the_newest(setup, mixed_run, tmp_path):
    """``save_checkpoint(..., keep=k)`` keeps the newest k complete checkpoints (orbax's max_to_keep;
    a fresh user's loop saving every 5 steps filled 676 MiB for a 130 KiB model): the older ones are
    deleted once the new one is complete, the kept ones restore bit for bit; a bad ``keep`` writes
    nothing."""
    step, _, state, _, _ = mixed_run
    d = tmp_path / "kept"
    for n in (3, 5, 6):
        ck.save_checkpoint(d, n, step, state, {"n": n}, keep=2)
    assert ck.all_steps(d) == [5, 6] and sorted(os.listdir(d)) == ["step_00000005", "step_00000006"]
    st, extra = ck.restore_checkpoint(d, step, 5)
    assert extra == {"n": 5}
    assert_trees(ck.export_params(step, st), ck.export_params(step, state))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            ck.save_checkpoint(d, 7, step, state, keep=bad)
    assert ck.all_steps(d) == [5, 6] and sorted(os.listdir(d)) == ["step_00000005", "step_00000006"]
    assert ck.prune_checkpoints(d, 1) == [5] and ck.all_steps(d) == [6]
