"""Host updates overlap the backward with clipping, non-finite skip and micro-batches, exactly
(issue 23 item 2; :mod:`chunkjax.speculate`), and the planner's split of offloaded updates between
the host and the device (item 1).

The host thread speculates only on chunks whose update starts before the global norm is known;
on a CPU the tiny programs often finish first, so the tests force the speculative branch
(``_known`` reports the norm unknown until the validation) and check the counts of speculated and
redone chunks against the speculation policy (by default no speculation on the step after one
where clipping fired). Rollback is by backup (the default) unless a test says ``rollback="invert"``; the
kernels and the speculation alone: tests/test_rollback.py. Reference: plain optax on the device,
fp32 compute (tolerances as tests/test_schedule.py).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import speculate
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import NEAR_TIE, plan_schedule
from chunkjax.program_cut import auto_segments, uniform_segments

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

from _compiles import assert_compiles_only_first, count_compiles

B, T = 2, 16
STEPS = 20


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 7, 3, B, T, STEPS)  # 2 blocks: shorter compiles, still host and streamed chunks


def _schedule(setup, spec, mb=1):
    """Chunk 0 resident (device update), the rest host-updated, three programs."""
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops,
                          resident=[0], segments=(0, len(stages) + 1, len(roomy.moments) - 1))
    assert set(sched.update_locations) == {"device", "host"}
    return sched


_PROGRAMS: dict = {}


def _step(stages, layout, sched, **kw):
    """``make_chunked_step``, its programs (traced, jitted and compiled per batch shape) those of
    this module's earlier step of the same schedule and device-side options: the host-side ones
    (the host optimizer, rollback, speculation bytes and policy) do not enter the programs (as
    tests/test_micro_cuts.py shares them across ``cross_step``); built once, not per test."""
    step = cj.make_chunked_step(stages, layout, sched, **kw)
    host = ("host_optimizer", "rollback", "speculation_bytes", "speculation_policy")
    key = (repr(sched), tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in host)))
    step.__dict__["_cache"] = _PROGRAMS.setdefault(key, step._cache)
    return step


@pytest.fixture
def speculate_always(monkeypatch):
    """Every host chunk's update starts before the norm is known (the GPU's case)."""
    monkeypatch.setattr(speculate.Speculation, "_known", lambda self: self.certain)


_REFERENCES = {}


def _reference(cfg, params, batches, spec, micro_batches=1):
    """Plain optax on the device (fp32): losses, global norms, final params; with micro-batches
    the gradient is the float32 mean of the parts' gradients, summed in order. Computed once per
    (spec, micro-batches, number of batches): every caller passes the module's setup params and a
    prefix of its batches."""
    key = (spec, micro_batches, len(batches))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(cfg, params, batches, spec, micro_batches)
    return _REFERENCES[key]


def _reference_run(cfg, params, batches, spec, micro_batches):
    return micro_batch_reference(cfg, params, batches, spec.optax(), micro_batches, rows=B)

def _train(step, params, batches, micro_batches=1):
    """Train ``step`` on ``batches``: (state, losses, per step (speculated, redone)). Checks that
    only the first step traces or compiles (the programs are cached by batch shape)."""
    state, losses, counts, compiles = step.init(params), [], [], []
    for b in batches:
        with count_compiles() as n:
            state, m = step(state, b if micro_batches > 1 else b[:B])
            losses.append(float(m["loss"]))
            step.wait(state)
        compiles.append(n)
        sp = state.pending.speculation
        counts.append((sp.speculated, sp.redone))
    assert_compiles_only_first(compiles, "ChunkedStep")
    return state, np.asarray(losses), counts


def _assert_equal_to_optax(step, state, losses, ref):
    ref_p, ref_losses, _ = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def _assert_policy(counts, fired, n_host, policy="after_common"):
    """Per step (speculated, redone): every host chunk speculated after each step where clipping
    did not fire, none on the first step or after one where it fired (``"after_common"``), or on
    every step (``"always"``); redone exactly on the speculated steps where clipping fired."""
    for k, (s, r) in enumerate(counts):
        want = n_host if (policy == "always" or (k > 0 and not fired[k - 1])) else 0
        assert (s, r) == (want, want * bool(fired[k])), (k, counts, list(fired))


@pytest.mark.parametrize("policy", ["after_common", "always"])
def test_clipping_that_rarely_fires_equals_optax(setup, speculate_always, policy):
    """20 steps with a threshold the norm passes on a few steps: speculated updates are kept on
    the others and inverted and redone on those (after one, the policy waits); equals optax."""
    cfg, params, batches, stages, layout, traces = setup
    _, _, free_norms = _reference(cfg, params, batches, AdamW(3e-3, weight_decay=0.1))
    clip = float(np.sort(free_norms)[-3])  # about 2-3 of 20 steps clip
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref = _reference(cfg, params, batches, spec)
    fired = ref[2] >= clip
    assert 0 < fired.sum() <= 5
    step = _step(stages, layout, _schedule(setup, spec), host_optimizer=spec,
                 compute_dtype=jnp.float32, speculation_policy=policy)
    state, losses, counts = _train(step, params, batches)
    _assert_equal_to_optax(step, state, losses, ref)
    _assert_policy(counts, fired, len(step.host_chunks), policy)


@pytest.mark.parametrize("rollback, policy", [("invert", "after_common"), ("backup", "always")])
def test_clipping_that_always_fires_equals_optax(setup, speculate_always, rollback, policy):
    """A threshold far below the norm: every step waits for the norm (the policy: the first step,
    then each after one that clipped); with backups and the policy off every step's chunks are
    speculated, restored and redone (inverting there is the ill-conditioned regime: docs/design.md)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1e-3)
    ref = _reference(cfg, params, batches[:6], spec)
    assert (ref[2] > 1e-3).all()
    step = _step(stages, layout, _schedule(setup, spec), host_optimizer=spec,
                 compute_dtype=jnp.float32, rollback=rollback, speculation_policy=policy)
    state, losses, counts = _train(step, params, batches[:6])
    _assert_equal_to_optax(step, state, losses, ref)
    _assert_policy(counts, [True] * 6, len(step.host_chunks), policy)


def test_bounded_pool_and_no_speculation_are_bit_identical(setup, speculate_always):
    """Rollback by backup, the policy off: a pool with room for one chunk speculates on one chunk
    a step and waits for the norm on the rest; no pool (0 bytes) waits on every chunk; both give
    the same bits as a roomy pool. Rollback by inversion likewise with a bound on the kept
    gradients (clipping fires on every step: every speculated chunk inverted and redone)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)
    sched = _schedule(setup, spec)
    out = {}
    for pool in (None, 12 * layout.chunk_size, 0):
        step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                     speculation_bytes=pool, rollback="backup", speculation_policy="always")
        state, losses, counts = _train(step, params, batches[:4])
        out[pool] = [np.asarray(m) for m in state.master], losses, counts
        assert state.pending.backups.peak_in_use_bytes <= (pool if pool is not None else 1 << 40)
    assert all(s == 1 for s, _ in out[12 * layout.chunk_size][2])
    assert all(s == 0 for s, _ in out[0][2])
    for pool in (12 * layout.chunk_size, 0):
        np.testing.assert_array_equal(out[pool][1], out[None][1])
        for a, b in zip(out[pool][0], out[None][0]):
            np.testing.assert_array_equal(a, b)
    # rollback by inversion, the policy off: all chunks, one chunk's gradient (float32) or none kept
    # before the norm; the waiting chunks get the speculated chunks' arithmetic: the same bits
    inv = {}
    for bound in (None, 4 * layout.chunk_size, 0):
        step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                     speculation_bytes=bound, rollback="invert", speculation_policy="always")
        state, losses, counts = _train(step, params, batches[:4])
        inv[bound] = [np.asarray(m) for m in state.master], losses, counts
    assert [s for s, _ in inv[4 * layout.chunk_size][2]] == [1] * 4 and [s for s, _ in inv[0][2]] == [0] * 4
    assert all(r for _, r in inv[None][2])
    for bound in (4 * layout.chunk_size, 0):
        np.testing.assert_array_equal(inv[bound][1], inv[None][1])
        for a, b in zip(inv[bound][0], inv[None][0]):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="speculation_bytes"):
        speculate.BackupPool(-1)
    pool = speculate.BackupPool(1 << 30)  # a chunk above the parallel-copy threshold, copied by all cores
    src = np.random.default_rng(0).standard_normal(3 * speculate._PARALLEL_COPY_MIN + 5).astype(np.float32)
    (dst,) = pool.take([src.size])
    pool.copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    pool.give([dst])
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == pool.peak_in_use_bytes == 4 * src.size


@pytest.mark.parametrize("rollback", ["backup", "invert"])
def test_nonfinite_step_restores_speculated_chunks(setup, speculate_always, rollback):
    """nonfinite="skip": the speculated host chunks are put back exactly (master, moments, step
    count) from their backups, and their compute params are the cast master params; by inversion
    none is speculated (every host gradient holds a NaN: the old state would be lost), so nothing
    changes; the next step is the one an uninterrupted run of the same step takes (bit for bit: the
    same programs; a step without nonfinite="skip" compiles other fusions, equal only to a few ulp under
    XLA's LLVM-IR fusion emitter, tests/conftest.py's COMPILE_FLAGS)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
    sched = _schedule(setup, spec)
    step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                 nonfinite="skip", rollback=rollback, speculation_policy="always")
    state, m = step(step.init(params), batches[0][:B])
    step.wait(state)
    before = [np.array(a, copy=True) for a in state.master]
    host = step.host_chunks
    moments = {c: (np.array(state.opt_state[c].m), np.array(state.opt_state[c].v), state.opt_state[c].count)
               for c in host}
    bad = list(state.params)
    bad[0] = jnp.full_like(bad[0], jnp.nan)
    state2, m = step(cj.TrainState(tuple(bad), state.master, state.opt_state, state.pending), batches[1][:B])
    step.wait(state2)
    assert bool(m["skipped"])
    assert state2.pending.speculation.redone == (len(host) if rollback == "backup" else 0) and host
    for a, b in zip(state2.master, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    for c in host:
        m_, v_, n_ = moments[c]
        np.testing.assert_array_equal(state2.opt_state[c].m, m_)
        np.testing.assert_array_equal(state2.opt_state[c].v, v_)
        assert state2.opt_state[c].count == n_
        np.testing.assert_array_equal(np.asarray(state2.params[c]), before[c])
    ref = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32, nonfinite="skip",
                rollback=rollback, speculation_policy="always")  # the same programs: bit for bit on any XLA emitter
    s_ref, _, _ = _train(ref, params, [batches[0], batches[2]])
    state3, _ = step(state2, batches[2][:B])
    step.wait(state3)
    for a, b in zip(state3.master, s_ref.master):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_four_micro_batches_with_clipping_equal_optax(setup, speculate_always):
    """4 micro-batches, clipping firing on some steps: the host chunks' sums run on their own
    thread, their updates start in the last micro-batch; equals optax on the mean gradient. The
    step runs a cut of two moments per program with a gradient window of 4 programs."""
    cfg, params, batches, stages, layout, traces = setup
    _, _, free_norms = _reference(cfg, params, batches, AdamW(3e-3, weight_decay=0.1), micro_batches=4)
    clip = float(np.median(free_norms))
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref = _reference(cfg, params, batches, spec, micro_batches=4)
    sched = _schedule(setup, spec)
    sched = dataclasses.replace(sched, segments=uniform_segments(len(sched.moments), len(stages), 2), grad_window=4)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32, micro_batches=4)
    assert step.grad_window == 4
    state, losses, counts = _train(step, params, batches, micro_batches=4)
    _assert_equal_to_optax(step, state, losses, ref)
    _assert_policy(counts, ref[2] >= clip, len(step.host_chunks))
    assert 0 < sum(r > 0 for _, r in counts) < STEPS


# ---- update placement by rate (issue 23 item 1) --------------------------------------------------

def _plan_inputs(setup, spec):
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    with pytest.raises(cj.PlanError) as e:
        plan_schedule(layout, traces, cb, 1000, flops_per_step=1e9)
    return layout, traces, cb, e.value.min_budget_bytes, cfg.flops_per_token(T) * B * T


@pytest.mark.parametrize("host_ns", [0.27, 2.0, 0.01])
def test_split_is_the_cost_models_fastest(setup, host_ns):
    """At the smallest budget (every chunk offloaded), the planner moves host chunks to
    ``streamed``, the ones whose gradients complete last or ones spread over the backward, in the
    number that minimises the predicted step (checked against every count of both), for a fast,
    a slow and a very fast host kernel; with ``split=False`` every offloaded chunk stays on the
    host."""
    from chunkjax import predict as pr
    from chunkjax.cost import Rates
    from chunkjax.tide import memory_tide
    spec = AdamW(3e-3, weight_decay=0.1)
    layout, traces, cb, budget, flops = _plan_inputs(setup, spec)
    rates = Rates(host_update_s_per_param=host_ns * 1e-9)
    tide = memory_tide(traces, layout.chunk_size)
    # the split for one cut (the doubling cut, window 2): the cut's own choice is
    # tests/test_overlap_window.py's
    kw = dict(flops_per_step=flops, rates=rates, segments=auto_segments(len(tide.moments), len(traces)))
    host_only = plan_schedule(layout, traces, cb, budget, split=False, **kw)
    assert set(host_only.update_locations) == {"host"}
    done = pr.grad_done_moments(traces, tide)
    n = layout.n_chunks
    first = sorted(range(n), key=lambda c: (done.get(c, len(tide.moments)), c))
    families = {"last": lambda j: set(first[n - j:]),
                "spread": lambda j: {first[(2 * i + 1) * n // (2 * j)] for i in range(j)}}
    times = {}
    for name, pick in families.items():
        for j in range(n + 1):
            loc = tuple("streamed" if j and c in pick(j) else "host" for c in range(n))
            p = pr.predict(layout.chunk_size, traces, tide, cb, host_only.param_kinds, loc, host_only.fetch,
                           host_only.segments, host_only.predicted.device_bytes_per_moment, flops_per_step=flops,
                           rates=rates)
            times[loc] = p.time.step_s if p.peak_device_bytes <= budget else np.inf
    s = plan_schedule(layout, traces, cb, budget, **kw)
    j = sum(u == "streamed" for u in s.update_locations)
    assert s.update_locations in times  # one of the two families
    assert s.predicted.time.step_s == pytest.approx(times[s.update_locations], rel=1e-12)
    assert s.predicted.time.step_s <= min(times.values()) * (1 + 0.02)
    t = s.predicted.time
    if host_ns == 0.01:  # a host this fast finishes inside the step: nothing to move
        assert j == 0
    else:
        assert 0 < j < n
        assert t.step_s < host_only.predicted.time.step_s
        assert t.step_s == pytest.approx(t.forward_s + t.backward_s + t.window_stall_s + t.device_update_s
                                         + max(t.host_update_exposed_s, t.streamed_update_s))


def test_mixed_host_and_streamed_step_equals_optax(setup, speculate_always):
    """The split schedule (host and streamed chunks) with clipping runs the host kernel and the
    streamed updates in the same step; equals optax over 8 steps (clipping fires on some; the
    policy off, so that speculated chunks are inverted and redone beside the streamed ones)."""
    cfg, params, batches, stages, layout, traces = setup
    _, _, free = _reference(cfg, params, batches[:8], AdamW(3e-3, weight_decay=0.1))
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=float(np.median(free)))
    layout, traces, cb, budget, flops = _plan_inputs(setup, spec)
    sched = plan_schedule(layout, traces, cb, budget, flops_per_step=flops)
    assert set(sched.update_locations) == {"host", "streamed"}
    step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                 speculation_policy="always")
    state, losses, counts = _train(step, params, batches[:8])
    ref = _reference(cfg, params, batches[:8], spec)
    _assert_equal_to_optax(step, state, losses, ref)
    _assert_policy(counts, ref[2] >= spec.max_grad_norm, len(step.host_chunks), "always")
    assert any(r for _, r in counts)


# ---- the streamed pipeline overlapping the backward (chunkjax.streamed) ---------------------------

def test_norm_free_transformations_are_told_apart_exactly():
    """needs_global_norm follows the data path from the rest-of-model norm to a chunk's result:
    Adam/AdamW/Lion/SGD (with schedules) have none, clip_by_global_norm has one; a step with
    skip, loss scaling, micro-batches or a mesh never starts early."""
    from chunkjax.streamed import needs_global_norm, starts_early
    free = [optax.adamw(1e-3, weight_decay=0.1), optax.lion(1e-4), optax.sgd(1e-2, momentum=0.9),
            optax.adamw(optax.cosine_decay_schedule(1e-3, 100)), AdamW(1e-3).optax()]
    bound = [optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), AdamW(1e-3, max_grad_norm=1.0).optax()]
    assert [needs_global_norm(t) for t in free] == [False] * len(free)
    assert [needs_global_norm(t) for t in bound] == [True] * len(bound)
    tx = free[0]
    assert starts_early(tx)
    assert not any([starts_early(tx, skip=True), starts_early(tx, loss_scaling=True),
                    starts_early(tx, micro_batches=2), starts_early(tx, n_ranks=2)])


def test_streamed_updates_start_during_the_backward_and_equal_optax(setup, monkeypatch):
    """Without clipping, streamed chunks go to the pipeline as the program completing their
    gradient ends (the chunks completing before the last program stream, the others update on the
    host), through a pipeline of two slots with its own fetch, dispatch and write-back threads; 8
    steps equal optax, and the master params equal those of the same schedule with the updates
    after the backward."""
    from chunkjax import streamed
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    layout, traces, cb, budget, flops = _plan_inputs(setup, spec)
    split = plan_schedule(layout, traces, cb, budget, flops_per_step=flops, streamed_early=True)
    late_plan = plan_schedule(layout, traces, cb, budget, flops_per_step=flops)  # the split takes the faster way
    assert not late_plan.streamed_early
    assert split.predicted.time.step_s <= late_plan.predicted.time.step_s * (1 + NEAR_TIE)
    done = cj.predict.grad_done_moments(traces, cj.tide.memory_tide(traces, layout.chunk_size))
    early = [c for c in range(layout.n_chunks) if done.get(c, 10**9) < split.segments[-1]]
    sched = dataclasses.replace(split, update_locations=tuple(
        "streamed" if c in early else "host" for c in range(layout.n_chunks)), streamed_early=True)
    assert 0 < len(early) < layout.n_chunks and len(sched.segments) > 1
    assert cj.Schedule.from_dict(sched.to_dict()) == sched
    seen = []
    on_program = streamed.StepStream.on_program

    def spy(self, grads, sq):
        on_program(self, grads, sq)
        seen.append(self.pipe.submitted)
    monkeypatch.setattr(streamed.StepStream, "on_program", spy)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)
    state, losses, _ = _train(step, params, batches[:8])
    n_prog = len(sched.segments)
    assert step.stream_spec.early is True and len(seen) == 8 * n_prog
    assert step.streamed_chunks == tuple(early) and seen[n_prog - 2] == len(early)  # before the last program
    _assert_equal_to_optax(step, state, losses, _reference(cfg, params, batches[:8], spec))
    late = cj.make_chunked_step(stages, layout, dataclasses.replace(sched, streamed_early=False), host_optimizer=spec,
                                compute_dtype=jnp.float32)
    state_late, losses_late, _ = _train(late, params, batches[:8])
    assert late.stream_spec.early is False
    np.testing.assert_array_equal(losses_late, losses)
    for a, b in zip(state_late.master, state.master):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pipeline_failures_stop_every_thread():
    """A failing fetch or update is raised by close() and a failing store by join(); abort()
    stops a pipeline waiting for chunks; no thread is left behind."""
    import threading

    from chunkjax.streamed import Pipeline
    before = set(threading.enumerate())  # threads of earlier tests (a host-update thread) may end meanwhile
    ok = lambda c: (c,)  # noqa: E731

    def boom(c, *a):
        raise RuntimeError(f"chunk {c} failed")
    for fetch, update, store, where in ((boom, ok, lambda *a: None, "close"), (ok, boom, lambda *a: None, "close"),
                                        (ok, lambda c, x: (x,), boom, "join")):
        p = Pipeline(2, fetch, update, store)
        p.submit(range(5))
        with pytest.raises(RuntimeError, match="chunk 0 failed"):
            p.close().join()
    p = Pipeline(2, ok, ok, lambda *a: None)
    p.submit([1])
    p.abort()
    assert set(threading.enumerate()) <= before


# ---- the cost model of the streamed pipeline (synthetic numbers in, times out) --------------------

def test_streamed_pipeline_timing_on_a_synthetic_schedule():
    """Hand-computed times: rates of 1 byte/s each way (duplex 2), the update program free."""
    from chunkjax.cost import Rates, predict_pipelined_step, streamed_pipeline_end
    r = Rates(h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0, duplex_bytes_per_s=2.0, device_update_s_per_param=0.0,
              host_update_s_per_param=1.0, matmul_flops_per_s=1.0, one_program_duplex_bytes_per_s=1.0)
    end = lambda chunks, depth=2, bounds=(), until=0.0, share=1.0: streamed_pipeline_end(  # noqa: E731
        chunks, params_per_chunk=1, depth=depth, boundaries=bounds, backward_end=until, share=share, rates=r)
    # after the backward: fetches back to back (3 s each), write-backs (2 s) follow: 3, 6, 9 -> 5, 8, 11
    assert end([(0.0, 3, 2)] * 3) == 11.0
    # one slot: fetch, update, write-back of a chunk before the next fetch: 3+2, 5+3+2, 10+3+2
    assert end([(0.0, 3, 2)] * 3, depth=1) == 15.0
    # during a backward ending at 20 with half the link left, programs ending at 10 and 15: fetch
    # 0-6 (at 0.5 B/s), the update dispatched at the boundary 10 runs at the next one, 15,
    # write-back 15-19; the second chunk, ready at 12: fetch 12-18, update at the backward's end
    # 20, write-back 20-22
    assert end([(0.0, 3, 2), (12.0, 3, 2)], bounds=(10.0, 15.0), until=20.0, share=0.5) == 22.0
    # a transfer crossing the backward's end: 2 bytes at 0.5 B/s until 19, then 1 byte at 1 B/s
    assert end([(17.0, 2, 1)], until=19.0, share=0.5) == pytest.approx(19.0 + 1.0 + 1.0)
    # the whole step: forward 1 s and backward 3 s of compute (3 FLOPs at 1 FLOP/s), no transfers
    # in it, programs ending at t = 2, 3, 4; a host chunk of 1 param ready at t = 2 ends at 3
    # (nothing exposed); a streamed chunk of 1 byte up, 2 down completing in the first program:
    # early, fetched 2-3, dispatched at the boundary 3, run at the backward's end 4, written back
    # 4-6 (2 s after the backward); after the norm: fetched 4-5, written back 5-7
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, host_ready=[(1 / 3, 1)], params_per_chunk=1,
              program_ends=(1 / 3, 2 / 3, 1.0), rates=r)
    t = predict_pipelined_step(3.0, streamed=[(1 / 3, 1, 2)], streamed_early=True, **kw)
    assert (t.forward_s, t.backward_s, t.host_update_s, t.host_update_exposed_s) == (1.0, 3.0, 1.0, 0.0)
    assert t.streamed_update_s == pytest.approx(2.0) and t.step_s == pytest.approx(6.0)
    late = predict_pipelined_step(3.0, streamed=[(1 / 3, 1, 2)], streamed_early=False, **kw)
    assert late.streamed_update_s == pytest.approx(3.0) and late.step_s == pytest.approx(7.0)


# ---- the gradient window and the program cut (issue 23; the timeline: test_overlap_window.py) ------

def test_window_three_with_streamed_early_equals_optax(setup):
    """A cut of one backward moment per program, window 3, the first host chunks streamed and
    started as their gradients are ready (no clipping): 3 steps equal optax."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    sched = _schedule(setup, spec)
    T = len(sched.moments)
    host = [c for c, u in enumerate(sched.update_locations) if u == "host"]
    sched = dataclasses.replace(sched, segments=uniform_segments(T, len(stages), 1), grad_window=3,
                                streamed_early=True,
                                update_locations=tuple("streamed" if c in host[:2] else u
                                                       for c, u in enumerate(sched.update_locations)))
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)
    assert step.grad_window == 3 and step.stream_spec.early and len(step.program_bounds()) == len(stages)
    state, losses, _ = _train(step, params, batches[:3])
    _assert_equal_to_optax(step, state, losses, _reference(cfg, params, batches[:3], spec))
