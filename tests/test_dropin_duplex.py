"""The drop-in optimizer's three update locations at once (chunkjax.duplex): exact against optax,
and the engine's order, bounds, errors and breakdown."""
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import dropin, duplex
from chunkjax.host_update import AdamW
from chunkjax.memory import DEVICE


def test_device_streamed_and_host_chunks_at_once_equal_optax():
    """One device-resident chunk, three streamed (a pipeline of two) and six on the host kernel,
    clipping by the global norm, over five steps: equal to plain optax on the whole tree. The
    layout has a leaf spanning the device and streamed chunks (cut inside the update programs),
    one spanning streamed and host chunks (its host piece cut on the device), leaves spanning
    host chunks (sent whole once), gaps of padding inside chunks, and gradients in bfloat16 and
    float16 besides float32 (read as bf16 bits / cast to float32). The breakdown counts the bytes
    each way."""
    rng = np.random.default_rng(7)
    sizes = dict(a=150, b=40, c=100, d=64, e=30, f=128, g=90)
    params = {k: jnp.asarray(rng.normal(size=(n,)), jnp.float32) for k, n in sizes.items()}
    grad_dtypes = dict(a=jnp.bfloat16, c=jnp.float16, e=jnp.float16, f=jnp.bfloat16)
    target = {k: jnp.asarray(rng.normal(size=(n,)), jnp.float32) for k, n in sizes.items()}
    grad_fn = jax.jit(lambda p: {k: v.astype(grad_dtypes.get(k, jnp.float32)) for k, v in jax.grad(
        lambda p: sum(jnp.sum(jnp.sin(p[k] - target[k]) * (p[k] - target[k])) for k in p))(p).items()})
    spec = AdamW(1e-2, weight_decay=0.1, max_grad_norm=1.0)
    probe = cj.ChunkedOptimizer(params, spec, device_budget="1GiB", chunk_size=64)
    state = probe.device_state_bytes // probe.layout.n_chunks
    threads = min(2, numba.config.NUMBA_NUM_THREADS)  # the kernel thread's numba threads, set explicitly
    opt = cj.ChunkedOptimizer(params, spec, device_budget=probe.working_bytes + 2 * state + 2 * 4 * 64,
                              chunk_size=64, host_chunks=6, pipeline_depth=2, host_threads=threads)
    assert opt.host_threads == threads and f"numba threads: {threads}" in opt.summary()
    assert opt.placement.state_kinds.count(DEVICE) == 1
    assert (opt.streamed_chunks, opt.host_chunks, opt.pipeline_depth) == ((1, 2, 3), (4, 5, 6, 7, 8, 9), 2)
    assert opt._sends.cut and any(len(v) > 0 for v in opt._sends.whole.values())

    plain = spec.optax()

    @jax.jit
    def ref_step(ref, s):  # plain optax on the whole tree, the gradients widened to float32
        u, s = plain.update(jax.tree.map(lambda x: x.astype(jnp.float32), grad_fn(ref)), s, ref)
        return optax.apply_updates(ref, u), s
    ref, s = params, plain.init(params)
    p = params
    for _ in range(5):
        ref, s = ref_step(ref, s)
        p = opt.update(grad_fn(p))
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(ref[k]), rtol=2e-5, atol=2e-5, err_msg=k)
        np.testing.assert_allclose(np.asarray(opt.master_params()[k]), np.asarray(ref[k]), rtol=2e-5, atol=2e-5)

    b = opt.last_update  # master_params() joined the last update
    assert (b.step, b.n_device, b.n_streamed, b.n_host) == (4, 1, 3, 6)
    per_state = duplex.nbytes_of((opt._master[1], opt._opt_state[1]))
    host_grads = sum(pc.size * (2 if grad_dtypes.get(opt.layout.slots[i].path) == jnp.bfloat16 else 4)
                     for c in opt.host_chunks for i, pc in opt.layout.chunk_pieces(c))
    assert b.d2h_bytes == 3 * per_state + host_grads
    assert b.h2d_bytes == 3 * per_state + 6 * 64 * 4
    kinds = {(e.kind, e.chunk) for e in b.events}
    assert all(("fetch", c) in kinds and ("store", c) in kinds for c in opt.streamed_chunks)
    assert all((k, c) in kinds for c in opt.host_chunks for k in ("grads", "kernel", "params"))
    assert b.predicted_s == opt.predicted_update.total_s > 0 and b.update_s > 0 and b.kernel_s > 0
    assert set(b.as_dict()) >= {"predicted_s", "update_s", "h2d_bytes", "d2h_bytes", "both_busy_s"}


def _engine(streamed, host, depth, log, live, lock, stored=None, **over):
    stored = {} if stored is None else stored

    def fetch(c):
        with lock:
            live.add(c)
            log.append(("fetch", c))
        return (np.full(4, c, np.float32),)

    def store(c, x):
        with lock:
            log.append(("store", c))
            live.discard(c)
            stored[c] = x

    fns = dict(fetch=fetch, update=lambda c, x: (log.append(("update", c)) or (x + 1,)), store=store,
               send_grads=lambda c: log.append(("grads", c)) or np.ones(2, np.float32),
               kernel=lambda c, g: log.append(("kernel", c)),
               send_params=lambda c: log.append(("params", c)) or np.ones(3, np.float32))
    fns.update(over)
    return duplex.DuplexUpdate(streamed, host, depth, **fns)


def test_duplex_engine_order_bound_and_breakdown():
    """Every streamed chunk goes fetch -> update -> store in order with at most ``depth`` between
    fetch and store; every host chunk grads -> kernel -> params; the breakdown adds the bytes."""
    log, live, lock, peak, stored = [], set(), threading.Lock(), [0], {}
    run = _engine([5, 1, 7, 2], [3, 4, 6], 2, log, live, lock, stored)
    real_fetch = run._fetch

    def fetch(c):
        out = real_fetch(c)
        peak[0] = max(peak[0], len(live))
        return out
    run._fetch = fetch
    run.run()
    run.join()
    for kinds, chunks in ((("fetch", "update", "store"), [5, 1, 7, 2]), (("grads", "kernel", "params"), [3, 4, 6])):
        for k in kinds:
            assert [c for kk, c in log if kk == k] == chunks
        for c in chunks:
            assert [log.index((k, c)) for k in kinds] == sorted(log.index((k, c)) for k in kinds)
    assert peak[0] <= 2
    assert {c: x.tolist() for c, x in stored.items()} == {c: [c + 1.0] * 4 for c in [5, 1, 7, 2]}  # update's results
    b = duplex.breakdown(run, step=0, n_device=0, predicted=cj.dropin.UpdateTime(1.0, 1.0, 0.5, 0.75, 1.0))
    assert b.predicted_host_memory_s == 0.75
    assert b.h2d_bytes == 4 * 16 + 3 * 12 and b.d2h_bytes == 4 * 16 + 3 * 8
    assert (b.n_streamed, b.n_host, b.predicted_s) == (4, 3, 1.0)


@pytest.mark.parametrize("where", ["kernel", "fetch", "update"])
def test_duplex_engine_failure_stops_every_thread(where):
    """A failing kernel, fetch or update is raised by run() with every thread ended."""
    def bad(*a):
        raise RuntimeError(f"{where} failed")
    log, live, lock = [], set(), threading.Lock()
    run = _engine([0, 1, 2], [3, 4], 1, log, live, lock, **{where: bad})
    with pytest.raises(RuntimeError, match=f"{where} failed"):
        run.run()
    assert not any(t.is_alive() for t in run._threads.values())


def test_duplex_engine_store_failure_after_return_is_raised_by_join():
    """A write-back that fails after run() returned is raised by join()."""
    release = threading.Event()

    def store(c, x):
        if c == 2:
            release.wait()
            raise RuntimeError("store of 2 failed")
    log, live, lock = [], set(), threading.Lock()
    run = _engine([0, 1, 2], [], 3, log, live, lock, store=store)
    run.run()
    release.set()
    with pytest.raises(RuntimeError, match="store of 2 failed"):
        run.join()
    time.sleep(0)
    assert not any(t.is_alive() for t in run._threads.values())


@pytest.mark.parametrize("small", [1, 48, 1 << 16])
def test_host_chunk_step_by_runs_equals_the_whole_chunk_step(monkeypatch, small):
    """The host kernel over a chunk's pieces (alone, or small neighbours gathered into runs), with
    a gap of padding between pieces and a bf16 gradient among float32 ones, is bit for bit the
    whole chunk's step (``host_update_`` on the packed chunk), count and bf16 params included."""
    from chunkjax import dropin
    from chunkjax.host_update import host_update_
    from chunkjax.layout import Piece
    monkeypatch.setattr(dropin, "SMALL_PIECE", small)
    rng = np.random.default_rng(0)
    n, spec = 256, AdamW(1e-2, weight_decay=0.1, max_grad_norm=0.5)
    pieces = [(0, Piece(0, 0, 0, 100)), (1, Piece(0, 100, 0, 20)), (2, Piece(0, 120, 0, 40)), (3, Piece(0, 200, 7, 50))]
    grads = [rng.normal(size=(p.size,)).astype(np.float32) for _, p in pieces]
    grads[1] = grads[1].astype(jnp.bfloat16)
    whole = np.zeros(n, np.float32)
    master = np.zeros(n, np.float32)
    for (_, p), g in zip(pieces, grads):
        whole[p.offset:p.offset + p.size] = g.astype(np.float32)
        master[p.offset:p.offset + p.size] = rng.normal(size=(p.size,))
    ref_master, ref_state = master.copy(), spec.host_state(n)
    ref_bits = np.zeros(n, np.uint16)
    params = jax.device_put(jnp.asarray(master, jnp.bfloat16), jax.devices()[0])
    state = spec.host_state(n)
    for _ in range(3):
        host_update_(spec, ref_state, whole, ref_master, ref_bits, (0.5, 0.9))
        dropin.host_chunk_step(spec, state, master, params, pieces, grads, (0.5, 0.9))
    np.testing.assert_array_equal(master, ref_master)
    np.testing.assert_array_equal(state.m, ref_state.m)
    np.testing.assert_array_equal(state.v, ref_state.v)
    assert state.count == ref_state.count == 3
    np.testing.assert_array_equal(np.asarray(params).view(np.uint16), ref_bits)


def test_host_threads_default_and_errors(monkeypatch):
    """The host kernel's threads: by default the cores less the transfer threads (at least one, at
    most numba's pool); an explicit count outside numba's pool is refused in one line."""
    top = numba.config.NUMBA_NUM_THREADS
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert dropin.host_threads_for(None) == min(top, 16 - dropin.TRANSFER_CORES)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert dropin.host_threads_for(None) == 1 and dropin.host_threads_for(top) == top
    for bad in (0, top + 1, 1.5, True):
        with pytest.raises(ValueError, match="host_threads="):
            dropin.host_threads_for(bad)


def test_lean_streamed_chunks_move_their_state_only():
    """Float32 streamed chunks keep no master of their own (dropin.lean_chunks): each update packs
    it from the params the optimizer returned last, inside the chunk's program, and moves only the
    optimizer state each way (4 bytes per param less each way for AdamW). Over three steps the
    params, master and state equal the optimizer that moves the master (bit for bit) and plain
    optax (fp32 tolerance), with a leaf spanning chunks; bf16 params keep their master; returned
    params that were deleted (donated) give the one-line error."""
    rng = np.random.default_rng(11)
    params = {k: jnp.asarray(rng.normal(size=(n,)), jnp.float32) for k, n in dict(a=96, b=32, c=64, d=64).items()}
    target = jax.tree.map(lambda x: 0.5 * x + 1.0, params)
    grad_fn = jax.jit(jax.grad(lambda p: sum(jnp.sum(jnp.sin(p[k] - target[k]) * (p[k] - target[k])) for k in p)))
    tx = optax.adamw(1e-2, weight_decay=0.1)
    kw = dict(chunk_size=64, check_tx=False)  # (adamw is elementwise: no probe)
    probe = cj.ChunkedOptimizer(params, tx, device_budget="1GiB", **kw)
    budget = probe.working_bytes + probe.device_state_bytes // probe.layout.n_chunks  # a pipeline of two
    lean = cj.ChunkedOptimizer(params, tx, device_budget=budget, **kw)
    full = cj.ChunkedOptimizer(params, tx, device_budget=budget, lean_streamed=False, **kw)
    assert lean.streamed_chunks == full.streamed_chunks and len(lean.streamed_chunks) >= 3
    assert lean.lean_chunks == frozenset(lean.streamed_chunks) and full.lean_chunks == frozenset()
    assert any(len(s.pieces) > 1 for s in lean.layout.slots)  # a leaf spanning chunks
    @jax.jit
    def ref_step(ref, s):  # plain optax on the whole tree
        u, s = tx.update(grad_fn(ref), s, ref)
        return optax.apply_updates(ref, u), s
    ref, s = params, tx.init(params)
    p_lean = p_full = params
    for _ in range(3):
        ref, s = ref_step(ref, s)
        p_lean, p_full = lean.update(grad_fn(p_lean)), full.update(grad_fn(p_full))
    for k in params:
        np.testing.assert_array_equal(np.asarray(p_lean[k]), np.asarray(p_full[k]), err_msg=k)
        np.testing.assert_array_equal(np.asarray(lean.master_params()[k]), np.asarray(full.master_params()[k]))
        np.testing.assert_allclose(np.asarray(p_lean[k]), np.asarray(ref[k]), rtol=2e-5, atol=2e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(lean.opt_state), jax.tree.leaves(full.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    n, cs = len(lean.streamed_chunks), lean.layout.chunk_size
    bl, bf = lean.last_update, full.last_update
    assert (bl.h2d_bytes, bl.d2h_bytes) == (bf.h2d_bytes - 4 * cs * n, bf.d2h_bytes - 4 * cs * n)
    assert lean.predicted_update.h2d_s < full.predicted_update.h2d_s
    half = cj.build_layout(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), 64)
    assert dropin.lean_chunks(half, range(half.n_chunks)) == frozenset()  # bf16 params are not the master
    assert dropin.lean_chunks(lean.layout, range(lean.layout.n_chunks)) == frozenset(range(lean.layout.n_chunks))
    g = grad_fn(p_lean)
    for x in jax.tree.leaves(p_lean):
        x.delete()
    with pytest.raises(ValueError, match="lean_streamed=False"):
        lean.update(g)
