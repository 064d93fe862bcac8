"""Micro-batched plans with cross-step overlap (issue 23): the program-cut search and forward cuts
for plans of several passes (per micro-batch, micro-batch groups), the cost model's passes and
looped fetches, and the walker's unrolled micro-batch loops (bit for bit the while loops').

Every run is on the micro GPT of tests/_micro_setup.py in float32, against plain optax on the
mean gradient over 4 micro-batches (tests/_optax_reference.py) and bit for bit against the same
step joining the previous step's host work at its start (``cross_step=False``)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import cost, speculate
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.program_cut import auto_segments, retime
from chunkjax.schedule import IN_PROGRAM, PER_MICRO_BATCH
from chunkjax.tide import memory_tide
from chunkjax.trace import in_program_traces

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T, M, STEPS = 2, 16, 4, 6
#: the host kernel the bottleneck (as on the H200 for GPT3_6B): forward cuts pay
RATES = cost.Rates(matmul_flops_per_s=1e10, host_update_s_per_param=2e-7)


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 23, 7, B, T, STEPS)


@pytest.fixture
def speculate_always(monkeypatch):
    """Every host chunk's update starts before the norm is known (the GPU's case)."""
    monkeypatch.setattr(speculate.Speculation, "_known", lambda self: self.certain)


def _cb(setup, spec):
    layout = setup[4]
    return cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))


def _plan(setup, spec, group, unrolled=False, cross_step=True):
    """The tide plan (every offloaded chunk host-updated) of ``M`` micro-batches run ``M / group``
    passes a step, each looping over ``group`` of them inside its moments (1: per micro-batch),
    at chunk 0's resident budget; with the schedule's accumulation set as the fit path sets it."""
    cfg, params, batches, stages, layout, traces = setup
    cb, flops = _cb(setup, spec), cfg.flops_per_token(T) * B * T * M
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0], rates=RATES)
    tr = traces if group == 1 else in_program_traces(traces, group, unrolled=unrolled)
    s = plan_schedule(layout, tr, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops, rates=RATES,
                      micro_batches=M // group, cross_step=cross_step, split=False)
    if group > 1:
        s = dataclasses.replace(s, accumulation=IN_PROGRAM, micro_group=None if group == M else group,
                                unroll_micro_batches=unrolled)
    return s, tr


def _forward_programs(s, n_stages):
    """Programs that start in the forward (moments ``0 .. n_stages - 2``)."""
    return sum(1 for t in s.segments if t < n_stages - 1)


@pytest.mark.parametrize("group", [1, 2])
def test_several_passes_get_forward_cuts(setup, group):
    """Per micro-batch (4 passes) and over groups of 2 (2 passes): with cross-step overlap the
    planner searches the program cut and cuts the forward (before: one forward program, the
    doubling cut), timed with the overlap and no slower than the doubling cut's prediction."""
    spec = AdamW(3e-3, weight_decay=0.1)
    stages = setup[3]
    s, tr = _plan(setup, spec, group)
    assert set(s.update_locations) == {"host"}
    assert _forward_programs(s, len(stages)) > 1, s.segments
    assert s.predicted.time.cross_step
    n, tide = len(stages), memory_tide(tr, setup[4].chunk_size)
    kw = dict(chunk_size=setup[4].chunk_size, traces=tr, tide=tide, rates=RATES,
              flops_per_step=setup[0].flops_per_token(T) * B * T * M, micro_batches=M // group, cross_step=True)
    doubling = retime(s, _cb(setup, spec), segments=auto_segments(len(tide.moments), n), **kw)
    assert s.predicted.time.step_s < doubling.time.step_s
    assert retime(s, _cb(setup, spec), **kw).time.step_s == pytest.approx(s.predicted.time.step_s)


def test_passes_and_looped_fetch_in_the_cost_model():
    """Host hand-offs come in the last pass's backward; with cross-step overlap only the next
    step's first pass's forward overlaps the tail; a while loop's backward fetches are timed
    after its compute, an unrolled loop's under it."""
    r = cost.Rates(matmul_flops_per_s=1e12, host_update_s_per_param=1e-9, h2d_bytes_per_s=1e12,
                   one_program_duplex_bytes_per_s=1e12)
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, host_ready=[(0.5, 2 * 10**9)], rates=r)
    one = cost.predict_pipelined_step(3e12, **kw)  # forward 1 s, backward 3 s, the hand-off at 2.5 s
    four = cost.predict_pipelined_step(3e12, passes=4, **kw)  # at 1 + 3 - 0.75 + 0.375 s
    assert (one.forward_s, one.backward_s) == pytest.approx((1.0, 3.0))
    assert one.host_update_exposed_s == pytest.approx(0.5)
    assert four.host_update_exposed_s == pytest.approx(1.625)
    reads = [(1.0, 2 * 10**9)]  # read at the next forward's end
    assert cost.predict_pipelined_step(3e12, cross_step=True, host_reads=reads, **kw).host_update_exposed_s == 0.0
    four_x = cost.predict_pipelined_step(3e12, passes=4, cross_step=True, host_reads=reads, **kw)
    assert four_x.host_update_exposed_s == pytest.approx(1.625 - 0.25)  # the first pass's forward: 1/4 s
    kw["bwd_h2d"] = 10**12  # 1 s of fetches in the backward
    assert cost.predict_pipelined_step(3e12, **kw).backward_s == pytest.approx(3.0)
    assert cost.predict_pipelined_step(3e12, looped_fetch=True, **kw).backward_s == pytest.approx(4.0)


def test_the_planner_times_looped_and_unrolled_loops(setup):
    """An in-program plan's loops as while loops are predicted slower than unrolled (the fetches
    after the loop), each schedule recording which it runs; the fit path's option reaches it."""
    from chunkjax import fit
    spec = AdamW(3e-3, weight_decay=0.1)
    looped, _ = _plan(setup, spec, M)
    unrolled, _ = _plan(setup, spec, M, unrolled=True)
    assert not looped.unroll_micro_batches and unrolled.unroll_micro_batches
    assert looped.predicted.h2d_bytes_per_step > 0
    assert looped.predicted.time.backward_s > unrolled.predicted.time.backward_s
    assert cj.Schedule.from_dict(unrolled.to_dict()).unroll_micro_batches
    cfg, params, batches, stages = setup[:4]
    kw = dict(host_optimizer=spec, compute_dtype=jnp.float32, min_chunks=6, rates=RATES, host_budget=None,
              check_host=False, micro_batches=M, flops_per_step=cfg.flops_per_token(T) * B * T * M)
    batch = jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32)
    for unroll in (False, True):
        problem = fit.prepare(stages, params, batch, unroll_micro_batches=unroll, **kw)
        auto = fit.auto_budget(problem)
        assert auto == _per_pass_auto_budget(problem)  # the floor: the per-micro-batch plan's refusal,
        assert not problem.loop_traces  # found without compiling and measuring any micro-batch group's loops
        s = fit.plan(problem, 2 * auto)
        assert s.accumulation == IN_PROGRAM and s.unroll_micro_batches == unroll
        assert fit.build_step(problem, s).walk(problem.batch).unroll == unroll


def _per_pass_auto_budget(problem) -> int:
    """``fit.auto_budget(problem)`` from the per-micro-batch plan's refusal at 1 byte (below every
    in-program group's floor: tests/test_micro_groups.py), as ``fit.plan(problem, 1)`` finds it
    (:func:`chunkjax.plan_micro.plan_micro_batches`: per pass first at a budget of 1 byte; before,
    it compiled and measured the loops of every micro-batch group first)."""
    from chunkjax import fit
    with pytest.raises(cj.PlanError) as e:
        fit._plan_passes(problem, 1, policy="tide", resident=None, must_fit=True, split=True)
    return int(e.value.min_budget_bytes
               + fit.AUTO_BUDGET_MODEL_FRACTION * problem.cb_rank.model_bytes(problem.layout.n_chunks))


def _run(step, params, batches):
    """Train without waiting between steps: (final state, losses)."""
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    step.wait(state)
    return state, np.asarray([float(x) for x in losses])


def _leaves(opt_state) -> list:
    if dataclasses.is_dataclass(opt_state):
        return [getattr(opt_state, f.name) for f in dataclasses.fields(opt_state)]
    return jax.tree.leaves(opt_state)


def _assert_same(n_chunks, a, b):
    """Bit for bit: losses and every chunk's params, master params and optimizer state."""
    (sa, la), (sb, lb) = a, b
    np.testing.assert_array_equal(la, lb)
    for c in range(n_chunks):
        np.testing.assert_array_equal(np.asarray(sa.master[c]), np.asarray(sb.master[c]))
        np.testing.assert_array_equal(np.asarray(sa.params[c]), np.asarray(sb.params[c]))
        for x, y in zip(_leaves(sa.opt_state[c]), _leaves(sb.opt_state[c])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def clipped(setup):
    """(AdamW whose clipping fires on some steps: the median of the unclipped reference's norms,
    optax's (params, losses, norms) with it), on the mean gradient over ``M`` micro-batches."""
    cfg, params, batches = setup[:3]
    free = micro_batch_reference(cfg, params, batches, AdamW(3e-3, weight_decay=0.1).optax(), M)[2]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=float(np.median(free)))
    return spec, micro_batch_reference(cfg, params, batches, spec.optax(), M)


@pytest.mark.parametrize("group, unrolled", [(1, False), (2, False), (M, True)])
def test_micro_batches_with_forward_cuts_equal_optax(setup, clipped, speculate_always, monkeypatch, group, unrolled):
    """4 micro-batches per micro-batch, over groups of 2, and in-program with the loops unrolled,
    each planned with forward cuts and run with cross-step overlap and clipping that fires on
    some steps: equal to optax on the mean gradient over 6 steps, bit for bit the joined step.

    In-program, the step with its micro-batch loops traced unrolled (``Schedule.
    unroll_micro_batches``) also trains bit for bit as the same schedule with ``lax.scan`` /
    ``lax.map`` while loops (losses, params, master params, optimizer state over the 6 steps),
    and each traced what it says (the loops' ``unroll`` seen by ``jax.lax.scan``)."""
    cfg, params, batches, stages, layout, traces = setup
    spec, (ref_p, ref_l, _) = clipped
    s, _ = _plan(setup, spec, group, unrolled)
    assert _forward_programs(s, len(stages)) > 1 and "host" in s.update_locations
    kw = dict(host_optimizer=spec, compute_dtype=jnp.float32, micro_batches=M,
              accumulation=PER_MICRO_BATCH if group == 1 else None)
    on = cj.make_chunked_step(stages, layout, s, **kw)
    assert on.passes == M // group and on.cross_step
    off = dataclasses.replace(on, cross_step=False)
    off.__dict__["_cache"] = on._cache  # the programs do not depend on cross_step
    scan, seen = jax.lax.scan, []
    monkeypatch.setattr(jax.lax, "scan", lambda *a, **kw: seen.append(kw.get("unroll")) or scan(*a, **kw))
    s_on, l_on = _run(on, params, batches)
    np.testing.assert_allclose(l_on, ref_l, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(on.master_params(s_on)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    _assert_same(layout.n_chunks, (s_on, l_on), _run(off, params, batches))
    if not unrolled:
        return
    assert seen and set(seen) == {True}, seen
    seen.clear()
    looped = cj.make_chunked_step(stages, layout, dataclasses.replace(s, unroll_micro_batches=False), **kw)
    assert looped.passes == 1
    _assert_same(layout.n_chunks, (s_on, l_on), _run(looped, params, batches))
    assert seen and set(seen) == {1}, seen


def test_unroll_auto_resolves_by_micro_batch_count_and_bad_values_say_what_to_pass():
    """``unroll_micro_batches="auto"`` (fit.prepare's default) unrolls 2-4 micro-batches and loops more;
    True / False stay as given; anything else is one line naming the choices."""
    from chunkjax.plan_micro import UNROLL_AUTO_MAX_MICRO_BATCHES, resolve_unroll
    assert UNROLL_AUTO_MAX_MICRO_BATCHES == 4
    assert [resolve_unroll("auto", m) for m in (1, 2, 3, 4, 5, 8, 64)] == [False, True, True, True, False, False, False]
    assert resolve_unroll(True, 8) and not resolve_unroll(False, 2) and resolve_unroll(1, 8)
    for bad in ("yes", "AUTO", 2, None, 0.5):
        with pytest.raises(ValueError, match="unroll_micro_batches=.*use True, False or 'auto'"):
            resolve_unroll(bad, 4)


def test_prepare_default_unrolls_four_micro_batches_and_loops_eight(setup):
    from chunkjax import fit
    cfg, params, batches, stages = setup[:4]
    kw = dict(host_optimizer=AdamW(3e-3), compute_dtype=jnp.float32, min_chunks=6, rates=RATES, host_budget=None,
              check_host=False)
    for m, unrolled in ((1, False), (4, True), (8, False)):
        batch = jax.ShapeDtypeStruct((m * B, T + 1), jnp.int32)
        assert fit.prepare(stages, params, batch, micro_batches=m, **kw).unroll_micro_batches is unrolled
    batch = jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32)
    assert fit.prepare(stages, params, batch, micro_batches=M, unroll_micro_batches=False, **kw).unroll_micro_batches is False
    with pytest.raises(ValueError, match="use True, False or 'auto'"):
        fit.prepare(stages, params, batch, micro_batches=M, unroll_micro_batches="sometimes", **kw)
