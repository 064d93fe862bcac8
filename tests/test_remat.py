"""Selective activation checkpointing per stage (:mod:`chunkjax.remat`): a step whose blocks keep
their named activations (on the device, ``"save"``, or in pinned host memory, ``"offload"``)
instead of recomputing them trains exactly as the full-recompute step and plain optax; the figures
the planner uses are those of the block's shapes; the fit path's planner keeps activations where
it predicts a faster step within the budget and recomputes where it does not.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import remat
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from models import gpt

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 3


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 23, 7, B, T, STEPS)


def _schedule(setup, tx):
    """Chunk 0 resident, the rest fetched from pinned host memory and updated streamed; one
    program per forward moment, the head alone, then the backward moments one program each (every
    kept activation crosses a program boundary)."""
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(tx, layout.chunk_size))
    n = len(stages)
    segs = tuple(range(2 * n - 1))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=cfg.flops_per_token(T) * B * T, resident=[0],
                          host_update=False)
    assert "pinned_host" in sched.param_kinds
    return dataclasses.replace(sched, segments=segs)  # no host updates: planned as one program


def _train(setup, sched, tx):
    cfg, params, batches, stages, layout, traces = setup
    step = cj.make_chunked_step(stages, layout, sched, tx=tx, compute_dtype=jnp.float32)
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b[:B])
        losses.append(float(m["loss"]))
    return step.master_params(state), np.asarray(losses)


@pytest.fixture(scope="module")
def references(setup):
    """(full-recompute step's (params, losses), optax's (params, losses)) over the batches."""
    cfg, params, batches, stages, layout, traces = setup
    tx = optax.adamw(1e-3)
    p_ref, l_ref, _ = micro_batch_reference(cfg, params, batches, tx, rows=B)
    return _train(setup, _schedule(setup, tx), tx), (p_ref, l_ref)


@pytest.mark.parametrize("option", ["mixed", "offload_one_program"])
def test_kept_activations_train_as_full_recompute_and_optax(setup, references, option):
    """Kept on the device and offloaded, mixed with full recompute (a program per moment: every
    kept array crosses programs, block 1's offloaded one from program 1 to 5, block 2's saved one
    from 2 to 4), and every stage offloaded in one program (fetched ahead inside it). (Every block
    saved, or every block offloaded, a program per moment: the paths of the mixed case's blocks.)"""
    cfg, params, batches, stages, layout, traces = setup
    tx = optax.adamw(1e-3)
    n = len(stages)
    opts = ((remat.FULL, remat.OFFLOAD, remat.SAVE, remat.FULL) if option == "mixed" else (remat.OFFLOAD,) * n)
    sched = dataclasses.replace(_schedule(setup, tx), remat=opts, remat_names=gpt.REMAT_NAMES)
    if option == "offload_one_program":
        sched = dataclasses.replace(sched, segments=(0,))
    (p_full, l_full), (p_ref, l_ref) = references
    p_kept, l_kept = _train(setup, sched, tx)
    np.testing.assert_allclose(l_kept, l_full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l_kept, l_ref, rtol=1e-5, atol=1e-5)
    for a, b, c in zip(jax.tree.leaves(p_kept), jax.tree.leaves(p_full), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-4, atol=2e-6)


def _carries_and_flops(step, layout, batch):
    """Per program of ``step``, the carry it hands on (abstract, with shardings) and the matmul
    FLOPs of its live equations (:func:`chunkjax.remat.live_matmul_flops`)."""
    topo = step.topology
    ab = jax.ShapeDtypeStruct(batch.shape, batch.dtype)
    carry, out = {}, []
    for k in range(len(step.program_bounds())):
        fn, args = step.program(ab, k)
        params = {c: jax.ShapeDtypeStruct((layout.chunk_size,), jnp.float32,
                                          sharding=topo.param_sharding(step.placement.param_kinds[c])) for c in args}
        acc = carry.pop("acc", {})
        traced = fn.trace(params, ab, carry, acc)
        res = jax.eval_shape(fn, params, ab, carry, acc)
        carry = dict(res[0], acc=res[1])
        out.append((res[0], remat.live_matmul_flops(traced.jaxpr)))
    return out


def test_kept_activations_cross_programs_in_their_kind_and_skip_the_recompute(setup):
    """Offloaded activations leave their forward program in pinned host memory, saved ones on the
    device; each block's backward program runs ``saved_flops`` fewer matmul FLOPs than with full
    recompute (the figures of the block: its MLP input matmul, 2 * h * 4h per token)."""
    cfg, params, batches, stages, layout, traces = setup
    tx = optax.adamw(1e-3)
    full = _schedule(setup, tx)
    n = len(stages)
    opts = (remat.FULL, remat.OFFLOAD, remat.SAVE, remat.FULL)
    kept = dataclasses.replace(full, remat=opts, remat_names=gpt.REMAT_NAMES)
    runs = {}
    for name, sched in (("full", full), ("kept", kept)):
        step = cj.make_chunked_step(stages, layout, sched, tx=tx, compute_dtype=jnp.float32)
        runs[name] = _carries_and_flops(step, layout, batches[0][:B])
    figs = remat.remat_figures(stages, layout, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), jnp.float32,
                               gpt.REMAT_NAMES)
    h = cfg.d_model
    for s in (1, 2):
        assert figs[s].saved_bytes == B * T * 4 * h * 4
        assert figs[s].saved_flops == 2 * B * T * h * 4 * h
    # after the forward programs (moments 0..n-2): the blocks' kept activations, in their kinds
    carry = runs["kept"][n - 2][0]
    assert carry["kept"]["1"][0].sharding.memory_kind == "pinned_host"
    assert carry["kept"]["2"][0].sharding.memory_kind == "device"
    assert "kept" not in runs["full"][n - 2][0]
    moments = full.moments
    for s in (1, 2):
        k = moments.index(("backward", s))  # one program per moment
        assert runs["full"][k][1] - runs["kept"][k][1] == figs[s].saved_flops


def test_compiled_programs_take_kept_activations_in_their_kinds(setup, monkeypatch):
    """The fit path's compiled check lowers the programs in order and compiles them in threads,
    with the carry's shardings as the programs leave them: kept activations in pinned host
    memory too (no fall back to compiling one by one)."""
    from chunkjax import footprint
    cfg, params, batches, stages, layout, traces = setup
    tx = optax.adamw(1e-3)
    n = len(stages)
    sched = dataclasses.replace(_schedule(setup, tx), remat=(remat.FULL, remat.OFFLOAD, remat.SAVE, remat.FULL),
                                remat_names=gpt.REMAT_NAMES)
    step = cj.make_chunked_step(stages, layout, sched, tx=tx, compute_dtype=jnp.float32)
    calls = []
    real = footprint.compiled_programs
    monkeypatch.setattr(footprint, "compiled_programs", lambda *a, **k: calls.append(k) or real(*a, **k))
    out = footprint.compiled_programs(step, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), workers=2)
    assert calls == [{"workers": 2}]  # no second, in-order pass
    kept = out[n - 2].output_shardings[0]["kept"]
    assert kept["1"][0].memory_kind == "pinned_host" and kept["2"][0].memory_kind == "device"


def _problem(setup, remat_mode, rates):
    from chunkjax import fit
    cfg, params, batches, stages, layout, traces = setup
    return fit.prepare(stages, params, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), tx=optax.adamw(1e-3),
                       compute_dtype=jnp.float32, rates=rates, host_budget=None, min_chunks=6,
                       flops_per_step=cfg.flops_per_token(T) * B * T), remat_mode


def test_planner_keeps_activations_where_faster_and_recomputes_where_they_do_not_fit(setup, references):
    """``remat="auto"``: with slow matmuls and room in the budget the plan keeps activations
    (faster predicted step than full recompute, within the budget) and the fit path's step trains
    as optax; at the smallest budget full recompute fits, it recomputes. A forced ``"offload"``
    over a slow link predicts a slower step than full recompute (and is run as asked)."""
    from chunkjax import fit
    from chunkjax.cost import Rates
    from chunkjax.errors import PlanError
    cfg, params, batches, stages, layout, traces = setup
    slow = Rates(matmul_flops_per_s=1e9)
    problem, _ = _problem(setup, "auto", slow)
    full = fit.plan(problem, 10**12)
    assert full.remat == ()
    roomy = full.predicted.peak_device_bytes * 4
    auto = fit.plan(dataclasses.replace(problem, remat="auto", remat_names=gpt.REMAT_NAMES), roomy)
    assert set(auto.remat) - {remat.FULL} and auto.remat_names == gpt.REMAT_NAMES
    assert auto.predicted.peak_device_bytes <= roomy
    assert auto.predicted.time.step_s < fit.plan(problem, roomy).predicted.time.step_s
    assert auto.predicted.time.recompute_saved_s > 0
    # the smallest budget the full-recompute plan fits: keeping activations there does not
    try:
        fit.plan(problem, 1)
        pytest.fail("a 1-byte budget planned")
    except PlanError as e:
        tight = e.min_budget_bytes
    tight_auto = fit.plan(dataclasses.replace(problem, remat="auto", remat_names=gpt.REMAT_NAMES), tight)
    assert tight_auto.remat == ()
    # forced offload over a slow link: slower than recompute, planned as asked
    p_off, _ = _problem(setup, "offload", Rates(matmul_flops_per_s=1e12, h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3,
                                                one_program_duplex_bytes_per_s=1e3))
    off = fit.plan(dataclasses.replace(p_off, remat="offload", remat_names=gpt.REMAT_NAMES), roomy)
    assert set(off.remat) == {remat.FULL, remat.OFFLOAD} and off.predicted.time.activation_bytes > 0
    # the offloaded activations are host bytes (pinned), all held at the forward's end
    from chunkjax.host_memory import schedule_host_parts
    parts = schedule_host_parts(off, p_off.cb)
    assert parts["pinned_activations"] == off.predicted.time.activation_bytes
    assert sum(v for k, v in parts.items() if k != "device_on_host") == off.predicted.host_bytes
    assert off.predicted.time.step_s > fit.plan(p_off, roomy).predicted.time.step_s
    assert fit.plan(dataclasses.replace(p_off, remat="auto", remat_names=gpt.REMAT_NAMES), tight).remat == ()
    # the fit path's step runs the chosen remat and trains as optax
    step = fit.build_step(dataclasses.replace(problem, remat="auto", remat_names=gpt.REMAT_NAMES), auto)
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b[:B])
        losses.append(float(m["loss"]))
    p_ref, l_ref = references[1]  # optax.adamw(1e-3) on these batches' first B rows
    np.testing.assert_allclose(losses, l_ref, rtol=1e-5, atol=1e-5)
    for a, c in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-4, atol=2e-6)


def test_offloaded_activations_count_in_the_pinned_pool_under_a_tight_host_budget(setup):
    """On a GPU the offloaded activations are pinned: with a host budget the pinned pool they need
    does not fit, the planner offloads fewer blocks (``"auto"``) or refuses (``"offload"``). The
    pool is the power of two above the pinned peak over ``1 - PINNED_POOL_FRAGMENTATION`` (the
    session-17 GPT3_6B run kept 95 % of its 32 GiB pool pinned, was planned within the host and
    was killed in its first step as the pool grew its next region)."""
    from chunkjax import fit, fit_host
    from chunkjax.cost import Rates
    from chunkjax.errors import PlanError
    from chunkjax.host_memory import PINNED_POOL_FRAGMENTATION
    problem, _ = _problem(setup, "auto", Rates(matmul_flops_per_s=1e9))
    gpu = dataclasses.replace(problem, platform="gpu", remat_names=gpt.REMAT_NAMES)
    n_blocks = sum(f.saved_bytes > 0 for f in gpu.remat_figures)
    off = fit.plan(dataclasses.replace(gpu, remat="offload"), 10**12)  # every chunk on the device
    act = off.predicted.time.activation_bytes
    assert fit_host.host_need(gpu, off)["pinned_host_bytes"] == act > 0  # the pinned bytes: the activations
    budget = off.predicted.peak_device_bytes  # every block offloaded fits, kept on the device it does not
    roomy = fit.plan(dataclasses.replace(gpu, remat="auto"), budget)
    assert roomy.remat.count(remat.OFFLOAD) == n_blocks and not roomy.remat.count(remat.SAVE)
    tight = dataclasses.replace(gpu, host_budget_bytes=act)  # the activations' bytes, no pool to round them up
    with pytest.raises(PlanError):
        fit.plan(dataclasses.replace(tight, remat="offload"), budget)
    s = fit.plan(dataclasses.replace(tight, remat="auto"), budget)
    assert s.remat.count(remat.OFFLOAD) < n_blocks
    need = fit_host.host_need(tight, s)
    # the pinned peak within the share of the pool a plan may use, the pool within the host budget
    assert need["pinned_host_bytes"] <= (1 - PINNED_POOL_FRAGMENTATION) * need["pinned_pool_bytes"]
    assert need["pinned_pool_bytes"] + need["pageable_bytes"] <= act
    assert s.predicted.peak_device_bytes <= budget


def test_remat_refuses_what_it_cannot_run(setup):
    cfg, params, batches, stages, layout, traces = setup
    full = _schedule(setup, optax.adamw(1e-3))
    n = len(stages)
    with pytest.raises(ValueError, match="remat_names"):
        dataclasses.replace(full, remat=(remat.SAVE,) * n)
    with pytest.raises(ValueError, match="one option per stage"):
        dataclasses.replace(full, remat=(remat.SAVE,), remat_names=gpt.REMAT_NAMES)
    with pytest.raises(ValueError, match="not one of"):
        dataclasses.replace(full, remat=("keep",) * n, remat_names=gpt.REMAT_NAMES)
    from chunkjax import fit
    from chunkjax.cost import Rates
    problem, _ = _problem(setup, "auto", Rates())
    with pytest.raises(ValueError, match="remat="):
        fit.plan(dataclasses.replace(problem, remat="sometimes", remat_names=gpt.REMAT_NAMES), 10**12)
    with pytest.raises(ValueError, match="needs remat_names"):
        fit.plan(dataclasses.replace(problem, remat="auto"), 10**12)


def _exported_signatures(step, layout, batch):
    """Per program of ``step`` exported for CUDA (``jax.export``, on the CPU): its @main line."""
    from chunkjax.memory import sharding
    ab = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=sharding("device"))
    carry, out = {}, []
    for k in range(len(step.program_bounds())):
        fn, args = step.program(ab, k)
        ps = {c: jax.ShapeDtypeStruct((layout.chunk_size,), jnp.bfloat16,
                                      sharding=sharding(step.placement.param_kinds[c])) for c in args}
        acc = carry.pop("acc", {})
        txt = jax.export.export(fn, platforms=("cuda",))(ps, ab, carry, acc).mlir_module()
        out.append(next(line for line in txt.splitlines() if "func.func public @main" in line))
        res = jax.eval_shape(fn, ps, ab, carry, acc)
        carry = dict(res[0], acc=res[1])
    return out


def test_offloaded_activations_lower_for_the_gpu(setup):
    """Every program of a bf16 step with offloaded blocks lowers for CUDA; a block's kept
    activation is a pinned_host result of its forward program and argument of the programs it
    crosses, until the program before its backward's fetches it ahead (a device result)."""
    cfg, params, batches, stages, layout, traces = setup
    tx = optax.adamw(1e-3)
    full = _schedule(setup, tx)
    kept = dataclasses.replace(full, remat=(remat.FULL, remat.OFFLOAD, remat.OFFLOAD, remat.FULL),
                               remat_names=gpt.REMAT_NAMES)
    sig = {}
    for name, sched in (("full", full), ("kept", kept)):
        step = cj.make_chunked_step(stages, layout, sched, tx=tx, compute_dtype=jnp.bfloat16)
        sig[name] = _exported_signatures(step, layout, batches[0][:B])
    host = lambda line: line.count('"pinned_host"')  # noqa: E731
    # program k = moment k: forward 0, 1, 2, head, backward 2, 1, 0. Block 1's activation leaves
    # program 1 and crosses to program 4, whose last moment fetches it to the device for program 5;
    # block 2's leaves program 2, the head (program 3) fetches it for program 4
    extra = [host(a) - host(b) for a, b in zip(sig["kept"], sig["full"])]
    assert extra == [0, 1, 1 + 2, 2 + 1, 1 + 0, 0, 0]  # pinned_host arguments + results
