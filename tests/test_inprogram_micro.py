"""Gradient accumulation inside each moment (``accumulation="in_program"``,
:class:`chunkjax.walker.Walk` ``micro_batches``): each chunk fetched once per step, the float32
micro-batch sums on the device, each gradient leaving once as the mean. Reference: plain optax on
the whole batch with float32 micro-batch sums (tolerances as tests/test_overlap.py), and today's
per-micro-batch path (:func:`chunkjax.accumulate.mean_gradients`); a weighted loss under ZeRO-3
against the token mean (tests/test_masked_loss.py's model and checks); the planner's choice
(:mod:`chunkjax.plan_micro`): in-program where it fits, fetching once a step, else per pass.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from models import gpt

from _optax_reference import micro_batch_reference

B, T, M = 2, 16, 4  # B rows per micro-batch
STEPS = 20
#: The clipping threshold: below the reference's gradient norm on the first steps, above it later.
CLIP = 0.8


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng(11)
    params = _random_params(cfg, rng)
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (M * B, T + 1)), jnp.int32) for _ in range(STEPS)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0][:B])
    layout = cj.build_layout(params, None, order, min_chunks=4)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), jnp.float32)
    return cfg, params, batches, stages, layout, traces


def _random_params(cfg, rng):
    """Params of ``gpt.init_params``' shapes and scale drawn with numpy (its init costs seconds on
    8 forced CPU devices: tests/test_zero.py): normal 0.02, LayerNorm scales 1."""
    def draw(path, a):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(a.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 0.02, a.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, gpt.abstract_params(cfg))


def _reference(cfg, params, batches, tx, micro_batches):
    """Plain optax (fp32): the gradient is the float32 mean of the micro-batches' gradients."""
    return micro_batch_reference(cfg, params, batches, tx, micro_batches)

def _train(step, params, batches):
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    return step.master_params(state), np.asarray(losses)


def _assert_close(params, losses, ref_params, ref_losses):
    """fp32 tolerances of tests/test_overlap.py (Adam's 1/sqrt(v) amplifies summation order)."""
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def _split_schedule(layout, traces, spec, cfg):
    """The smallest budget's plan: every chunk's params in pinned host, host and streamed updates."""
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    with pytest.raises(cj.PlanError) as e:
        plan_schedule(layout, traces, cb, 1000, flops_per_step=flops)
    return plan_schedule(layout, traces, cb, e.value.min_budget_bytes, flops_per_step=flops)


@pytest.fixture(scope="module")
def in_program(setup):
    """``(spec, schedule, step, its first 3 steps' (master params, losses))``: the in-program
    step of the smallest budget's plan (4 micro-batches, clipping), compiled and run once for the
    equality test and the tied-loop test."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=CLIP)
    sched = _split_schedule(layout, traces, spec, cfg)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                                micro_batches=M, accumulation="in_program")
    return spec, sched, step, _train(step, params, batches[:3])


def test_in_program_equals_optax_and_the_per_micro_batch_path(setup, in_program):
    """4 micro-batches looped inside each moment, pinned-host params, host-updated and streamed
    chunks, clipping firing on some steps: equals optax over 20 steps and today's path."""
    cfg, params, batches, stages, layout, traces = setup
    spec, sched, step, (p_new, l_new) = in_program
    assert set(sched.update_locations) == {"host", "streamed"} and set(sched.param_kinds) == {"pinned_host"}
    assert len(sched.segments) > 1  # the carry (whole-batch activations, float32 sums) crosses programs
    ref_p, ref_losses, norms = _reference(cfg, params, batches, spec.optax(), M)
    assert 0 < np.sum(norms > CLIP) < STEPS  # clipping fires on some steps
    assert step.walk(batches[0]).micro_batches == M and step.accumulation == "in_program"
    p, losses = _train(step, params, batches)
    _assert_close(p, losses, ref_p, ref_losses)
    # today's path on the first steps: the same to fp32 rounding
    old = cj.make_chunked_step(stages, layout, sched, accumulation="per_micro_batch", host_optimizer=spec,
                               compute_dtype=jnp.float32, micro_batches=M)
    p_old, l_old = _train(old, params, batches[:3])
    _assert_close(p_new, l_new, p_old, l_old)


def test_tied_loops_train_bit_for_bit_as_plain_scans(setup, in_program, monkeypatch):
    """The walker's loops tied to their inputs (:func:`chunkjax.tied_loop.tied_scan`: zeros and
    stacked outputs made after an optimization barrier, written in place) change no bit against
    plain ``jax.lax.scan`` / ``lax.map`` loops: 3 steps, pinned-host params, host and streamed
    updates, clipping. (The tied step's 3 steps: the module's in-program step, traced with the
    tied loops before the patch below.)"""
    from chunkjax import walker
    cfg, params, batches, stages, layout, traces = setup
    spec, sched, _, tied = in_program
    kw = dict(host_optimizer=spec, compute_dtype=jnp.float32, micro_batches=M, accumulation="in_program")
    monkeypatch.setattr(walker, "tied_scan", _plain_scan)
    plain = _train(cj.make_chunked_step(stages, layout, sched, **kw), params, batches[:3])
    np.testing.assert_array_equal(tied[1], plain[1])
    for a, b in zip(jax.tree.leaves(tied[0]), jax.tree.leaves(plain[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the planner's choice ------------------------------------------------------------------------

def test_planner_prefers_in_program_fetching_once_and_falls_back(setup):
    """With 4 micro-batches the plan loops inside the moments where it fits: its per-step fetch
    bytes equal the one-micro-batch plan's (every chunk fetched once a step; the per-micro-batch
    plan fetches 4 times), its saved stage inputs are the whole batch's. At a budget the
    whole-batch stage inputs do not fit, the planner falls back to the per-micro-batch plan,
    and the step follows the schedule's choice."""
    from chunkjax import fit, trace
    from chunkjax.plan_micro import grouped_problem
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=CLIP)
    problem = fit.prepare(stages, params, jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32), host_optimizer=spec,
                          compute_dtype=jnp.float32, micro_batches=M, min_chunks=4, host_budget=None,
                          check_host=False)
    one = dataclasses.replace(problem, micro_batches=1)
    inner = grouped_problem(problem, M).traces  # the measured loops (chunkjax.trace.in_program_traces)
    assert [t.input_bytes for t in inner] == [M * t.input_bytes for t in problem.traces]
    assert [t.input_bytes for t in trace.in_program_traces(problem.traces, M)] == [t.input_bytes for t in inner]

    def floor(p):
        with pytest.raises(cj.PlanError) as e:
            fit.plan(p, 1000)
        return e.value.min_budget_bytes

    low, high = floor(problem), floor(dataclasses.replace(problem, traces=inner, micro_batches=1))
    assert low < high  # the whole batch's stage inputs need more device memory
    # every chunk offloaded, room to hold what is fetched: the same fetches, once a step
    s_in, s_one = fit.plan(problem, 4 * high, resident=()), fit.plan(one, 4 * high, resident=())
    assert s_in.accumulation == "in_program" and s_one.accumulation == "per_micro_batch"
    assert set(s_in.param_kinds) == {"pinned_host"} and s_in.fetch == s_one.fetch
    for key in ("fetch_bytes_per_step", "n_fetches", "h2d_bytes_per_step", "d2h_bytes_per_step"):
        assert getattr(s_in.predicted, key) == getattr(s_one.predicted, key) > 0, key
    s_in = fit.plan(problem, high)
    assert s_in.accumulation == "in_program" and s_in.predicted.peak_device_bytes <= high
    s_per = fit.plan(problem, low)  # the in-program plan does not fit: today's path
    assert s_per.accumulation == "per_micro_batch" and s_per.predicted.peak_device_bytes <= low
    assert s_per.predicted.n_fetches == M * sum(len(f) for f in s_per.fetch)  # every pass fetches again
    assert s_in.predicted.n_fetches == sum(len(f) for f in s_in.fetch)
    assert s_per.predicted.host_working_bytes > s_in.predicted.host_working_bytes  # its float32 sums
    assert "accumulation in_program" in fit.describe(fit.FitReport(s_in, high, high, high, 0.9, None, (), {}, True,
                                                                   None, ()), problem)
    assert fit.build_step(problem, s_in).accumulation == "in_program"
    assert fit.build_step(problem, s_per).accumulation == "per_micro_batch"
    assert cj.Schedule.from_dict(s_in.to_dict()).accumulation == "in_program"


# ---- a weighted loss (chunkjax.loss_weight): the global token mean -------------------------------

@pytest.fixture(scope="module")
def masked():
    """tests/test_masked_loss.py's model, batches (rows scoring different counts, a micro-batch
    and some ranks none) and plain-optax reference on the whole batch's token mean."""
    import test_masked_loss as ml
    rng = np.random.default_rng(11)
    cfg = gpt.get_config("micro", n_layers=2)
    params = ml._random_params(cfg, rng)
    batches = [ml._batch(rng, cfg.vocab_size, s) for s in ml.SCORED]
    stages = ml._stages(cfg)
    tx = ml.SPEC.optax()

    @jax.jit
    def ref_step(p, o, b):
        loss, g = jax.value_and_grad(lambda p: ml.token_mean(cj.compose_loss(stages, p, b)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p, o, losses = params, tx.init(params), []
    for b in batches:
        p, o, loss = ref_step(p, o, b)
        losses.append(float(loss))
    order = cj.first_use_order(lambda p, b: ml.token_mean(cj.compose_loss(stages, p, b)), params, batches[0])
    return ml, dict(cfg=cfg, params=params, batches=batches, stages=stages, order=order, ref=(p, np.asarray(losses)))


def test_zero3_weighted_loss_in_program_equals_optax_on_the_token_mean(masked):
    """ZeRO stage 3 on 4 devices, 2 micro-batches looped inside the moments (the batch's rows
    reordered rank-major: each rank's parts are the per-pass path's micro-batches), every other
    chunk's params and state in pinned host, a weighted loss (ranks scoring nothing): each part
    seeded with 1 / its weight over the ranks and weighted by it in the head's factor gives the
    whole batch's token mean; a batch scoring no token is refused before any state changes
    (tests/test_masked_loss.py's checks and tolerances)."""
    from chunkjax import topology
    ml, s = masked
    n = 4
    layout = topology.build_zero_layout(s["params"], n, s["cfg"].vocab_size * s["cfg"].d_model, s["order"])
    kinds = tuple(cj.DEVICE if c % 2 else cj.PINNED_HOST for c in range(layout.n_chunks))
    step = cj.make_chunked_step(s["stages"], layout, cj.Placement(kinds, kinds), ml.SPEC.optax(), jnp.float32,
                                micro_batches=2, accumulation="in_program", mesh=topology.data_mesh(jax.devices()[:n]),
                                zero_stage=3)
    state, losses = ml._train(step, s)
    ml._assert_equal_to_optax(step, state, losses, s)
    ml._assert_refused_unchanged(step, state, s)


# ---- the device accounting of in-program accumulation (issue 24) ---------------------------------

def _compiled_peak(problem, step, sched, batch) -> int:
    """fit.compiled_peak's figure (the most over programs of argument + output + temp - alias + the
    bytes held beside the program, + the device-updated chunks' state) from XLA CPU's memory
    analysis, compiled with the barrier expander off as tests/test_lora.py does (XLA CPU drops the
    walker's optimization barriers before its last CSE; the GPU keeps them)."""
    from chunkjax.footprint import param_dtype
    lay, topo = step.layout, step.topology
    carry, peaks = {}, []
    for k in range(len(step.program_bounds())):
        fn, args = step.program(batch, k)
        ps = {c: jax.ShapeDtypeStruct((lay.chunk_size,), param_dtype(step, c),
                                      sharding=topo.param_sharding(step.placement.param_kinds[c])) for c in args}
        acc = carry.pop("acc", {})
        ma = fn.lower(ps, batch, carry, acc).compile({"xla_disable_hlo_passes": "cse_barrier_expander"}).memory_analysis()
        peaks.append(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                     - ma.alias_size_in_bytes)
        res = jax.eval_shape(fn, ps, batch, carry, acc)
        carry = dict(res[0], acc=res[1])
    beside = step.held_beside_programs(batch)
    resident = sum(u == "device" for u in sched.update_locations) * problem.cb_rank.state
    return max(p + b for p, b in zip(peaks, beside)) + resident


def _floor(problem) -> int:
    """The least budget a plan of ``problem`` fits: the per-micro-batch plan's (every chunk offloaded,
    one micro-batch's stage inputs), below every in-program group's floor (tests/test_micro_groups.py
    asserts the order): ``fit.plan(problem, 1)``'s refusal, found per pass first without compiling and
    measuring every group's loops (8, 4 and 2 micro-batches: the plans below then measure only the 8 they
    choose; tests/test_micro_cuts.py checks that none is)."""
    from chunkjax import fit
    with pytest.raises(cj.PlanError) as e:
        fit.plan(problem, 1)
    return e.value.min_budget_bytes


@pytest.mark.parametrize("micro_batches", [1, 8])
def test_in_program_plan_compiles_within_its_accounting(micro_batches):
    """A bf16 plan with device, host and streamed chunks, its programs compiled with the GPU's
    donation: the compiled device peak stays within 2 % above the accounted peak, for one
    micro-batch and for 8 looped in-program (the donated step trains bit for bit as the undonated one).
    Before, in-program accumulation's accounting
    estimated each stage's loop as one micro-batch's internals plus the stacked cotangents and
    missed the loop's own copies (its float32 carry beside the accumulators, the inputs XLA keeps
    for the loop) and the accumulators that a program emitting a host gradient held twice
    (undonated): compiled 1.23x the accounted peak here, 1.07-1.10x on the H200's GPT3_15B b64."""
    from chunkjax import fit
    # one block: the plan still has device, host and streamed chunks (the accounting is per stage)
    cfg = dataclasses.replace(gpt.get_config("micro"), d_model=128, n_layers=1, vocab_size=1024, seq_len=64)
    batch = jax.ShapeDtypeStruct((micro_batches * 2, cfg.seq_len + 1), jnp.int32)
    problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), batch, host_optimizer=AdamW(1e-4),
                          compute_dtype=jnp.bfloat16, micro_batches=micro_batches, host_budget=None,
                          check_host=False)
    floor = _floor(problem)
    full = fit.plan(problem, 1 << 40).predicted.peak_device_bytes
    sched = fit.plan(problem, int(floor + 0.6 * (full - floor)))
    assert sched.accumulation == ("in_program" if micro_batches > 1 else "per_micro_batch")
    assert sched.micro_group is None
    assert {"device", "host", "streamed"} <= set(sched.update_locations), sched.counts()
    step = dataclasses.replace(fit.build_step(problem, sched), donate=True)  # the GPU's donation
    accounted = sched.predicted.peak_device_bytes
    compiled = _compiled_peak(problem, step, sched, batch)
    assert compiled <= 1.02 * accounted, (compiled, accounted, compiled / accounted)
    if micro_batches > 1:  # the donated float32 accumulators (bf16 gradients to host memory) change no bit
        rng = np.random.default_rng()
        params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))
        tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, batch.shape), jnp.int32) for _ in range(2)]
        runs = [_train(s, params, tokens) for s in (step, dataclasses.replace(step, donate=False))]
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        for a, b in zip(jax.tree.leaves(runs[0][0]), jax.tree.leaves(runs[1][0]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _plain_scan(body, init, xs, *, unroll=False):
    """The loop before the tie: ``jax.lax.scan``, its zeros constants (XLA may fill them anywhere)."""
    init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, init,
                        is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))
    return jax.lax.scan(body, init, xs, unroll=True if unroll else 1)


def test_program_of_several_looped_backward_moments_compiles_within_its_accounting(monkeypatch):
    """Issue 24 on the H200: a program holding several in-program backward moments (each a
    ``lax.scan``) compiled 3.5e9 bytes (18 %) over its accounting, its single-moment programs
    below theirs: XLA filled each loop's float32 carry and stacked input cotangent by copies of
    constants it scheduled at the program's start, so every later loop's buffers were live from
    its first moment. The walker's loops are now tied to their inputs
    (:func:`chunkjax.tied_loop.tied_scan`). Here the head and every backward moment run in one
    program (forward in the other): the compiled peak is at most the accounted one (untied loops,
    :func:`_plain_scan`, compile over it: 1.077 x before the tie)."""
    from chunkjax import fit, walker
    m = 8
    cfg = dataclasses.replace(gpt.get_config("micro"), d_model=128, n_layers=3, vocab_size=1024, seq_len=64)
    batch = jax.ShapeDtypeStruct((m * 2, cfg.seq_len + 1), jnp.int32)
    n_fwd = len(gpt.gpt_stages(cfg)) - 1
    problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), batch, host_optimizer=AdamW(1e-4),
                          compute_dtype=jnp.bfloat16, micro_batches=m, host_budget=None, check_host=False)
    problem = dataclasses.replace(problem, segments=(0, n_fwd))
    floor = _floor(problem)
    full = fit.plan(problem, 1 << 40).predicted.peak_device_bytes
    sched = fit.plan(problem, int(floor + 0.6 * (full - floor)))
    assert sched.accumulation == "in_program" and sched.micro_group is None
    assert tuple(sched.segments) == (0, n_fwd) and "host" in sched.update_locations, (sched.segments, sched.counts())
    accounted = sched.predicted.peak_device_bytes
    step = dataclasses.replace(fit.build_step(problem, sched), donate=True)  # the GPU's donation
    compiled = _compiled_peak(problem, step, sched, batch)
    monkeypatch.setattr(walker, "tied_scan", _plain_scan)
    untied = _compiled_peak(problem, dataclasses.replace(fit.build_step(problem, sched), donate=True), sched, batch)
    print(f"accounted {accounted} compiled {compiled} ({compiled / accounted:.4f}) untied {untied} "
          f"({untied / accounted:.4f})")
    assert compiled <= accounted < untied, (compiled, accounted, untied)
    assert compiled >= 0.85 * accounted, (compiled, accounted)  # not paid for twice
