"""Planning for the clipping a step expects (:mod:`chunkjax.clip_plan`, issue 23): when global-norm
clipping fires the host updates start at the backward's end (``norm_wait``), the cost model times
that step, and the planner moves host chunks to the streamed pipeline to shorten it. The plan
changes where chunks update, never the numbers: the clipped step of a ``"fires"`` plan equals optax
(fp32 tolerances of tests/test_overlap.py) on steps where clipping fires and where it does not.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkjax import clip_plan, cost, fit
from chunkjax.host_update import AdamW
from chunkjax.errors import format_step_seconds
from chunkjax.program_cut import retime
from chunkjax.tide import memory_tide

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 8
#: A step whose host is slower than its PCIe (micro GPT: 9 chunks of 16,512 elements): planned for
#: "rare" every offloaded chunk updates on the host (overlapping the backward), for "fires" most stream.
RATES = cost.Rates(matmul_flops_per_s=1e9, host_update_s_per_param=5e-8, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
                   duplex_bytes_per_s=2e9, one_program_duplex_bytes_per_s=1e9)


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 11, 5, B, T, STEPS)


def _problem(setup, spec, **kw):
    cfg, params, batches, stages = setup[:4]
    return fit.prepare(stages, params, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), host_optimizer=spec,
                       compute_dtype=jnp.float32, min_chunks=6, rates=RATES, host_budget=None, check_host=False,
                       flops_per_step=cfg.flops_per_token(T) * B * T, **kw)


def _both(problem, s) -> dict:
    return clip_plan.both_ways(s, problem.cb_rank, chunk_size=problem.layout.chunk_size, traces=problem.traces,
                               tide=memory_tide(problem.traces, problem.layout.chunk_size), rates=problem.rates,
                               flops_per_step=problem.flops_per_step, cross_step=problem.cross_step)


def test_norm_wait_times_the_host_update_from_the_backwards_end():
    """Hand-computed timeline: 1 s forward, 3 s backward, 4 s of host work completed half at 1/3
    of the backward and half at its end. Speculating, the host runs from 2 s on and leaves 1 s after
    the backward; waiting for the norm, all 4 s run from the backward's end, beside the streamed
    pipeline, and the next forward (read fractions 0, 1/4, 1/2, 3/4 of its 1 s) waits 3.25 s."""
    rates = cost.Rates(matmul_flops_per_s=1e12, host_update_s_per_param=1e-9)
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, rates=rates, window=0,
              host_ready=[(1 / 3, 2 * 10**9), (1.0, 2 * 10**9)])
    spec = cost.predict_pipelined_step(3e12, **kw)
    wait = cost.predict_pipelined_step(3e12, norm_wait=True, **kw)
    assert (spec.forward_s, spec.backward_s, spec.host_update_s) == pytest.approx((1.0, 3.0, 4.0))
    assert spec.host_update_exposed_s == pytest.approx(2.0) and not spec.norm_wait  # host 2..4 s, then 4..6 s
    assert wait.norm_wait and wait.host_update_exposed_s == pytest.approx(4.0)
    assert wait.step_s == pytest.approx(8.0) and spec.step_s == pytest.approx(6.0)
    reads = [(f, 10**9) for f in (0.0, 0.25, 0.5, 0.75)]
    cross = cost.predict_pipelined_step(3e12, norm_wait=True, cross_step=True, host_reads=reads, **kw)
    assert cross.host_update_exposed_s == pytest.approx(3.25) and cross.step_s == pytest.approx(7.25)
    # streamed chunks completed early still start at the backward's end: beside the host's tail
    st = dict(kw, streamed=[(1 / 3, 10**9, 10**9)], params_per_chunk=10**6)
    a = cost.predict_pipelined_step(3e12, norm_wait=True, **st)
    assert a.streamed_update_s == pytest.approx(2 * 10**9 / min(rates.h2d_bytes_per_s, rates.duplex_bytes_per_s / 2)
                                                + 10**6 * rates.device_update_s_per_param, rel=1e-3)
    assert a.step_s == pytest.approx(4.0 + max(4.0, a.streamed_update_s))


def test_the_speculation_bound_times_the_rest_from_the_backwards_end():
    """Hand-computed timelines of the setting above (1 s forward, 3 s backward, 2e9 host params at
    1/3 of the backward and 2e9 at its end, 1 ns each) with the speculation bounded (SuperOffload's
    speculation-then-validation, chunkjax.speculate: once the bound is full the host thread waits
    for the norm): bound 0 times the host like the norm-waiting step (4 s from 4 s: 8 s); a bound
    of every host param like no bound (6 s); 1e9 params: 1 s at 2..3 s, then 3 s from 4 s (7 s);
    with 12 backup bytes a param at 12 GB/s (2 ns a param more) the speculated part takes
    2..5 s and the rest 5..8 s (8 s, 6 s of host work)."""
    rates = cost.Rates(matmul_flops_per_s=1e12, host_update_s_per_param=1e-9, host_memory_bytes_per_s=12e9)
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, rates=rates, window=0,
              host_ready=[(1 / 3, 2 * 10**9), (1.0, 2 * 10**9)])
    free, wait = cost.predict_pipelined_step(3e12, **kw), cost.predict_pipelined_step(3e12, norm_wait=True, **kw)
    zero = cost.predict_pipelined_step(3e12, speculation_params=0, **kw)
    assert not zero.norm_wait and (zero.host_update_s, zero.host_update_exposed_s, zero.step_s) == pytest.approx(
        (wait.host_update_s, wait.host_update_exposed_s, wait.step_s))
    assert (wait.host_update_exposed_s, wait.step_s) == pytest.approx((4.0, 8.0))
    for bound in (4 * 10**9, 5 * 10**9):
        t = cost.predict_pipelined_step(3e12, speculation_params=bound, **kw)
        assert (t.host_update_s, t.host_update_exposed_s, t.step_s) == pytest.approx((4.0, 2.0, 6.0))
        assert t.to_dict() == free.to_dict()
    part = cost.predict_pipelined_step(3e12, speculation_params=10**9, **kw)
    assert (part.host_update_s, part.host_update_exposed_s, part.step_s) == pytest.approx((4.0, 3.0, 7.0))
    copied = cost.predict_pipelined_step(3e12, speculation_params=10**9, backup_bytes_per_param=12.0, **kw)
    assert (copied.host_update_s, copied.host_update_exposed_s, copied.step_s) == pytest.approx((6.0, 4.0, 8.0))
    # the bound does not apply when the step waits for the norm (it does not speculate)
    w = cost.predict_pipelined_step(3e12, norm_wait=True, speculation_params=10**9, backup_bytes_per_param=12.0, **kw)
    assert w.to_dict() == wait.to_dict()
    assert cost.speculated_ready([(1.0, 5), (0.5, 3)], 4) == [(0.5, 3, True), (1.0, 1, True), (1.0, 4, False)]
    with pytest.raises(ValueError, match="speculation_params"):
        cost.speculated_ready([(0.5, 3)], -1)


def test_speculation_bound_of_a_step():
    """The bound in whole chunks of parameters (chunkjax.clip_plan.speculation_bound): backups hold
    12 bytes an AdamW parameter (the host state's master and two moments: the pool's share), 8 for
    Lion; inversion holds the compute-dtype gradient and copies nothing; no clipping and no skip:
    no speculation (unbounded)."""
    import types

    from chunkjax.host_update import Lion
    from chunkjax.predict import ChunkBytes
    rng = np.random.default_rng()
    n = int(rng.integers(1000, 10**6))
    cb = ChunkBytes(params=2 * n, grad=2 * n, master=4 * n, opt=8 * n + 12)
    k = int(rng.integers(0, 200))
    extra = int(rng.integers(0, 12 * n))

    def step(spec, bound, rollback="backup", skips=False):
        return types.SimpleNamespace(host_optimizer=spec, speculation_bytes=bound, rollback=rollback,
                                     skips_nonfinite=skips)
    clipped = AdamW(1e-3, max_grad_norm=1.0)
    assert clip_plan.speculation_bound(step(clipped, k * 12 * n + extra), cb, n) == (k * n, 12.0)
    assert clip_plan.speculation_bound(step(Lion(1e-4, max_grad_norm=1.0), k * 8 * n), cb, n) == (k * n, 8.0)
    assert clip_plan.speculation_bound(step(AdamW(1e-3), 10**12, skips=True), cb, n) == (10**12 // (12 * n) * n, 12.0)
    assert clip_plan.speculation_bound(step(clipped, k * 2 * n + 1, "invert"), cb, n) == (k * n, 0.0)
    assert clip_plan.speculation_bound(step(AdamW(1e-3), 0), cb, n) == (None, 0.0)
    assert clip_plan.speculation_bound(step(None, 0, skips=True), cb, n) == (None, 0.0)


def test_the_plan_streams_more_when_clipping_fires_and_predicts_sanely(setup):
    """The planner (``clip_expect``, default from the host kernel's clipping) moves host chunks to
    the streamed pipeline when clipping is expected to fire (the pre-clip_plan planner had no such
    option and planned every clipped step as if the speculation held); each plan is the faster in
    the case it was made for; the fires step shortens as chunks move from the host to the pipeline
    up to the plan's count and is never shorter than the host's or the pipeline's work after the
    backward."""
    clipped = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
    auto, rare = _problem(setup, clipped), _problem(setup, clipped, clip_expect="rare")
    assert auto.clip_expect == "fires" and _problem(setup, AdamW(3e-3)).clip_expect == "rare"
    with pytest.raises(ValueError, match="clip_expect"):
        _problem(setup, clipped, clip_expect="often")
    budget = fit.auto_budget(auto)
    s_f, s_r = fit.plan(auto, budget), fit.plan(rare, budget)
    n_streamed = [sum(u == "streamed" for u in s.update_locations) for s in (s_f, s_r)]
    assert n_streamed[0] > n_streamed[1] and "host" in s_f.update_locations
    assert s_f.predicted.time.norm_wait and not s_r.predicted.time.norm_wait
    f, r = _both(auto, s_f), _both(rare, s_r)
    assert f["fires"] == pytest.approx(s_f.predicted.time.step_s) and r["rare"] == pytest.approx(s_r.predicted.time.step_s)
    assert f["fires"] < r["fires"] and r["rare"] <= f["rare"]
    # the fires timeline of s_f's placement with its streamed chunks moved back to the host one by one
    streamed = [c for c, u in enumerate(s_f.update_locations) if u == "streamed"]
    steps, hosts, pipes = [], [], []
    for j in range(len(streamed) + 1):
        loc = tuple("host" if c in streamed[j:] else u for c, u in enumerate(s_f.update_locations))
        t = retime(dataclasses.replace(s_f, update_locations=loc), auto.cb_rank,
                   chunk_size=auto.layout.chunk_size, traces=auto.traces,
                   tide=memory_tide(auto.traces, auto.layout.chunk_size), rates=RATES,
                   flops_per_step=auto.flops_per_step, cross_step=True, norm_wait=True).time
        steps.append(t.step_s)
        hosts.append(t.host_update_s)
        pipes.append(t.streamed_update_s)
        assert t.step_s >= t.forward_s + t.backward_s + max(t.streamed_update_s + t.device_update_s,
                                                            t.host_update_exposed_s) - 1e-12
        assert t.step_s >= t.host_update_s
    assert steps[-1] == pytest.approx(s_f.predicted.time.step_s) and steps[-1] < steps[0]
    assert all(a > b for a, b in zip(hosts, hosts[1:])) and all(a < b for a, b in zip(pipes, pipes[1:]))
    slower = fit.plan(dataclasses.replace(auto, rates=dataclasses.replace(
        RATES, host_update_s_per_param=2 * RATES.host_update_s_per_param)), budget)
    assert slower.predicted.time.step_s >= s_f.predicted.time.step_s  # a slower host never predicts a faster step


def _equals_optax(step, params, batches, ref_p, ref_l):
    """Train ``step`` over ``batches`` and compare with optax's losses and params (fp32 tolerances)."""
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b[:B])
        losses.append(float(m["loss"]))
    step.wait(state)
    np.testing.assert_allclose(np.asarray(losses), ref_l, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


@pytest.fixture(scope="module")
def free_norms(setup):
    """The global gradient norms of plain optax without clipping over the batches (steps,): the
    source of both cases' thresholds, computed once."""
    cfg, params, batches = setup[:3]
    return micro_batch_reference(cfg, params, batches, AdamW(3e-3, weight_decay=0.1).optax(), 1, rows=B)[2]


@pytest.mark.parametrize("fires", ["some", "every"])
def test_clipped_step_of_the_fires_plan_equals_optax(setup, free_norms, fires):
    """The ``"fires"`` plan's step (device, streamed and host chunks; cross-step), 8 steps with
    clipping firing on some of them or on all: equal to optax at fp32 tolerance."""
    cfg, params, batches = setup[:3]
    free = free_norms
    clip = {"some": float(np.median(free)), "every": float(np.min(free)) / 4}[fires]
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref_p, ref_l, norms = micro_batch_reference(cfg, params, batches, spec.optax(), 1, rows=B)
    fired = norms >= clip
    assert (0 < fired.sum() < STEPS) if fires == "some" else fired.all()
    problem = _problem(setup, spec)
    s = fit.plan(problem, fit.auto_budget(problem))
    assert {"device", "streamed", "host"} <= set(s.update_locations) and s.predicted.time.norm_wait
    step = fit.build_step(problem, s)
    _equals_optax(step, params, batches, ref_p, ref_l)


def test_the_split_counts_a_host_bound_cross_step_steps_floor():
    """The update split's crossing (:func:`chunkjax.plan_split._host_side`): with cross-step overlap
    a step is never shorter than the host thread's work, so the host's share of the tail is also
    the host work beyond forward + backward + stalls, even when the next forward hides its tail
    (no exposed seconds); a joined step's share is its exposed tail."""
    from chunkjax.plan_split import _host_side
    t = cost.PipelinedStepTime(1.0, 3.0, 5.0, 0.0, 0.0, 0.0, 4.0, 0.0, window_stall_s=0.5, cross_step=True)
    assert t.step_s == pytest.approx(5.0) and _host_side(t) == pytest.approx(0.5)
    assert _host_side(dataclasses.replace(t, host_update_exposed_s=0.75)) == pytest.approx(0.75)
    assert _host_side(dataclasses.replace(t, cross_step=False, host_update_exposed_s=0.25)) == 0.25


def test_fit_path_step_rolls_back_by_inversion_when_asked(setup, free_norms):
    """``FitProblem.rollback="invert"`` reaches the step the fit path builds (the bench's
    ``--set rollback=invert``): a ``"rare"`` plan whose host chunks speculate, clipping firing on
    some of 8 steps, equals optax at the fp32 tolerances above."""
    cfg, params, batches = setup[:3]
    clip = float(np.median(free_norms))
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref_p, ref_l, norms = micro_batch_reference(cfg, params, batches, spec.optax(), 1, rows=B)
    assert 0 < (norms >= clip).sum() < STEPS
    problem = dataclasses.replace(_problem(setup, spec, clip_expect="rare"), rollback="invert")
    s = fit.plan(problem, fit.auto_budget(problem))
    assert "host" in s.update_locations and not s.predicted.time.norm_wait
    step = fit.build_step(problem, s)
    assert step.rollback == "invert"
    _equals_optax(step, params, batches, ref_p, ref_l)


def test_the_bench_reports_the_bounded_prediction_of_a_speculating_step():
    """experiments/bench_chunkjax.py's reported prediction (``step_s_predicted``, ``predicted_time``,
    ``step_s_predicted_if["rare"]``) of a ``"rare"`` plan with clipping (the micro GPT, host chunks):
    the plan retimed with the built step's bound in whole chunks (the planner's own figure stays
    ``step_s_planned``): no room: every host chunk from the backward's end, as when the norm is
    waited for; the plan's own figure without clipping or for a ``"fires"`` plan."""
    from experiments import bench_chunkjax as bc
    from models import gpt
    sys_ = bc.ChunkjaxSystem(gpt.get_config("micro", n_layers=2), 2_500_000, 2, 32, max_grad_norm=1.0,
                             clip_expect="rare")
    s, cs = sys_.schedule, sys_.layout.chunk_size
    n_host = sum(u == "host" for u in s.update_locations)
    assert n_host >= 2 and not s.predicted.time.norm_wait
    kw = bc._retime_kw(sys_)
    for k in (0, 1, n_host - 1, n_host, n_host + 3):
        sys_.step_fn = dataclasses.replace(sys_.step_fn, speculation_bytes=k * 12 * cs + 12 * cs - 1)
        rec, t = bc._bound_record(sys_), bc.reported_time(sys_)
        assert (rec["chunks"], rec["params"], rec["backup_bytes_per_param"]) == (k, k * cs, 12.0)
        assert t.to_dict() == retime(s, sys_.problem.cb_rank, speculation_params=k * cs, backup_bytes_per_param=12.0,
                                     **kw).time.to_dict()
        assert bc._both_ways(sys_)["rare"] == t.step_s and not t.norm_wait
        if k == 0:
            wait = retime(s, sys_.problem.cb_rank, norm_wait=True, **kw).time
            assert (t.host_update_s, t.host_update_exposed_s) == pytest.approx((wait.host_update_s,
                                                                                wait.host_update_exposed_s))
        if k >= n_host:
            assert t.host_update_s == pytest.approx(s.predicted.time.host_update_s + n_host * cs * 24
                                                    / sys_.rates.host_memory_bytes_per_s)
    sys_.step_fn = dataclasses.replace(sys_.step_fn, host_optimizer=AdamW(1e-4))  # no clipping: no speculation
    assert bc._bound_record(sys_)["params"] is None and bc.reported_time(sys_) is s.predicted.time
    sys_.step_fn = dataclasses.replace(sys_.step_fn, host_optimizer=sys_.spec)
    sys_.problem = dataclasses.replace(sys_.problem, clip_expect="fires")
    assert bc.reported_time(sys_) is s.predicted.time


def _retimed(problem, s, **kw):
    """``s`` retimed on ``problem``'s traces and rates (one device, no remat, no micro-batches)."""
    cs = problem.layout.chunk_size
    return retime(s, problem.cb_rank, chunk_size=cs, traces=problem.traces, tide=memory_tide(problem.traces, cs),
                  rates=problem.rates, flops_per_step=problem.flops_per_step, cross_step=problem.cross_step,
                  **kw).time


@pytest.mark.parametrize("chunks", [None, 0, 1])
def test_the_fit_path_reports_the_bounded_prediction_of_a_speculating_step(setup, monkeypatch, chunks):
    """The fit path's report (``FitReport.to_dict()["step_s_predicted"]``, ``describe``) of a
    ``"rare"`` plan with clipping (the micro GPT, host chunks): the plan retimed with the built
    step's speculation bound (:func:`chunkjax.clip_plan.speculation_bound`), never below the
    planner's own figure (``step_s_planned``); the bound is the fit path's own (None) or one of
    ``chunks`` backups. Bound 0 times the host as the norm-waiting step: slower than planned."""
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
    problem = _problem(setup, spec, clip_expect="rare")
    cs = problem.layout.chunk_size
    if chunks is not None:  # the fit path's bound replaced by `chunks` backups (12 bytes an AdamW parameter)
        monkeypatch.setattr(fit, "speculation_bytes", lambda *a: chunks * 12 * cs + 12 * cs - 1)
    f = fit.fit_problem(problem, fit.auto_budget(problem), check_compiled=False)
    assert f.step.speculation_bytes == f.report.host["speculation_bytes"] is not None
    r, s = f.report, f.report.schedule
    n_host = sum(u == "host" for u in s.update_locations)
    assert n_host >= 2 and not s.predicted.time.norm_wait and f.step.host_optimizer.max_grad_norm == 1.0
    n, bpp = clip_plan.speculation_bound(f.step, problem.cb_rank, cs)
    assert n is not None and bpp == 12.0 and (chunks is None or n == chunks * cs)
    want = _retimed(f.problem, s, speculation_params=n, backup_bytes_per_param=bpp)
    d = r.to_dict()
    assert r.step_time.to_dict() == want.to_dict() and d["step_s_predicted"] == want.step_s
    assert d["step_s_planned"] == s.predicted.time.step_s
    assert d["step_s_predicted"] >= d["step_s_planned"] * (1 - 1e-12)
    assert (d["speculation_bound"]["chunks"], d["speculation_bound"]["params"]) == (n // cs, n)
    if chunks == 0:
        wait = _retimed(f.problem, s, norm_wait=True)
        assert (want.host_update_s, want.host_update_exposed_s) == pytest.approx((wait.host_update_s,
                                                                                  wait.host_update_exposed_s))
        assert d["step_s_predicted"] > d["step_s_planned"]
    line = fit.describe(r, f.problem)
    assert f"predicted step {format_step_seconds(want.step_s)} with the step's speculation bound (up to {n // cs} " in line
    assert f"the planner's {format_step_seconds(s.predicted.time.step_s)} lets every host chunk speculate" in line


@pytest.mark.parametrize("clip", ["none", "fires"])
def test_the_fit_path_reports_the_planners_figure_where_nothing_speculates_early(setup, clip):
    """Without clipping (nothing to speculate) or for a ``"fires"`` plan (it waits for the norm) the
    fit path's report gives the planner's figure unchanged, and ``describe`` names no bound."""
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=None if clip == "none" else 1.0)
    problem = _problem(setup, spec)
    assert problem.clip_expect == {"none": "rare", "fires": "fires"}[clip]
    f = fit.fit_problem(problem, fit.auto_budget(problem), check_compiled=False)
    r, s = f.report, f.report.schedule
    assert "host" in s.update_locations
    assert r.predicted_time is s.predicted.time
    d = r.to_dict()
    assert d["step_s_predicted"] == d["step_s_planned"] == s.predicted.time.step_s
    assert (d["speculation_bound"]["params"] is None) == (clip == "none")
    line = fit.describe(r, f.problem)
    assert f"predicted step {format_step_seconds(s.predicted.time.step_s)}" in line and "speculation bound" not in line
