"""The in-place host update of one chunk (chunkjax.host_update) against optax.

Three references:
* optax run eagerly on the JAX CPU backend: every op is its own XLA program, so no fused
  multiply-add; the kernels do the same float32 operations in the same order and must match it
  bit for bit (this pins "same math"; it relies on XLA CPU, jax 0.10, turning a division by a
  broadcast scalar into a multiply by its reciprocal, as the AdamW kernel does);
* optax under ``jax.jit`` (XLA contracts a*b+c into FMAs): equal to float32 rounding;
* a float64 numpy AdamW: equal to float32 rounding.
"""
import dataclasses
import functools
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import SingleDeviceSharding

from chunkjax.host_update import (AdamW, HostAdamState, Lion, SGDMomentum, bf16_bits, bf16_round_bits, host_update_,
                                  learning_rate_at, measure_host_update_rate, writable_view)

SIZES = [1, 511, 513, 100003]
N = max(SIZES)
STEPS = 5
SPECS = {
    "adamw": AdamW(1e-2, weight_decay=0.1),
    "adamw_schedule": AdamW(optax.linear_schedule(1e-2, 1e-3, 3), b1=0.8, b2=0.99, eps=1e-6),
    "adamw_no_wd": AdamW(3e-3, weight_decay=0.0),
    "lion": Lion(optax.linear_schedule(1e-3, 1e-4, 4)),
    "sgd_nesterov": SGDMomentum(1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd": SGDMomentum(optax.linear_schedule(1e-2, 1e-3, 3), momentum=0.5),
}
# float32 rounding over 5 steps: relative 1e-6, absolute 1e-7 of the array's magnitude.
RTOL, ATOL_FRACTION = 1e-6, 1e-7


def assert_close_f32(got, want, what):
    want = np.asarray(want, np.float64)
    atol = ATOL_FRACTION * max(float(np.max(np.abs(want))), 1e-30)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=what)


def bf16_grad(rng, n, scale=1.0):
    """Random gradient as (bits uint16, values float32)."""
    g = jnp.asarray(rng.standard_normal(n, dtype=np.float32) * scale).astype(jnp.bfloat16)
    return np.array(g).view(np.uint16), np.array(g.astype(jnp.float32))


def jax_bf16_bits(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)


def moments(state):
    """(optax state leaf name, host array) pairs of a host state."""
    if isinstance(state, HostAdamState):
        return [("mu", state.m), ("nu", state.v)]
    return [("mu", state.m)] if hasattr(state, "m") else [("trace", state.trace)]


@functools.cache
def reference(name, grad_dtype, jit=False):
    """STEPS optax updates of a random N-element chunk: (master0, kernel grads, params, {leaf: moment}).

    The updates are elementwise, so the first n elements of this run are the reference for a chunk
    of size n: one optax run (one set of XLA compilations) serves every chunk size."""
    tx = SPECS[name].optax()
    rng = np.random.default_rng(zlib.crc32(f"{name}/{grad_dtype}".encode()))
    master0 = rng.standard_normal(N, dtype=np.float32)
    p = jnp.asarray(master0)
    opt_state = tx.init(p)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step) if jit else step
    kernel_grads = []
    for _ in range(STEPS):
        bits, g32 = bf16_grad(rng, N)
        if grad_dtype == "float32":
            g32 = rng.standard_normal(N, dtype=np.float32)
        kernel_grads.append(bits if grad_dtype == "bf16" else g32)
        p, opt_state = step(jnp.asarray(g32), opt_state, p)
    leaves = {k: np.asarray(v) for k in ("mu", "nu", "trace") if (v := optax.tree.get(opt_state, k)) is not None}
    return master0, kernel_grads, np.asarray(p), leaves


def run_host(name, grad_dtype, n):
    """The same STEPS updates by host_update_ on the first n elements, as a chunk of its own."""
    spec = SPECS[name]
    master0, grads, _, _ = reference(name, grad_dtype)
    master, state, out = master0[:n].copy(), spec.host_state(n), np.empty(n, np.uint16)
    for g in grads:
        host_update_(spec, state, np.ascontiguousarray(g[:n]), master, out)
    return master, state, out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", ["bf16", "float32"])
@pytest.mark.parametrize("name", list(SPECS))
def test_bit_exact_against_eager_optax(name, grad_dtype, n):
    master, state, out = run_host(name, grad_dtype, n)
    _, _, p, leaves = reference(name, grad_dtype)
    np.testing.assert_array_equal(master.view(np.uint32), p[:n].view(np.uint32), err_msg="master")
    for leaf, host in moments(state):
        np.testing.assert_array_equal(host.view(np.uint32), leaves[leaf][:n].view(np.uint32), err_msg=leaf)
    np.testing.assert_array_equal(out, jax_bf16_bits(p[:n]), err_msg="bf16 params bits")
    assert state.count == STEPS


@pytest.mark.parametrize("name", list(SPECS))
def test_close_to_jitted_optax(name):
    master, state, _ = run_host(name, "bf16", N)
    master0, _, p, leaves = reference(name, "bf16", jit=True)
    assert not np.array_equal(p, master0)
    assert_close_f32(master, p, "master")
    for leaf, host in moments(state):
        assert_close_f32(host, leaves[leaf], leaf)


def adamw_float64(spec: AdamW, master, grads, scales):
    """AdamW in float64 numpy (the definition, not optax's code)."""
    p = master.astype(np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for count, (g, s) in enumerate(zip(grads, scales)):
        g = g.astype(np.float64) * s
        lr = float(spec.learning_rate(count)) if callable(spec.learning_rate) else spec.learning_rate
        t = count + 1
        m = spec.b1 * m + (1 - spec.b1) * g
        v = spec.b2 * v + (1 - spec.b2) * g * g
        u = (m / (1 - spec.b1**t)) / (np.sqrt(v / (1 - spec.b2**t)) + spec.eps) + spec.weight_decay * p
        p = p - lr * u
    return p, m, v


@pytest.mark.parametrize("clip", [None, 1.0])
def test_adamw_model_of_chunks_against_float64_and_optax(clip):
    """A 'model' of three chunks updated chunk by chunk with the global-norm clipping scale, against
    a float64 AdamW and against optax on the whole pytree (clip_by_global_norm + adamw, jitted)."""
    spec = AdamW(optax.linear_schedule(1e-2, 2e-3, 4), weight_decay=0.05, max_grad_norm=clip)
    sizes = [511, 513, 4099]
    rng = np.random.default_rng(11)
    masters = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    master0 = np.concatenate(masters)
    states = [spec.host_state(n) for n in sizes]
    outs = [np.empty(n, np.uint16) for n in sizes]
    grads_per_step, scales = [], []
    tx = spec.optax()
    params = [jnp.asarray(m) for m in masters]
    opt_state = tx.init(params)
    step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for _ in range(STEPS):
        grads = [bf16_grad(rng, n, scale=0.1) for n in sizes]
        norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for _, g in grads)))
        scale = spec.grad_scale(norm)
        if clip is not None:
            assert scale < 1.0  # the test clips for real
        for master, state, out, (bits, _) in zip(masters, states, outs, grads):
            host_update_(spec, state, bits, master, out, grad_scale=scale)
        params, opt_state = step([jnp.asarray(g) for _, g in grads], opt_state, params)
        grads_per_step.append(np.concatenate([g for _, g in grads]))
        scales.append(min(1.0, clip / norm) if clip else 1.0)
    ref_p, ref_m, ref_v = adamw_float64(spec, master0, grads_per_step, scales)
    assert_close_f32(np.concatenate(masters), ref_p, "master vs float64")
    assert_close_f32(np.concatenate([s.m for s in states]), ref_m, "m vs float64")
    assert_close_f32(np.concatenate([s.v for s in states]), ref_v, "v vs float64")
    assert_close_f32(np.concatenate(masters), np.concatenate([np.asarray(p) for p in params]), "master vs optax")
    for master, out in zip(masters, outs):
        np.testing.assert_array_equal(out, jax_bf16_bits(master))


def test_padding_stays_zero():
    n, pad = 1000, 300
    for spec in (AdamW(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.5), Lion(1e-3, weight_decay=0.5),
                 SGDMomentum(1e-2, weight_decay=0.5)):
        rng = np.random.default_rng(3)
        master = rng.standard_normal(n, dtype=np.float32)
        master[-pad:] = 0
        state, out = spec.host_state(n), np.full(n, 0xFFFF, np.uint16)
        for _ in range(STEPS):
            bits, _ = bf16_grad(rng, n)
            bits[-pad:] = 0
            host_update_(spec, state, bits, master, out, grad_scale=0.5)
        for name, a in [("master", master), ("out", out)] + moments(state):
            bits = a[-pad:].view(np.uint32 if a.itemsize == 4 else np.uint16)  # +0.0 exactly, not -0.0
            assert not np.any(bits), (type(spec).__name__, name)


def test_bf16_round_bits_matches_jax():
    specials = np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F80FFFF, 0xFFFFFFFF,  # NaNs
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties: round to even, both signs
        0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # near ties, overflow to inf
        0x00000001, 0x00008000, 0x00018000, 0x00007FFF, 0x807FFFFF, 0x007F8000,  # subnormals
    ], np.uint32)
    rng = np.random.default_rng(5)
    rand = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint32)
    every_bf16_tie = (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000
    x = np.concatenate([specials, rand, every_bf16_tie]).view(np.float32)
    np.testing.assert_array_equal(bf16_round_bits(x), jax_bf16_bits(x))
    np.testing.assert_array_equal(bf16_round_bits(x[:12].reshape(3, 4)), jax_bf16_bits(x[:12]).reshape(3, 4))
    with pytest.raises(ValueError, match="float32"):
        bf16_round_bits(np.zeros(3))


def test_bf16_bits_view():
    b = jnp.asarray([1.0, -2.5, 3.0], jnp.bfloat16)
    bits = bf16_bits(b)
    assert bits.dtype == np.uint16 and not bits.flags.writeable
    np.testing.assert_array_equal(bits, [0x3F80, 0xC020, 0x4040])
    assert not bf16_bits(np.asarray(b)).flags.writeable
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_bits(np.zeros(3, np.float32))


def test_runs_in_threads_while_jax_works():
    """Updates from worker threads (two at once, serialised inside) while the main thread runs JAX;
    same bits as the same updates run sequentially on the main thread."""
    spec, n = AdamW(1e-3), 200_003
    rng = np.random.default_rng(9)
    m0 = [rng.standard_normal(n, dtype=np.float32) for _ in range(2)]
    grads = [[bf16_grad(rng, n)[0] for _ in range(3)] for _ in range(2)]

    def updates(c, master, state, out):
        for g in grads[c]:
            host_update_(spec, state, g, master, out)

    seq = [(m.copy(), spec.host_state(n), np.empty(n, np.uint16)) for m in m0]
    for c in range(2):
        updates(c, *seq[c])
    thr = [(m.copy(), spec.host_state(n), np.empty(n, np.uint16)) for m in m0]
    errors = []

    def target(c):
        try:
            updates(c, *thr[c])
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    x = jnp.ones((256, 256))
    for _ in range(20):
        x = (x @ x) / 256.0
    x.block_until_ready()
    for t in threads:
        t.join()
    assert not errors, errors
    for (ms, ss, os_), (mt, st, ot) in zip(seq, thr):
        np.testing.assert_array_equal(ms, mt)
        np.testing.assert_array_equal(ss.m, st.m)
        np.testing.assert_array_equal(os_, ot)
        assert st.count == 3


def test_writable_view_of_cpu_arrays():
    d = jax.devices()[0]
    x = (jnp.arange(1000, dtype=jnp.float32) + 1).block_until_ready()  # a buffer jax made itself
    view = writable_view(x, np.float32)
    assert view.flags.writeable and view.shape == (1000,)
    view[:] = 2.0
    assert float(jnp.sum(x)) == 2000.0

    b = (jnp.ones(8, jnp.bfloat16) * 3).block_until_ready()
    writable_view(b, np.uint16)[0] = 0x3F80  # 1.0
    assert float(jnp.sum(b.astype(jnp.float32))) == 1.0 + 7 * 3.0

    pinned = jax.device_put(x, SingleDeviceSharding(d, memory_kind="pinned_host")).block_until_ready()
    writable_view(pinned, np.float32)[:] = 5.0
    back = jax.device_put(pinned, SingleDeviceSharding(d, memory_kind="device"))
    assert float(jnp.sum(back)) == 5000.0

    # The host update straight into JAX buffers: master, m, v and the bf16 params.
    spec, n = AdamW(1e-2), 513
    arrays = [(jnp.zeros(n, jnp.float32) + k).block_until_ready() for k in (1.0, 0.0, 0.0)]
    params = jnp.zeros(n, jnp.bfloat16).block_until_ready()
    master, m, v = (writable_view(a, np.float32) for a in arrays)
    host_update_(spec, HostAdamState(0, m, v), np.ones(n, np.float32), master, writable_view(params, np.uint16))
    expect = 1.0 - 1e-2 * (1.0 + 1e-4 * 1.0)
    np.testing.assert_allclose(np.asarray(arrays[0] * 1), expect, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(params), np.asarray(arrays[0].astype(jnp.bfloat16)))


def test_writable_view_errors():
    x = jnp.zeros((4, 4), jnp.float32)
    with pytest.raises(ValueError, match="1-D"):
        writable_view(x, np.float32)
    with pytest.raises(ValueError, match="itemsize"):
        writable_view(jnp.zeros(4, jnp.float32), np.uint16)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    sharded = jax.device_put(jnp.zeros(8 * len(jax.devices())), jax.NamedSharding(mesh, jax.P("d")))
    if len(jax.devices()) > 1:
        with pytest.raises(ValueError, match="single-device"):
            writable_view(sharded, np.float32)
    y = jnp.zeros(4) + 1
    y.delete()
    with pytest.raises(ValueError, match="deleted"):
        writable_view(y, np.float32)
    with pytest.raises(ValueError, match="jax.Array"):
        writable_view(np.zeros(4, np.float32), np.float32)


def test_host_update_argument_errors():
    spec, n = AdamW(1e-3), 16
    st, master, g = spec.host_state(n), np.zeros(n, np.float32), np.zeros(n, np.uint16)
    cases = [
        (dict(grad=np.zeros(n + 1, np.uint16)), "grad .*size 16"),
        (dict(grad=np.zeros(n, np.float16)), "grad .*dtype"),
        (dict(master=np.zeros(2 * n, np.float32)[::2]), "master .*C-contiguous"),
        (dict(master=np.zeros(n, np.float64)), "master .*dtype"),
        (dict(params_bits_out=np.zeros(n, np.int32)), "params_bits_out"),
        (dict(params_bits_out=np.zeros(n - 1, np.uint16)), "params_bits_out"),
        (dict(grad=[0.0] * n), "grad must be a numpy array"),
        (dict(state=HostAdamState(0, st.m, st.m)), "state.m and state.v share memory"),
        (dict(state=Lion(1e-3).host_state(n)), "AdamW needs a HostAdamState"),
        (dict(state=HostAdamState(0, st.m, np.zeros(n + 1, np.float32))), "state.v"),
    ]
    for override, match in cases:
        kw = dict(spec=spec, state=st, grad=g, master=master, params_bits_out=None) | override
        with pytest.raises(ValueError, match=match):
            host_update_(**kw)
    ro = np.zeros(n, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="master .*writable"):
        host_update_(spec, st, g, ro)
    assert st.count == 0  # nothing ran


def test_spec_validation_and_optax_equivalent():
    with pytest.raises(ValueError, match=r"AdamW.b2 = 1.0"):
        AdamW(1e-3, b2=1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(1e-3, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="learning_rate"):
        Lion("fast")
    with pytest.raises(ValueError, match="weight_decay"):
        SGDMomentum(1e-2, weight_decay=-1.0)
    spec = AdamW(1e-3, max_grad_norm=1.0)
    assert spec.grad_scale(0.5) == 1.0 and spec.grad_scale(4.0) == 0.25 and AdamW(1e-3).grad_scale(1e9) == 1.0
    assert len(spec.optax().init([jnp.zeros(3)])) == 2  # clip_by_global_norm, then adamw
    assert spec.host_state(7).nbytes == 56 and Lion(1.0).host_state(7).nbytes == 28
    sched = optax.linear_schedule(1.0, 0.0, 10)
    assert learning_rate_at(sched, 0) == 1.0 and learning_rate_at(sched, 5) == np.float32(0.5)
    assert learning_rate_at(lambda c: 0.1 * (c + 1), 1) == np.float32(0.2)

    @dataclasses.dataclass  # eq=True without frozen: unhashable, evaluated without the memo
    class Halving:
        lr: float

        def __call__(self, count):
            return self.lr * 0.5**count

    assert learning_rate_at(Halving(1.0), 2) == 0.25
    assert learning_rate_at(3e-4, 99) == np.float32(3e-4)


def test_measure_host_update_rate():
    s = measure_host_update_rate(n=1 << 16, repeats=2)
    assert 0 < s < 1e-6


@pytest.mark.parametrize("clip", [None, 0.5])
def test_host_and_storage_tiers_bit_identical(tmp_path, clip):
    """One AdamW spec on the host tier (host_update_, chunk by chunk) and on the storage tier
    (NearStorageOptimizer: worker processes, chunk files) over several steps, on fresh random
    inputs: bit-identical master params, moments and bf16 params, with and without clipping (the
    clip is active on every step), and, with clipping, bit-exact against eager optax on one chunk."""
    from chunkjax.kernels import clip_scale
    from chunkjax.storage.near import NearStorageOptimizer
    rng = np.random.default_rng()
    sizes = [513, 1, 4099]
    spec = AdamW(optax.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.05, max_grad_norm=clip)
    masters = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    states = [spec.host_state(n) for n in sizes]
    host = [m.copy() for m in masters]
    outs = [np.empty(n, np.uint16) for n in sizes]
    with NearStorageOptimizer([tmp_path / "a", tmp_path / "b"], sizes, spec, init_params=masters, fsync=False) as opt:
        for step in range(4):
            grads = [jnp.asarray(rng.standard_normal(n, dtype=np.float32)).astype(jnp.bfloat16) for n in sizes]
            r = opt.step(grads)
            norm = float(optax.tree.norm([g.astype(jnp.float32) for g in grads]))
            assert r.grad_norm == norm
            scale = clip_scale(spec.max_grad_norm, norm)
            if clip is not None:
                assert scale != (1.0, 1.0)  # clipping for real
            for c in range(len(sizes)):
                host_update_(spec, states[c], bf16_bits(grads[c]), host[c], outs[c], grad_scale=scale)
                np.testing.assert_array_equal(r.params[c].view(np.uint16), outs[c], err_msg=f"bf16 params {c}")
        stored = opt.read_state()
    for c in range(len(sizes)):
        for name, a, b in zip(("master", "m", "v"), stored[c], (host[c], states[c].m, states[c].v)):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"{name} of chunk {c}")
        assert states[c].count == opt.committed_step == 4
    # one chunk alone against eager optax (clip_by_global_norm + adamw): the same bits
    tx, p = spec.optax(), jnp.asarray(masters[2])
    st, master, hs = tx.init(p), masters[2].copy(), spec.host_state(sizes[2])
    for _ in range(3):
        g = jnp.asarray(rng.standard_normal(sizes[2], dtype=np.float32))
        u, st = tx.update(g, st, p)
        p = optax.apply_updates(p, u)
        host_update_(spec, hs, np.asarray(g), master, grad_scale=clip_scale(spec.max_grad_norm,
                                                                            float(optax.tree.norm(g))))
    np.testing.assert_array_equal(master.view(np.uint32), np.asarray(p).view(np.uint32))


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.float16])
def test_host_updater_writes_float_params_without_a_chunk_temporary(compute_dtype):
    """The step's host updater (``chunkjax.updaters.host_updater``, one device) on a chunk with a
    float32 / float16 compute copy: after 3 steps the master params equal optax's AdamW, the
    compute params (the pinned buffer, a CPU jax array written through its view) are the master
    cast by numpy's rounding, bit for bit; and the update allocates no array of the chunk's size
    (the cast used to go through ``master.astype``: a 4 MB temporary per update here, ~200 MB per
    49M-element chunk on the GPU run, allocated and page-faulted every step)."""
    import tracemalloc

    from chunkjax.topology import SingleDevice
    from chunkjax.updaters import host_updater
    n, spec = 2**20, AdamW(1e-2, weight_decay=0.1)
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    up = host_updater(SingleDevice(), spec, n, compute_dtype)
    master, st = up.init(p0.copy(), 0)
    with jax.default_device(jax.devices("cpu")[0]):
        params = jnp.array(p0.astype(compute_dtype))
    state = dataclasses.make_dataclass("S", ["params", "master", "opt_state"])([params], [master], [st])
    peaks = []
    for g in grads:
        tracemalloc.start()
        up.update(state, {0: g}, 1.0)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert max(peaks[1:]) < n, peaks  # bytes, after the first (numba's compile): under a quarter of the chunk
    np.testing.assert_array_equal(np.asarray(params).view(np.uint8), master.astype(compute_dtype).view(np.uint8))
    tx, ref = spec.optax(), jnp.asarray(p0)
    s = tx.init(ref)
    for g in grads:
        u, s = tx.update(jnp.asarray(g), s, ref)
        ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(master, np.asarray(ref), rtol=RTOL, atol=1e-7)
