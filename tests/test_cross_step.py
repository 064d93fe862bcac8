"""Cross-step overlap (:mod:`chunkjax.cross_step`): the next step starts while the previous
step's host updates run on, each program waiting only for the host chunks it takes; exact.

No test here calls ``step.wait`` between steps (that would join everything and leave nothing to
overlap); the programs cut the forward (one program per forward moment), so that the next step's
first programs take only some host chunks. Every run is compared with optax (fp32 tolerances of
tests/test_overlap.py) and, bit for bit, with the same step joining the previous one at its start
(``cross_step=False``), also on a 2-rank ZeRO mesh. The speculative branch is forced as in
tests/test_overlap.py.
"""
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import cost, cross_step, host_work, speculate
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 20


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 11, 5, B, T, STEPS)


def _schedule(setup, spec, window=None):
    """Chunk 0 resident, the rest host-updated; one program per forward moment, then the fused
    head with one backward moment, the rest of the backward in two programs (``window``: another
    gradient window)."""
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    n, moments = len(stages), len(roomy.moments)
    segs = tuple(range(n)) + (n + 1, moments - 1)
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops, resident=[0],
                          segments=segs)
    assert set(sched.update_locations) == {"device", "host"} and sched.segments == segs
    return sched if window is None else dataclasses.replace(sched, grad_window=window)


@pytest.fixture
def speculate_always(monkeypatch):
    """Every host chunk's update starts before the norm is known (the GPU's case)."""
    monkeypatch.setattr(speculate.Speculation, "_known", lambda self: self.certain)


#: options of ``make_chunked_step`` that run on the host and enter no program
_HOST_SIDE = ("rollback", "speculation_policy", "nonfinite")
_PROGRAMS: dict = {}


def _pair(setup, spec, window=None, **kw):
    """(cross-step step, the same step joining at its start), sharing compiled programs; the
    programs (traced, jitted and compiled per batch shape) are those of this module's earlier pair
    of the same schedule and device-side options (the host optimizer, the speculation's rollback
    and policy and the non-finite policy run on the host: as tests/test_host_bytes.py's ``_step``)."""
    cfg, params, batches, stages, layout, traces = setup
    sched = _schedule(setup, spec, window)
    on = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32, **kw)
    key = (repr(sched), tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in _HOST_SIDE)))
    on.__dict__["_cache"] = _PROGRAMS.setdefault(key, on._cache)
    off = dataclasses.replace(on, cross_step=False)
    off.__dict__["_cache"] = on._cache  # the programs do not depend on cross_step
    assert on.cross_step and not off.cross_step
    return on, off


def _run(step, params, batches, rows=B, edit=None):
    """Train without waiting between steps: (final state, losses, metrics, each step's host work)."""
    state, losses, metrics, works = step.init(params), [], [], []
    for i, b in enumerate(batches):
        if edit is not None:
            state = edit(i, state)
        state, m = step(state, b[:rows])
        losses.append(m["loss"])
        metrics.append(m)
        works.append(state.pending)
    step.wait(state)
    return state, np.asarray([float(x) for x in losses]), metrics, works


def _assert_same(step, a, b):
    """Bit for bit: losses and every chunk's master params and optimizer state."""
    (sa, la), (sb, lb) = a, b
    np.testing.assert_array_equal(la, lb)
    for c in range(step.layout.n_chunks):
        np.testing.assert_array_equal(np.asarray(sa.master[c]), np.asarray(sb.master[c]))
        np.testing.assert_array_equal(np.asarray(sa.params[c]), np.asarray(sb.params[c]))
        for x, y in zip(_leaves(sa.opt_state[c]), _leaves(sb.opt_state[c])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _leaves(opt_state) -> list:
    """The arrays and counts of a chunk's optimizer state (a host state is a dataclass)."""
    if dataclasses.is_dataclass(opt_state):
        return [getattr(opt_state, f.name) for f in dataclasses.fields(opt_state)]
    return jax.tree.leaves(opt_state)


def _assert_optax(step, state, losses, ref):
    ref_p, ref_losses, _ = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


_REFS = {}


def _ref(setup, spec, micro_batches=1):
    cfg, params, batches = setup[:3]
    key = (spec, micro_batches)
    if key not in _REFS:
        _REFS[key] = micro_batch_reference(cfg, params, batches, spec.optax(), micro_batches, rows=B)
    return _REFS[key]


@pytest.mark.parametrize("fires, rollback, policy", [("never", "backup", "after_common"),
                                                     ("some", "invert", "after_common"),
                                                     ("every", "backup", "always")])
def test_cross_step_equals_optax_and_the_joined_step(setup, speculate_always, fires, rollback, policy):
    """20 steps, host chunks updated speculatively, clipping that never fires, fires on a few
    steps or on every step: equal to optax, bit for bit the step that joins at its start, and the
    speculation policy reads the previous step's outcome as it does there."""
    cfg, params, batches = setup[:3]
    free = _ref(setup, AdamW(3e-3, weight_decay=0.1))[2]
    clip = {"never": 1e6, "some": float(np.sort(free)[-3]), "every": float(np.min(free)) / 4}[fires]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref = _ref(setup, spec)
    fired = ref[2] >= clip
    assert {"never": fired.sum() == 0, "some": 0 < fired.sum() <= 5, "every": fired.all()}[fires]
    on, off = _pair(setup, spec, rollback=rollback, speculation_policy=policy)
    s_on, l_on, _, works = _run(on, params, batches)
    s_off, l_off, _, _ = _run(off, params, batches)
    _assert_optax(on, s_on, l_on, ref)
    _assert_same(on, (s_on, l_on), (s_off, l_off))
    n = len(on.host_chunks)
    for k, w in enumerate(works):  # every work joined by the step after it (the last by wait)
        sp = w.speculation
        want = n if (policy == "always" or (k > 0 and not fired[k - 1])) else 0
        assert (sp.speculated, sp.redone) == (want, want * bool(fired[k])), k


def test_nonfinite_skip_matches_the_joined_step(setup, speculate_always):
    """nonfinite="skip": a step whose gradients are all NaN (chunk 0's params poisoned) changes no
    state though the previous step's host updates were still running when it began; the run is
    bit for bit the joined step's, and its other steps equal optax on the batches not skipped."""
    cfg, params, batches = setup[:3]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1e6)
    on, off = _pair(setup, spec, nonfinite="skip", speculation_policy="always")
    bad_at = 3

    def poison(i, state):
        if i != bad_at:
            return state
        p = list(state.params)
        p[0] = jnp.full_like(p[0], jnp.nan)
        return state._replace(params=tuple(p))

    s_on, l_on, m_on, _ = _run(on, params, batches[:6], edit=poison)
    s_off, l_off, m_off, _ = _run(off, params, batches[:6], edit=poison)
    assert [bool(m["skipped"]) for m in m_on] == [i == bad_at for i in range(6)]
    _assert_same(on, (s_on, np.nan_to_num(l_on)), (s_off, np.nan_to_num(l_off)))
    keep = [b for i, b in enumerate(batches[:6]) if i != bad_at]
    ref_p, ref_l, _ = micro_batch_reference(cfg, params, keep, spec.optax(), 1, rows=B)
    np.testing.assert_allclose(np.delete(l_on, bad_at), ref_l, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(on.master_params(s_on)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("accumulation", ["per_micro_batch", "in_program"])
def test_micro_batches_equal_optax(setup, speculate_always, accumulation):
    """4 micro-batches (summed on host threads, or looped inside each moment), clipping firing on
    some steps: equal to optax on the mean gradient over 20 steps, bit for bit the joined step."""
    cfg, params, batches = setup[:3]
    free = _ref(setup, AdamW(3e-3, weight_decay=0.1), 4)[2]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=float(np.median(free)))
    ref = _ref(setup, spec, 4)
    on, off = _pair(setup, spec, micro_batches=4, accumulation=accumulation)
    s_on, l_on, _, _ = _run(on, params, batches, rows=4 * B)
    _assert_optax(on, s_on, l_on, ref)
    s_off, l_off, _, _ = _run(off, params, batches[:4], rows=4 * B)
    s_on4, l_on4, _, _ = _run(on, params, batches[:4], rows=4 * B)
    _assert_same(on, (s_on4, l_on4), (s_off, l_off))


def test_next_step_starts_before_the_previous_steps_last_host_chunk(setup, monkeypatch):
    """Instrumented: the first host update of step 1 is held until step 1 has returned, so that
    every other chunk waits ready; they then run in step 2's read order (the chunks its first
    program takes first), and the last one is held until step 2 dispatches its first program:
    that dispatch happens while step 1's last host chunk is not done. Bit for bit the joined step."""
    cfg, params, batches = setup[:3]
    spec = AdamW(3e-3, weight_decay=0.1)
    on, off = _pair(setup, spec, window=8)  # the held update must not hold the programs back
    b = batches[0][:B]
    need = cross_step.host_need(on, b)
    first_args = set(on._program_args(b, *on.program_bounds()[0]))
    late = sorted(c for c in on.host_chunks if c not in first_args)
    assert late and need[late[0]] > 0
    monkeypatch.setattr(host_work, "_ready", lambda g: True)  # every gradient counts as there (deterministic)
    order = sorted(on.host_chunks, key=lambda c: (need.get(c, 99), c))
    release_first, release_last = threading.Event(), threading.Event()
    seen, done_last = {}, threading.Event()
    real_update = type(on).update_host_chunks

    def update(state, grads, scale):
        (c,) = grads
        if seen.setdefault("first", c) == c and not release_first.is_set():
            assert release_first.wait(60)
        if c == order[-1] and "dispatched" not in seen:
            assert release_last.wait(60)
            out = real_update(on, state, grads, scale)
            done_last.set()
            return out
        return real_update(on, state, grads, scale)

    real_runnable = type(on).runnable

    def runnable(batch, k, compiled=None):
        fn, args = real_runnable(on, batch, k, compiled)
        if k != 0 or "dispatched" in seen or "step2" not in seen:
            return fn, args

        def first(*a):
            seen["dispatched"] = done_last.is_set()
            seen["args_final"] = all(work1[0]._final[c].done() for c in first_args if c in on.host_chunks)
            release_last.set()
            return fn(*a)
        return first, args

    state0 = on.init(params)
    object.__setattr__(on, "update_host_chunks", update)
    object.__setattr__(on, "runnable", runnable)
    state1, _ = on(state0, b)
    work1 = [state1.pending]
    release_first.set()
    seen["step2"] = True
    state2, _ = on(state1, batches[1][:B])
    on.wait(state2)
    assert seen["dispatched"] is False  # step 2 ran its first program before step 1's last host chunk was done
    assert seen["args_final"]  # ... and after the host chunks that program takes
    first, rest = work1[0].order_log[0], work1[0].order_log[1:]
    assert first != order[-1] and sorted(rest) == sorted(c for c in order if c != first)
    assert [need[c] for c in rest] == sorted(need[c] for c in rest) and need[rest[0]] == 0  # read order
    object.__delattr__(on, "update_host_chunks")
    object.__delattr__(on, "runnable")
    ref = off.init(params)
    for x in batches[:2]:
        ref, _ = off(ref, x[:B])
    off.wait(ref)
    _assert_same(on, (state2, np.zeros(1)), (ref, np.zeros(1)))


def test_failing_host_update_surfaces_at_the_next_step_and_wait(setup):
    """A host update that raises: the next step raises it (one line) before its commit, leaving
    its input state as it was (nothing donated, the failure kept: ``wait`` and another call raise
    it again), and no host-update thread is left running."""
    cfg, params, batches = setup[:3]
    spec = AdamW(3e-3, weight_decay=0.1)
    on, _ = _pair(setup, spec)
    state, _ = on(on.init(params), batches[0][:B])
    on.wait(state)  # the failure below is the next step's
    before = set(threading.enumerate())  # earlier tests of this process may have abandoned threads
    real_update = type(on).update_host_chunks
    failing = {"on": True}

    def update(st, grads, scale):
        if failing["on"] and next(iter(grads)) == on.host_chunks[-1]:
            failing["on"] = False  # once: its host thread may run it after the step has returned
            raise RuntimeError("host kernel failed on purpose")
        return real_update(on, st, grads, scale)

    object.__setattr__(on, "update_host_chunks", update)
    state1, _ = on(state, batches[1][:B])
    for _ in range(2):
        with pytest.raises(RuntimeError, match="host kernel failed on purpose") as e:
            on(state1, batches[2][:B])
        assert "\n" not in str(e.value)
    assert not any(getattr(p, "is_deleted", lambda: False)() for p in state1.params)
    with pytest.raises(RuntimeError, match="host kernel failed on purpose"):
        on.wait(state1)
    for t in [t for t in threading.enumerate() if t.name == "chunkjax-host-update" and t not in before]:
        t.join(timeout=60)
        assert not t.is_alive()


def test_cross_step_wait_and_the_planners_prediction(setup):
    """The cost model: the tail the host leaves is the chunks read last, updated in read order;
    the next forward waits only where the host is behind its reads. The planner with
    ``cross_step`` tries forward cuts and predicts no slower a step than without."""
    # 3 s of tail: chunks of 1 s read at 0, 1/2 and all of a 2 s forward; the tail is the last
    # three read: done at 1, 2, 3 s against reads at 0, 1, 2 s: the forward waits 1 s
    chunks = [(1.0, 0.0), (1.0, 0.5), (1.0, 1.0), (1.0, 0.0)]
    assert cost.cross_step_wait(3.0, chunks, 2.0) == pytest.approx(1.0)
    assert cost.cross_step_wait(0.0, chunks, 2.0) == 0.0
    assert cost.cross_step_wait(1.0, chunks, 2.0) == 0.0  # the tail is read at the forward's end
    assert cost.cross_step_wait(3.0, [(1.0, 0.0)] * 4, 2.0) == pytest.approx(3.0)  # one forward program
    assert cost.cross_step_wait(6.0, chunks, 1.0) == pytest.approx(5.0)  # more than the chunks: joined by the next hand-over
    t = cost.predict_pipelined_step(3e12, fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0,
                                    host_ready=[(1.0, 4 * 10**9)], rates=cost.Rates(matmul_flops_per_s=1e12,
                                                                                 host_update_s_per_param=1e-9),
                                    cross_step=True, host_reads=[(f, 10**9) for f in (0.0, 0.25, 0.5, 0.75)])
    assert (t.forward_s, t.backward_s, t.host_update_s) == pytest.approx((1.0, 3.0, 4.0))
    assert t.cross_step and t.host_update_exposed_s == pytest.approx(4.0 - 0.75)
    assert t.step_s == pytest.approx(4.0 + 3.25)
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    rates = cost.Rates(matmul_flops_per_s=1e9, host_update_s_per_param=2e-7)  # the host the bottleneck
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0], rates=rates)
    plain = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops, rates=rates)
    cross = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops, rates=rates,
                          cross_step=True)
    assert cross.predicted.time.cross_step and not plain.predicted.time.cross_step
    assert cross.predicted.time.step_s <= plain.predicted.time.step_s
    assert cross.predicted.time.step_s >= cross.predicted.time.host_update_s


def test_zero_mesh_matches_the_joined_step(setup):
    """ZeRO stage 3 on a 2-rank mesh, host chunks updated per rank slice, the forward cut into
    programs: 6 steps without waiting are bit for bit the joined step's and equal optax. (The
    module's micro GPT and batches, ``B`` rows a step, one per rank: the optax reference's
    gradient program is the one the other tests compiled.)"""
    from chunkjax.topology import build_zero_layout, data_mesh
    n, rows = 2, B
    cfg, params, all_batches, stages = setup[:4]
    batches = [b[:rows] for b in all_batches[:6]]
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    layout = build_zero_layout(params, n, cfg.vocab_size * cfg.d_model, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((rows // n, T + 1), jnp.int32), jnp.float32)
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1e6)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1.0, resident=[0])
    segs = tuple(range(len(stages))) + (len(stages) + 1,)
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1.0, resident=[0], segments=segs)
    assert "host" in sched.update_locations and len(roomy.moments) > segs[-1]
    on = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                              mesh=data_mesh(jax.devices()[:n]), zero_stage=3)
    off = dataclasses.replace(on, cross_step=False)
    off.__dict__["_cache"] = on._cache
    s_on, l_on, _, _ = _run(on, params, batches, rows=rows)
    s_off, l_off, _, _ = _run(off, params, batches, rows=rows)
    np.testing.assert_array_equal(l_on, l_off)
    for a, b in zip(jax.tree.leaves(on.master_params(s_on)), jax.tree.leaves(off.master_params(s_off))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref_p, ref_l, _ = micro_batch_reference(cfg, params, batches, spec.optax(), 1)
    np.testing.assert_allclose(l_on, ref_l, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(on.master_params(s_on)), jax.tree.leaves(ref_p)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-4  # tests/test_zero_schedule.py's bound


def test_fit_path_plans_and_runs_cross_step_by_default(setup, speculate_always):
    """The fit path (``fit.prepare``: the front door, ``fit_step``, the train job) plans and
    builds the cross-step step unless ``cross_step=False`` (the train job's ``--no-cross-step``):
    the default's plan is timed with the overlap and no slower than the joined one; both train
    to optax's numbers, run without waiting between steps."""
    from chunkjax import fit
    from experiments import train
    cfg, params, batches, stages = setup[:4]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
    rates = cost.Rates(matmul_flops_per_s=1e9, host_update_s_per_param=2e-7)  # the host the bottleneck
    # clip_expect="rare": host updates overlapping the backward, the cross-step case under test (clipping
    # expected to fire streams this host-bound step's updates instead: tests/test_clip_plan.py)
    kw = dict(host_optimizer=spec, compute_dtype=jnp.float32, min_chunks=6, rates=rates, host_budget=None,
              check_host=False, flops_per_step=cfg.flops_per_token(T) * B * T, clip_expect="rare")
    batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    on, off = fit.prepare(stages, params, batch, **kw), fit.prepare(stages, params, batch, cross_step=False, **kw)
    assert on.cross_step and not off.cross_step
    budget = fit.auto_budget(on)
    s_on, s_off = fit.plan(on, budget), fit.plan(off, budget)
    assert "host" in s_on.update_locations and "host" in s_off.update_locations
    assert s_on.predicted.time.cross_step and not s_off.predicted.time.cross_step
    assert s_on.predicted.time.step_s <= s_off.predicted.time.step_s
    ref = micro_batch_reference(cfg, params, batches[:4], spec.optax(), 1, rows=B)
    for problem, s in ((on, s_on), (off, s_off)):
        step = fit.build_step(problem, s)
        assert step.cross_step == problem.cross_step
        state, losses, _, _ = _run(step, params, batches[:4])
        _assert_optax(step, state, losses, ref)
    assert train.parse_args([]).cross_step and not train.parse_args(["--no-cross-step"]).cross_step


def test_phase_clock_shows_the_previous_steps_host_tail(setup, monkeypatch):
    """experiments/gpu_checks/dropin.py's front phases (PhaseClock rows, ``front_phases``): with the
    host update of the chunk updated last slowed (a 0.3 s sleep), steps 2 and 3 wait for the previous
    step's host work before their backward (``wait_host_chunks_s`` + ``wait_host_s``), step 1 (whose
    previous step was joined: a first step's long compile) does not: the "second step fast, the
    later ones slow" signature of a host tail longer than the step. Nothing compiled after the
    first step, no kept executable refused, the sleep counted in the host kernel seconds."""
    from chunkjax import host_update
    from experiments.gpu_checks.dropin import front_phases
    from experiments.gpu_checks.front_door_3b import PhaseClock
    cfg, params, batches = setup[:3]
    on, _ = _pair(setup, AdamW(3e-3, weight_decay=0.1))
    slow = {"n": 0}
    real = host_update.host_update_

    def host_update_(*a, **k):  # the last host chunk of each step's work: the tail
        slow["n"] += 1
        if slow["n"] % len(on.host_chunks) == 0:
            time.sleep(0.3)
        return real(*a, **k)
    monkeypatch.setattr(host_update, "host_update_", host_update_)
    holder = {"state": on.init(params)}

    def run(b):
        holder["state"], m = on(holder["state"], b)
        return m["loss"]
    times, works = [], []
    with PhaseClock() as clock:
        for i in range(4):
            t0 = time.perf_counter()
            float(clock.step(run, batches[i][:B]))
            times.append(time.perf_counter() - t0)
            works.append(holder["state"].pending)
            if i == 0:
                on.wait(holder["state"])  # as a first step's compile leaves it: its host work done
        clock.finish(lambda: on.wait(holder["state"]))
    rows = front_phases(clock.summary(), times, [w.seconds for w in works])
    prev_wait = [r["wait_host_chunks_s"] + r["wait_host_s"] for r in rows]
    assert prev_wait[1] < 0.05 and min(prev_wait[2:]) > 0.15, prev_wait
    assert [r["compiles"] for r in rows[1:]] == [0, 0, 0] and all(r["kept_refused"] == [] for r in rows)
    assert all(r["host_kernel_s"] >= 0.3 for r in rows[:3]) and all(r["step_s"] >= r["call_s"] for r in rows)
    assert all(r["loss_wait_s"] >= 0 and r["backward_done_s"] >= r["forward_s"] for r in rows)
