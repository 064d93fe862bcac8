"""In-program accumulation over micro-batch groups (:mod:`chunkjax.plan_micro`, ``micro_group``):
each pass of the programs loops over G micro-batches inside its moments, the ``M / G`` passes'
gradients summed in float32 as the per-micro-batch path sums micro-batches
(:func:`chunkjax.accumulate.mean_gradients`). References: plain optax on the whole batch with
float32 micro-batch sums (tests/_optax_reference.py) for device, host and storage chunks with
clipping (tests/test_disk_tier.py's tolerances), and the token mean of a weighted loss
(tests/test_masked_loss.py's checks); the planner's choice of the largest group that fits.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import fit, fit_host, topology
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.plan_micro import grouped_problem, passes_of
from chunkjax.storage.updater import StorageOptions
from models import gpt

from _optax_reference import micro_batch_reference

B, T, M, G = 2, 16, 4, 2  # B rows per micro-batch, M micro-batches in groups of G
STEPS = 5
SPEC = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)  # clipping fires: the norm is global


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng(24)
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(24))  # one program, not one per op
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (M * B, T + 1)), jnp.int32) for _ in range(STEPS)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0][:B])
    layout = cj.build_layout(params, cfg.vocab_size * cfg.d_model // 4, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    return cfg, params, batches, stages, layout, traces, cb


def _three_tier_schedule(setup):
    """Chunk 0 resident, the others offloaded under a host budget of 0.6 of what they need with
    their compute copies (tests/test_disk_tier.py): device, host and storage chunks at once."""
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(flops_per_step=cfg.flops_per_token(T) * M * B * T, resident=[0], split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    s = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=int(0.6 * free.predicted.host_bytes),
                      storage_devices=1, **kw)
    assert set(s.update_locations) == {"device", "host", "storage"}, s.counts()
    return s


def test_groups_with_device_host_and_storage_chunks_equal_optax(setup, tmp_path, monkeypatch):
    """4 micro-batches in 2 groups of 2, chunks updated on the device, on the host and on storage
    at once, clip_by_global_norm firing: 5 steps equal plain optax on the mean of the 4
    micro-batches' gradients (losses rtol 1e-5, master params rtol 2e-4 / atol 2e-6); the programs
    run twice a step, each pass looping over 2 micro-batches; the storage chunks' state is read and written once a step (the
    plan's disk bytes per step, not once per pass)."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = dataclasses.replace(_three_tier_schedule(setup), accumulation="in_program", micro_group=G)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                micro_batches=M, storage=StorageOptions((str(tmp_path / "d0"),), fsync=False))
    assert step.accumulation == "in_program" and step.micro_group == G and step.passes == M // G
    assert step.walk(batches[0][:G * B]).micro_batches == G
    rows, run = [], cj.ChunkedStep.run_programs  # the rows of each pass of the programs

    def counted(self, state, batch, *a, **k):
        rows.append(jax.tree.leaves(batch)[0].shape[0])
        return run(self, state, batch, *a, **k)

    monkeypatch.setattr(cj.ChunkedStep, "run_programs", counted)
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    assert rows == [G * B] * (M // G) * STEPS  # 2 passes a step, each over one group's rows
    ref_p, ref_losses, norms = micro_batch_reference(cfg, params, batches, SPEC.optax(), M)
    assert np.all(norms > SPEC.max_grad_norm)  # clipping fires on every step
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    disk = state.master[sched.update_locations.index("storage")]
    assert disk.committed_step == STEPS and len(disk.history) == STEPS
    assert sum(disk.last.storage_link_bytes.values()) == sched.predicted.disk_bytes_per_step
    disk.close()


def test_groups_of_a_weighted_loss_equal_optax_on_the_token_mean():
    """A weighted loss (tests/test_masked_loss.py: micro-batches of 2 rows scoring 19/0/9/17 tokens
    ...), 4 micro-batches in 2 groups of 2 on one device, device and host chunks: each group's
    gradient is its token mean, weighted by the group's tokens over the batch's, so the update is
    the whole batch's token mean; a batch scoring no token is refused with no state changed."""
    import test_masked_loss as ml
    rng = np.random.default_rng(11)
    cfg = gpt.get_config("micro", n_layers=2)
    params = ml._random_params(cfg, rng)
    s = dict(cfg=cfg, params=params, batches=[ml._batch(rng, cfg.vocab_size, x) for x in ml.SCORED],
             stages=ml._stages(cfg))
    loss_of = lambda p, b: ml.token_mean(cj.compose_loss(s["stages"], p, b))  # noqa: E731
    tx = ml.SPEC.optax()

    @jax.jit
    def ref_step(p, o, b):  # plain optax on the whole batch: the token-weighted mean
        loss, g = jax.value_and_grad(loss_of)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p, o, ref_losses = params, tx.init(params), []
    for b in s["batches"]:
        p, o, loss = ref_step(p, o, b)
        ref_losses.append(float(loss))
    s["ref"] = (p, np.asarray(ref_losses))
    layout = cj.build_layout(params, None, cj.first_use_order(loss_of, params, s["batches"][0]), min_chunks=6)
    traces = cj.trace_stages(s["stages"], layout, jax.ShapeDtypeStruct((ml.B // 4, ml.T + 1), jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(tx, layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=cfg.flops_per_token(ml.T) * ml.B * ml.T,
                          resident=[0], split=False)  # chunk 0 device-updated, the others host-updated
    assert set(sched.update_locations) == {"device", "host"}, sched.counts()
    step = cj.make_chunked_step(s["stages"], layout, sched, host_optimizer=ml.SPEC, compute_dtype=jnp.float32,
                                micro_batches=4, accumulation="in_program", micro_group=2)
    assert step.passes == 2
    state, losses = ml._train(step, s)
    ml._assert_equal_to_optax(step, state, losses, s)
    ml._assert_refused_unchanged(step, state, s)


def test_planner_picks_the_largest_group_that_fits(setup):
    """At a device budget below the in-program plan's floor (the whole batch's stage inputs) but
    at the floor of groups of 2, the plan is in-program over groups of 2: its fetches repeat once
    per pass (twice a step), the passes' float32 sums are counted on the host (the per-pass
    accounting); below that floor, per micro-batch. The choice is reported in the plan's line and
    kept by ``Schedule.to_dict``; the step built from it runs 2 passes and equals optax over 3 steps."""
    cfg, params, batches, stages, layout, traces, cb = setup
    problem = fit.prepare(stages, params, jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32), host_optimizer=SPEC,
                          compute_dtype=jnp.float32, micro_batches=M, chunk_size=layout.chunk_size,
                          host_budget=None, check_host=False, unroll_micro_batches=False)  # while loops: the line below

    def floor(p):
        with pytest.raises(cj.PlanError) as e:
            fit._plan_passes(p, 1000, policy="tide", resident=None, must_fit=True, split=True)
        return e.value.min_budget_bytes

    low, mid, high = floor(problem), floor(grouped_problem(problem, G)), floor(grouped_problem(problem, M))
    assert low < mid < high
    s = fit.plan(problem, mid)
    assert (s.accumulation, s.micro_group, passes_of(s, M)) == ("in_program", G, M // G)
    assert s.predicted.peak_device_bytes <= mid
    assert s.predicted.n_fetches == (M // G) * sum(len(f) for f in s.fetch) > 0
    assert fit.plan(problem, high).micro_group is None  # in-program in one pass where it fits
    per = fit.plan(problem, low)
    assert per.accumulation == "per_micro_batch" and passes_of(per, M) == M
    # the passes' sums: 4 bytes per parameter of every offloaded chunk on the host
    one_pass = dataclasses.replace(s, micro_group=None)
    summed = sum(u != "device" for u in s.update_locations)
    assert summed > 0
    assert (fit_host.host_need(problem, s)["pageable_bytes"] - fit_host.host_need(problem, one_pass)["pageable_bytes"]
            == summed * problem.cb.master)
    line = fit.describe(fit.FitReport(s, mid, mid, mid, 0.9, None, (), {}, True, None, ()), problem)
    assert "accumulation in_program over groups of 2 micro-batches (2 passes)" in line and "unrolled" not in line
    for sched, says in ((dataclasses.replace(s, unroll_micro_batches=True), True),  # only an in-program plan unrolls
                        (dataclasses.replace(per, unroll_micro_batches=True), False)):
        line = fit.describe(fit.FitReport(sched, mid, mid, mid, 0.9, None, (), {}, True, None, ()), problem)
        assert ("loops unrolled" in line) == says, line
    assert cj.Schedule.from_dict(s.to_dict()).micro_group == G
    for acc, passes in (("in_program", M // G), ("per_micro_batch", M)):  # the schedule's groups unless overridden
        assert cj.make_chunked_step(stages, problem.layout, s, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                    micro_batches=M, accumulation=acc).passes == passes
    # the fit path's step runs the groups: 3 steps equal optax (every chunk offloaded, host updates, clipping)
    step = fit.build_step(problem, s)
    assert step.passes == M // G and step.walk(batches[0][:G * B]).micro_batches == G
    state, losses = step.init(params), []
    for b in batches[:3]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    ref_p, ref_losses, _ = micro_batch_reference(cfg, params, batches[:3], SPEC.optax(), M)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def test_bad_micro_group_is_one_line(setup):
    """A group that does not divide the micro-batches, a group per micro-batch, or groups of
    several passes on a mesh: refused at construction in one line."""
    cfg, params, batches, stages, layout, traces, cb = setup
    kinds = (cj.DEVICE,) * layout.n_chunks
    kw = dict(micro_batches=M, accumulation="in_program")
    for bad, acc, match in ((3, "in_program", "dividing micro_batches=4"), (0, "in_program", "int >= 1"),
                            (2, "per_micro_batch", "needs accumulation='in_program'")):
        with pytest.raises(ValueError, match=match) as e:
            cj.make_chunked_step(stages, layout, cj.Placement(kinds, kinds), SPEC.optax(), jnp.float32,
                                 **dict(kw, accumulation=acc), micro_group=bad)
        assert "\n" not in str(e.value)
    zl = topology.build_zero_layout(params, 2, cfg.vocab_size * cfg.d_model, cj.first_use_order(
        lambda p, b: cj.compose_loss(stages, p, b), params, batches[0][:B]))
    zk = (cj.DEVICE,) * zl.n_chunks
    with pytest.raises(ValueError, match="runs on one device"):
        cj.make_chunked_step(stages, zl, cj.Placement(zk, zk), SPEC.optax(), jnp.float32, micro_group=2,
                             mesh=topology.data_mesh(jax.devices()[:2]), zero_stage=3, **kw)


def test_refusal_names_the_least_host_need(setup):
    """When every accumulation is refused for lack of host memory, the error is the one of least
    host need: in-program over all micro-batches (no float32 sums across passes) where the
    per-micro-batch plan needs more, saying so and naming the per-micro-batch figure (was: the
    per-micro-batch refusal, overstating the host budget to ask for)."""
    from chunkjax.errors import HostBudgetError
    cfg, params, batches, stages, layout, traces, cb = setup
    problem = fit.prepare(stages, params, jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32), host_optimizer=SPEC,
                          compute_dtype=jnp.float32, micro_batches=M, chunk_size=layout.chunk_size,
                          host_budget=1000, check_host=False)
    kw = dict(policy="tide", resident=None, must_fit=True, split=True)

    def refusal(p, budget):
        with pytest.raises(HostBudgetError) as e:
            fit._plan_passes(p, budget, **kw)
        return e.value

    with pytest.raises(cj.PlanError) as e:  # the in-program floor: every chunk offloaded
        fit._plan_passes(dataclasses.replace(grouped_problem(problem, M), host_budget_bytes=None), 1000, **kw)
    budget = 2 * e.value.min_budget_bytes  # (3x: every chunk on the device fits since the loops' fills count)
    inner, per = refusal(grouped_problem(problem, M), budget), refusal(problem, budget)
    assert 1000 < inner.host_need_bytes < per.host_need_bytes  # the passes' float32 sums
    with pytest.raises(HostBudgetError) as e:
        fit.plan(problem, budget)
    msg = str(e.value)
    assert e.value.host_need_bytes == inner.host_need_bytes and msg.startswith(str(inner)) and "\n" not in msg
    assert f"(in-program over {M} of the {M} micro-batches a pass, the least host need; per micro-batch " \
           f"{per.host_need_bytes} bytes)" in msg
