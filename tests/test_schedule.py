"""The static schedule (issue 3): the planner on traced stages, and the pipelined step that
carries it out (Belady fetches/evictions, programs cut at backward moments, host updates in a
thread) equals plain optax training.

On the CPU memory kinds compile to nothing, so these check numerics and bookkeeping; placement,
bytes moved and speed are checked on the GPU (experiments/bench.py, docs/benchmarks.md).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax.cost import Rates
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import fetch_events, plan_schedule
from chunkjax.program_cut import auto_segments
from chunkjax.tide import memory_tide
from chunkjax.trace import StageTrace
from models import gpt

from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 6


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.get_config("micro", n_layers=2)  # 2 blocks: shorter compiles, still re-fetches in 3 programs
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 31)))
    # one jitted program, not an eager dispatch (and compile) per random op (tests/_micro_setup.py)
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32) for _ in range(STEPS)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    # chunks of the wte leaf's size: the layout the search chose before leaves could span chunks
    # (the fixed rule's smallest budget keeps every chunk in pinned host memory there)
    layout = cj.build_layout(params, cfg.vocab_size * cfg.d_model, order)
    ab = jax.ShapeDtypeStruct(batches[0].shape, jnp.int32)
    traces = cj.trace_stages(stages, layout, ab, jnp.bfloat16)
    return cfg, params, batches, stages, layout, traces


#: options of ``make_chunked_step`` that run on the host and enter no program
_HOST_SIDE = ("host_optimizer", "nonfinite")
_PROGRAMS: dict = {}


def _step(stages, layout, sched, **kw):
    """``make_chunked_step`` with a host optimizer, its programs (traced, jitted and compiled per
    batch shape) those of this module's earlier step of the same schedule and device-side options
    (the host optimizer and the non-finite policy do not enter them: as tests/test_host_bytes.py's
    ``_step``); built once, not per test. (A step keeps no training state: each run starts from
    ``init``.)"""
    step = cj.make_chunked_step(stages, layout, sched, **kw)
    key = (repr(sched), tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in _HOST_SIDE)))
    step.__dict__["_cache"] = _PROGRAMS.setdefault(key, step._cache)
    return step


def _cb(layout, tx):
    return cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(tx, layout.chunk_size))


_REFERENCES = {}


def _reference(cfg, params, batches, spec, dtype=jnp.bfloat16):
    """Plain optax (``spec.optax()``) on the device: master params after the batches, the losses
    and each step's global gradient norm. Computed once per (spec, dtype, number of batches): every
    caller passes the module's setup params and a prefix of its batches."""
    key = (spec, jnp.dtype(dtype).name, len(batches))
    if key in _REFERENCES:
        return _REFERENCES[key]
    # tests/_optax_reference.py: the loss and gradient program compiled once per (dtype, process)
    _REFERENCES[key] = micro_batch_reference(cfg, params, batches, spec.optax(), compute_dtype=dtype)
    return _REFERENCES[key]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [AdamW(3e-3, weight_decay=0.1), AdamW(3e-3, weight_decay=0.0, max_grad_norm=0.05)],
                         ids=["adamw", "adamw_clipped"])
def test_pipelined_host_update_matches_optax(setup, spec, dtype):
    """A schedule with resident chunks and host-updated chunks, three programs, a budget tight
    enough that Belady re-fetches: same losses as plain optax on the device (fp32 compute: and the
    same master params to fp32 rounding; bf16 compute: losses to bf16 tolerance)."""
    cfg, params, batches, stages, layout, traces = setup
    tx = spec.optax()
    cb = _cb(layout, tx)
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops,
                          resident=[0], segments=(0, len(stages) + 1, len(roomy.moments) - 1))
    assert set(sched.update_locations) == {"device", "host"}
    assert len(sched.segments) == 3
    assert sched.predicted.n_fetches > len(sched.fetch[0])
    step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=dtype)
    state = step.init(params)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    ref_p, ref_losses, _ = _reference(cfg, params, batches, spec, dtype)
    if dtype == jnp.float32:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        got = step.master_params(state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_p)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)


def test_program_split_equals_one_program(setup):
    """Cutting the step into programs changes nothing numerically (fp32 compute)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(1e-3)
    cb = _cb(layout, spec.optax())
    flops = cfg.flops_per_token(T) * B * T
    kw = dict(flops_per_step=flops, resident=[])
    one = plan_schedule(layout, traces, cb, 10**12, segments=None, **kw)
    many = plan_schedule(layout, traces, cb, 10**12, segments=auto_segments(len(one.moments), len(stages)), **kw)
    assert len(many.segments) > 2
    out = []
    for s in (one, many):
        step = cj.make_chunked_step(stages, layout, s, host_optimizer=spec, compute_dtype=jnp.float32)
        st = step.init(params)
        ls = []
        for b in batches[:3]:
            st, m = step(st, b)
            ls.append(float(m["loss"]))
        out.append((ls, step.master_params(st)))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _synthetic(n_stages, chunks_per_stage, n_chunks, rng, tied=False):
    traces = []
    for s in range(n_stages):
        cs = tuple(sorted(rng.choice(n_chunks, size=chunks_per_stage, replace=False).tolist()))
        if tied and s == n_stages - 1:
            cs = tuple(sorted(set(cs) | {0}))
        traces.append(StageTrace(f"s{s}", cs, int(rng.integers(1, 50)) * 1000, int(rng.integers(1, 80)) * 1000,
                                 None))
    return tuple(traces)


class _Lay:
    def __init__(self, n, cs):
        self.n_chunks, self.chunk_size = n, cs


@pytest.mark.parametrize("seed", range(12))
def test_plan_never_exceeds_budget(seed):
    """Random stage traces (tied chunk, repeated chunk use): for every budget at which a plan
    exists, the predicted device bytes at every moment stay within it and the fetches cover
    every read of an offloaded chunk."""
    rng = np.random.default_rng(seed)
    n_chunks, cs = int(rng.integers(3, 8)), 1000
    traces = _synthetic(int(rng.integers(3, 7)), 2, n_chunks, rng, tied=True)
    cb = cj.ChunkBytes(params=2 * cs, grad=2 * cs, master=4 * cs, opt=8 * cs)
    lay = _Lay(n_chunks, cs)
    tide = memory_tide(traces, cs)
    feasible = 0
    for budget in np.linspace(tide.peak_non_model_bytes, tide.peak_non_model_bytes + 30 * 16 * cs, 12).astype(int):
        try:
            s = plan_schedule(lay, traces, cb, int(budget), flops_per_step=1e9)
        except cj.PlanError as e:
            assert e.min_budget_bytes > budget
            continue
        feasible += 1
        assert s.predicted.peak_device_bytes <= budget
        assert max(s.predicted.device_bytes_per_moment) <= budget
        res = s.residency()
        for t, m in enumerate(tide.moments):
            for c in m.chunks:
                assert res[c][t], (t, c)
    assert feasible > 0


def test_infeasible_budget_names_the_smallest(setup):
    cfg, params, batches, stages, layout, traces = setup
    cb = _cb(layout, optax.adamw(1e-3))
    with pytest.raises(cj.PlanError, match="use device_budget >=") as e:
        plan_schedule(layout, traces, cb, 1000, flops_per_step=1e9)
    ok = plan_schedule(layout, traces, cb, e.value.min_budget_bytes, flops_per_step=1e9)
    assert ok.predicted.peak_device_bytes <= e.value.min_budget_bytes


def _shared_weight_model(rng):
    """A staged model with a tied weight (embedding read by the first and last stage), a weight
    read by two middle stages (so twice in the backward) and a parameter nothing reads (no
    gradient: only weight decay moves it)."""
    V, H = 40, 24
    params = {"emb": jnp.asarray(rng.normal(size=(V, H)) * 0.3, jnp.float32),
              "a": jnp.asarray(rng.normal(size=(H, H)) / np.sqrt(H), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(H, H)) / np.sqrt(H), jnp.float32),
              "unused": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32)}

    def embed(p, x, b):
        return p["emb"][b[:, :-1]]

    def mix(p, x, b):
        return jnp.tanh(x @ p["a"]) + x

    def mix_b(p, x, b):
        return jnp.tanh(x @ p["a"] @ p["b"]) + x

    def head(p, x, b):
        logits = (x @ p["emb"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    stages = (cj.Stage("embed", ("emb",), embed), cj.Stage("mix0", ("a",), mix),
              cj.Stage("mix1", ("a", "b"), mix_b), cj.Stage("head", ("emb",), head))
    return params, stages, V


def test_tied_repeated_and_unused_weights_host_updated():
    """fp32: the pipelined schedule with every chunk host-updated (one leaf per chunk, so the
    tied, twice-read and unread weights are separate chunks) equals optax on the full pytree."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 31)))
    params, stages, V = _shared_weight_model(rng)
    batches = [jnp.asarray(rng.integers(0, V, (3, 9)), jnp.int32) for _ in range(4)]
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    layout = cj.build_layout(params, max(int(np.prod(v.shape)) for v in params.values()), order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct(batches[0].shape, jnp.int32), jnp.float32)
    spec = AdamW(1e-2, weight_decay=0.1)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1e6, resident=[],
                          segments=(0, len(stages), len(stages) + 1))
    assert set(sched.update_locations) == {"host"}
    # the twice-read weight is read at two forward and two backward moments; with room to spare
    # Belady fetches it once and holds it through all four
    a_chunk = layout.chunks_of(["a"])[0]
    reads = [t for t, m in enumerate(memory_tide(traces, layout.chunk_size).moments) if a_chunk in m.chunks]
    assert len(reads) == 4
    assert sum(a_chunk in f for f in sched.fetch) == 1
    assert all(sched.residency()[a_chunk][t] for t in reads)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)
    state = step.init(params)
    tx = spec.optax()

    @jax.jit
    def ref_step(p, o, b):
        l, g = jax.value_and_grad(lambda p: cj.compose_loss(stages, p, b))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, l

    p, o = params, tx.init(params)
    for b in batches:
        state, m = step(state, b)
        p, o, l = ref_step(p, o, b)
        np.testing.assert_allclose(float(m["loss"]), float(l), rtol=1e-5)
    got = step.master_params(state)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(p[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    # the unread parameter moved by weight decay only
    np.testing.assert_allclose(np.asarray(got["unused"]), np.asarray(p["unused"]), rtol=1e-6)
    assert not np.allclose(np.asarray(got["unused"]), np.asarray(params["unused"]))


def test_host_budget_too_small_names_the_host(setup):
    cfg, params, batches, stages, layout, traces = setup
    cb = _cb(layout, optax.adamw(1e-3))
    offloaded = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1e9, resident=[])
    budget = offloaded.predicted.peak_device_bytes  # every chunk offloaded fits, all resident does not
    with pytest.raises(cj.PlanError, match="host_budget >="):
        plan_schedule(layout, traces, cb, budget, flops_per_step=1e9, host_budget_bytes=1000)


@pytest.mark.parametrize("kind, where", [("all_host", None), ("zero_offload", None), ("fixed", 0.05)])
def test_baseline_schedules_run_and_match_optax(setup, kind, where):
    """The static baselines of the planner CLI are schedules the runtime carries out: all_host
    (fetch at every read, release after it) and zero_offload (every chunk fetched at the step's
    start, held to its last read, host update after the backward) train exactly like plain optax
    (fp32 compute: same losses and master params to fp32 rounding); so does the fixed rule's
    schedule at a budget ``where`` of the way from its smallest to all resident (host params
    fetched, resident params, every update streamed)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(2e-3, weight_decay=0.05)
    tx = spec.optax()
    cb = _cb(layout, tx)
    budget = 10**12
    if kind == "fixed":
        with pytest.raises(cj.PlanError) as e:
            plan_schedule(layout, traces, cb, 1, policy="fixed")
        lo = e.value.min_budget_bytes
        hi = plan_schedule(layout, traces, cb, budget, policy="fixed").predicted.peak_device_bytes
        budget = int(lo + where * (hi - lo))
    sched = plan_schedule(layout, traces, cb, budget, policy=kind, flops_per_step=1.0)
    if kind == "fixed":
        assert set(sched.counts()) == {"params_device/update_streamed", "params_pinned_host/update_streamed"}
        assert sched.segments == (0,) and sched.predicted.n_fetches > 0
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)
    state = step.init(params)
    losses = []
    for b in batches[:4]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    ref_p, ref_losses, _ = _reference(cfg, params, batches[:4], spec, jnp.float32)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def test_device_update_donates_params_master_and_state(setup):
    """The update of a device chunk reuses its buffers: the step's input compute params, master
    params and optimizer state of every device-updated chunk are donated (deleted after the call).
    The unused old-params argument was once pruned by jit, so its donation was dropped and every
    updated chunk held two compute-param buffers until the step ended (GPT3_12B on the whole card
    ran out of memory in the update)."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(1e-3)
    cb = _cb(layout, spec.optax())
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1.0, resident=[0, 1])
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec)
    state = step.init(params)
    dev = [c for c, u in enumerate(sched.update_locations) if u == "device"]
    assert dev
    new, _ = step(state, batches[0])
    step.wait(new)
    for c in dev:
        assert state.params[c].is_deleted() and state.master[c].is_deleted(), c
        assert all(a.is_deleted() for a in jax.tree.leaves(state.opt_state[c])), c
        assert not new.params[c].is_deleted()


# ---- gradient accumulation (reported case 3) and skipping non-finite steps (issue 8) ----------

def _host_device_schedule(setup, spec):
    cfg, params, batches, stages, layout, traces = setup
    cb = _cb(layout, spec.optax())
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops,
                          resident=[0], segments=(0, len(stages) + 1, len(roomy.moments) - 1))
    assert set(sched.update_locations) == {"device", "host"}
    return sched


def _run(step, params, batches):
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    return state, np.asarray(losses)


@pytest.mark.parametrize("where", ["host_and_device", "streamed"])
def test_case3_micro_batches_equal_one_big_batch(setup, where):
    """N micro-batches of b sequences give the update of one batch of N*b (float32 compute):
    host-updated, device-updated and streamed chunks, with clipping so the global norm of the
    accumulated gradient matters."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)
    if where == "host_and_device":
        plan = _host_device_schedule(setup, spec)
        make = lambda n: _step(stages, layout, plan, host_optimizer=spec, compute_dtype=jnp.float32,  # noqa: E731
                               micro_batches=n)
    else:
        plan = cj.Placement.from_device_chunks(layout.n_chunks, range(0, layout.n_chunks, 2))
        make = lambda n: cj.make_chunked_step(stages, layout, plan, spec.optax(), compute_dtype=jnp.float32,
                                              micro_batches=n)
    big = [jnp.concatenate(batches[i:i + 3]) for i in (0, 3)]  # 2 steps of 3 x B sequences
    one, three = make(1), make(3)  # a step keeps no state: each run starts from init
    s1, l1 = _run(one, params, big)
    s3, l3 = _run(three, params, big)
    np.testing.assert_allclose(l3, l1, rtol=2e-6)

    def off(sa, sb):  # share of master params further apart than fp32 summation order explains
        a = np.concatenate([np.asarray(x) for x in sa.master])
        b = np.concatenate([np.asarray(x) for x in sb.master])
        return float(np.mean(np.abs(a - b) > 1e-6 + 1e-5 * np.abs(b))), float(np.max(np.abs(a - b)))

    # Adam normalises each gradient entry: where an entry is ~0 its rounding decides the update,
    # so a few entries (~1e-3 of them; 3.1e-3 seen on one fresh draw in session 17) differ by a
    # fraction of lr; a wrong accumulation moves most (> 0.3, checked below)
    share, worst = off(s3, s1)
    assert share < 6e-3 and worst < 2 * 3e-3 * len(big), (share, worst)
    s_ref, _ = _run(make(1), params, [batches[0], batches[3]])  # the first micro-batches only (a fresh step)
    assert off(s3, s_ref)[0] > 0.3
    with pytest.raises(ValueError, match="does not split into micro_batches=3"):
        make(3)(s3, batches[0])
    with pytest.raises(ValueError, match="micro_batches must be"):
        make(0)


def _poisoned_second_step(setup, nonfinite):
    """One clean step of the host/device plan with ``nonfinite``, then its state with a device
    chunk's compute params set to NaN: ``(step, plan, spec, state, master before, that chunk, bad state)``."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    plan = _host_device_schedule(setup, spec)
    step = _step(stages, layout, plan, host_optimizer=spec, compute_dtype=jnp.float32, nonfinite=nonfinite)
    state, m = step(step.init(params), batches[0])
    step.wait(state)
    assert not bool(m["skipped"])
    before = [np.array(a, copy=True) for a in state.master]
    dev = next(c for c, u in enumerate(plan.update_locations) if u == "device")
    bad = list(state.params)
    bad[dev] = jnp.full_like(bad[dev], jnp.nan)
    return step, plan, spec, state, before, dev, cj.TrainState(tuple(bad), state.master, state.opt_state)


def _continues_as_if_never_seen(setup, plan, spec, step, state2):
    """The step after the refused one (batch 2) has the loss of a run that never saw it (batches 0, 2)."""
    cfg, params, batches, stages, layout, traces = setup
    ref = _step(stages, layout, plan, host_optimizer=spec, compute_dtype=jnp.float32)
    _, l_ref = _run(ref, params, [batches[0], batches[2]])
    state3, m3 = step(state2, batches[2])
    assert float(m3["loss"]) == pytest.approx(l_ref[1], rel=1e-6)
    return state3


def test_nonfinite_skip_changes_no_state(setup):
    """nonfinite="skip": a step whose gradients hold NaN changes no master params or optimizer
    state (host, device and the step count) and says so; the next step is the one an
    uninterrupted run would take."""
    step, plan, spec, state, before, dev, bad = _poisoned_second_step(setup, "skip")
    batches, stages, layout = setup[2], setup[3], setup[4]
    state2, m = step(bad, batches[1])
    step.wait(state2)
    assert bool(m["skipped"]) and not np.isfinite(float(m["grad_norm"]))
    for a, b in zip(state2.master, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    # the skipped step left the compute params of device chunks as the cast master params again
    np.testing.assert_array_equal(np.asarray(state2.params[dev]), before[dev])
    # continuing equals a run that never saw the bad step
    _continues_as_if_never_seen(setup, plan, spec, step, state2)
    with pytest.raises(ValueError, match="nonfinite="):
        cj.make_chunked_step(stages, layout, plan, host_optimizer=spec, nonfinite="raise")


def test_nonfinite_error_names_the_step_and_updates_nothing(setup):
    """nonfinite="error" (the main job's default policy, refused by the API before session 19): a
    step with NaN gradients raises one line naming the step and what was non-finite; no master
    params, optimizer state (host, device, step count) or compute params changed, and continuing
    from the exception's state equals a run that never saw the bad step. A non-finite loss with
    finite gradients is left out too (:func:`chunkjax.nonfinite.guard` folds it into the norm)."""
    from chunkjax import nonfinite
    step, plan, spec, state, before, dev, bad = _poisoned_second_step(setup, "error")
    batches, stages, layout = setup[2], setup[3], setup[4]
    opt_before = [np.array(x, copy=True) for x in jax.tree.leaves(state.opt_state)]
    with pytest.raises(cj.NonFiniteError) as e:
        step(bad, batches[1])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step 2: the loss and gradient norm are not finite"), msg
    assert "nothing was updated" in msg and "nonfinite='skip'" in msg, msg
    assert e.value.step == 2 and e.value.which == "loss and gradient norm" and bool(e.value.metrics["skipped"])
    state2 = e.value.state
    step.wait(state2)
    for a, b in zip(state2.master, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.tree.leaves(state2.opt_state), opt_before):
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(np.asarray(state2.params[dev]), before[dev])
    state3 = _continues_as_if_never_seen(setup, plan, spec, step, state2)
    # a non-finite loss beside finite gradients: every updater's skip sees a NaN total; the
    # reported norm stays the gradient's, and the error names the loss alone
    sq = jnp.asarray([1.0, 4.0], jnp.float32)
    poisoned, norm, shown = nonfinite.guard("error", sq, jnp.float32(jnp.inf))
    assert not np.isfinite(float(jnp.sum(poisoned))) and not np.isfinite(float(norm))
    assert float(shown) == pytest.approx(5 ** 0.5)
    assert nonfinite.guard("skip", sq, jnp.float32(jnp.inf))[1] == shown
    with pytest.raises(cj.NonFiniteError, match=r"^step 3: the loss is not finite \(loss inf, gradient norm 2"):
        nonfinite.raise_if_nonfinite(step, state3, {"loss": jnp.float32(jnp.inf), "grad_norm": shown})
    with pytest.raises(ValueError, match="nonfinite='raise': use one of 'ignore', 'skip', 'error'"):
        cj.make_chunked_step(stages, layout, plan, host_optimizer=spec, nonfinite="raise")


def test_fp16_dynamic_loss_scaling(setup):
    """float16 compute with loss scaling: an overflowed step (scale too large) changes no state
    and halves the scale; scaled steps train like the float32 reference (to float16 rounding),
    on host-, device- and streamed-updated chunks."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
    plan = _host_device_schedule(setup, spec)
    step = _step(stages, layout, plan, host_optimizer=spec, compute_dtype=jnp.float16, loss_scaling=True)
    ls = cj.DynamicLossScale(scale=2.0 ** 40, growth_interval=2)
    state = step.init(params)
    before = [np.array(a, copy=True) for a in state.master]
    host_opt = [np.array(x, copy=True) for x in jax.tree.leaves(state.opt_state[plan.update_locations.index("host")])]
    state, m = step(state, batches[0], loss_scale=ls.scale)  # 2**40 overflows float16 gradients
    step.wait(state)
    assert bool(m["skipped"])
    ls = ls.adjust(not bool(m["skipped"]))
    assert ls.scale == 2.0 ** 39 and ls.counter == 0
    for a, b in zip(state.master, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.tree.leaves(state.opt_state[plan.update_locations.index("host")]), host_opt):
        np.testing.assert_array_equal(np.asarray(a), b)
    # a sane scale trains; losses follow the float32 reference to float16 rounding
    ls = cj.DynamicLossScale(scale=2.0 ** 10, growth_interval=2)
    losses = []
    for b in batches[:3]:
        state, m = step(state, b, loss_scale=ls.scale)
        assert not bool(m["skipped"])
        ls = ls.adjust(True)
        losses.append(float(m["loss"]))
    step.wait(state)
    assert ls.scale == 2.0 ** 11 and ls.counter == 1  # grew once after 2 finite steps
    _, ref, _ = _reference(cfg, params, batches[:3], spec, jnp.float32)
    np.testing.assert_allclose(losses, ref, rtol=3e-3)
    with pytest.raises(ValueError, match="loss_scale exactly"):
        step(state, batches[0])
    with pytest.raises(ValueError, match="factor must be > 1"):
        cj.DynamicLossScale(factor=1.0)
    # SGD is not scale-invariant as Adam is: a missing unscale would take 1024x steps
    from chunkjax.host_update import SGDMomentum
    sgd = SGDMomentum(0.5, momentum=0.9)
    # the same host/device schedule (AdamW's plan: where each chunk updates does not depend on the
    # optimizer's state bytes at this roomy budget), so the float16 programs above are reused
    assert _host_device_schedule(setup, sgd).update_locations == plan.update_locations
    step = _step(stages, layout, plan, host_optimizer=sgd, compute_dtype=jnp.float16, loss_scaling=True)
    state, losses, norms = step.init(params), [], []
    for b in batches[:3]:
        state, m = step(state, b, loss_scale=2.0 ** 10)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    step.wait(state)
    _, ref, ref_norms = _reference(cfg, params, batches[:3], sgd, jnp.float32)
    np.testing.assert_allclose(losses, ref, rtol=3e-3)
    # the float32 reference's first gradient is the gradient at the initial params on batches[0]
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-2)  # reported unscaled


# ---- one planner: each policy's prediction against independent arithmetic ---------------------

def _micro_plan_inputs(setup):
    cfg, params, batches, stages, layout, traces = setup
    cb = _cb(layout, optax.adamw(1e-3))
    return layout, traces, cb, memory_tide(traces, layout.chunk_size), cfg.flops_per_token(T) * B * T


def test_fixed_policy_predicts_the_fixed_rule(setup):
    """policy="fixed" at its smallest budget (every chunk in pinned host memory, updates
    streamed): the fetch count of the fixed rule (a chunk read by the previous stage is held, the
    backward starting afresh), the bytes moved, the host bytes and the stage-window peak (every
    saved input + the prefetch window's buffers + open float32 accumulators + the stage's
    temporaries, or the streamed pipeline) are what the fixed rule's accounting gives."""
    layout, traces, cb, tide, flops = _micro_plan_inputs(setup)
    n, cs = layout.n_chunks, layout.chunk_size
    with pytest.raises(cj.PlanError, match="use device_budget >=") as e:
        plan_schedule(layout, traces, cb, 1000, policy="fixed")
    s = plan_schedule(layout, traces, cb, e.value.min_budget_bytes, policy="fixed", flops_per_step=flops)
    assert s.counts() == {"params_pinned_host/update_streamed": n} and s.segments == (0,)
    p = s.predicted
    fwd = sum(len(set(t.chunks) - set(traces[s_ - 1].chunks if s_ else ())) for s_, t in enumerate(traces))
    order = list(range(len(traces) - 2, -1, -1))
    bwd = sum(len(set(traces[s_].backward_chunks) - set(traces[order[i - 1]].backward_chunks if i else ()))
              for i, s_ in enumerate(order))
    assert p.n_fetches == fwd + bwd and p.fetch_bytes_per_step == p.n_fetches * cb.params
    assert p.h2d_bytes_per_step == p.n_fetches * cb.params + n * (cb.grad + cb.master + cb.opt)
    assert p.d2h_bytes_per_step == n * cb.grad + n * (cb.master + cb.opt + cb.params)
    assert p.host_model_bytes == n * (cb.params + cb.master + cb.opt + cb.grad) and p.device_model_bytes == 0
    saved = sum(t.input_bytes for t in traces[1:])
    readers = {c: [i for i, t in enumerate(traces) if c in t.chunks] for c in range(n)}
    stage_peak = [saved + len(set(traces[i].chunks) | set(traces[i + 1].chunks if i + 1 < len(traces) else ()))
                  * cb.params + 4 * cs * sum(min(r) <= i <= max(r) for r in readers.values() if r) + t.temp_bytes
                  for i, t in enumerate(traces)]
    update = 2 * (cb.grad + cb.master + cb.opt + cb.params) + 2 * 4 * cs  # the streamed pipeline: two chunks, one update's temporaries
    assert p.peak_device_bytes == max(max(stage_peak), update) == e.value.min_budget_bytes
    # the schedule's fetch lists are the fixed rule's, moment by moment
    f, b = fetch_events(traces, s.placement, 1)
    assert [list(x) for x in s.fetch] == f + [b[i] for i in order]
    # with room, the compute params go to the device first, then the state
    roomy = plan_schedule(layout, traces, cb, 10**12, policy="fixed").predicted
    assert roomy.n_fetches == 0 and roomy.device_model_bytes == n * (cb.params + cb.master + cb.opt)


def test_static_policies_predict_their_fetch_rules(setup):
    """all_host: every read is a fetch released after its moment (prefetch 1: this moment's and
    the next one's buffers); zero_offload: every chunk read is fetched once at the step's start
    and held to its last read, the whole host update exposed. Bytes by arithmetic on the tide."""
    layout, traces, cb, tide, flops = _micro_plan_inputs(setup)
    n, cs, ms = layout.n_chunks, layout.chunk_size, tide.moments
    rates = Rates()
    ah = plan_schedule(layout, traces, cb, 10**12, policy="all_host", flops_per_step=flops).predicted
    reads = [set(m.chunks) for m in ms]
    per = [m.non_model_bytes + (len(reads[t]) + (len(reads[t + 1]) if t + 1 < len(ms) else 0)) * cb.params
           for t, m in enumerate(ms)]
    assert list(ah.device_bytes_per_moment) == per and ah.peak_device_bytes == max(per)
    assert ah.n_fetches == sum(map(len, reads)) and ah.h2d_bytes_per_step == ah.n_fetches * cb.params
    assert ah.d2h_bytes_per_step == n * cb.grad and ah.host_model_bytes == n * (cb.params + cb.master + cb.opt + cb.grad)
    assert ah.time.host_update_s == pytest.approx(n * cs * rates.host_update_s_per_param)
    zo = plan_schedule(layout, traces, cb, 10**12, policy="zero_offload", flops_per_step=flops).predicted
    read = set().union(*reads)
    last = {c: max(t for t in range(len(ms)) if c in reads[t]) for c in read}
    assert list(zo.device_bytes_per_moment) == [m.non_model_bytes + sum(last[c] >= t for c in read) * cb.params
                                                for t, m in enumerate(ms)]
    assert zo.h2d_bytes_per_step == len(read) * cb.params and zo.d2h_bytes_per_step == n * cb.grad
    assert zo.time.forward_s == pytest.approx(max(flops / 3 / rates.matmul_flops_per_s,
                                                  len(read) * cb.params / rates.h2d_bytes_per_s))
    assert zo.time.host_update_exposed_s == pytest.approx(n * cs * rates.host_update_s_per_param)
    # must_fit (the default) refuses a baseline above the budget, naming what it needs
    with pytest.raises(cj.PlanError, match="all_host schedule needs") as e:
        plan_schedule(layout, traces, cb, ah.peak_device_bytes - 1, policy="all_host")
    assert e.value.min_budget_bytes == ah.peak_device_bytes


def test_tide_policy_prediction_adds_up(setup):
    """policy="tide" (the default): model data of resident chunks, host bytes of offloaded ones,
    bytes moved by fetches and gradient offloads, and a peak that bounds every moment and the
    update phase (resident gradients plus two float32 temporaries)."""
    layout, traces, cb, tide, flops = _micro_plan_inputs(setup)
    n, cs = layout.n_chunks, layout.chunk_size
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0, 1])
    s = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, policy="tide", flops_per_step=flops,
                      split=False)  # every offloaded chunk on the host (the split: tests/test_overlap.py)
    k = sum(u == "device" for u in s.update_locations)
    p = s.predicted
    assert p.device_model_bytes == k * (cb.params + cb.master + cb.opt)
    assert p.host_model_bytes == (n - k) * (cb.params + cb.master + cb.opt + cb.grad)
    assert p.h2d_bytes_per_step == p.n_fetches * cb.params and p.d2h_bytes_per_step == (n - k) * cb.grad
    assert p.peak_device_bytes == max(max(p.device_bytes_per_moment),
                                      p.device_model_bytes + (k * cb.grad + 2 * 4 * cs if k else 0))
    assert p.peak_device_bytes <= roomy.predicted.peak_device_bytes


def test_optimizer_only_policy_is_the_drop_in_rule(setup):
    """policy="optimizer_only": params on the device, the state of the first chunks on the device
    while it fits next to one chunk's update working set (float32 gradient and two temporaries,
    master and state, new params), the rest streamed; no traces needed."""
    layout, traces, cb, tide, flops = _micro_plan_inputs(setup)
    n, cs = layout.n_chunks, layout.chunk_size
    state = cb.master + cb.opt
    working = 3 * 4 * cs + state + cb.params
    for n_dev in (0, 1, n - 1, n):
        budget = working + n_dev * state + state // 2
        s = plan_schedule(layout, (), cb, budget, policy="optimizer_only")
        assert s.param_kinds == (cj.DEVICE,) * n and s.moments == () and s.segments == (0,)
        assert s.update_locations == ("device",) * n_dev + ("streamed",) * (n - n_dev)
        p = s.predicted
        assert p.peak_device_bytes == n_dev * state + working <= budget
        assert p.host_model_bytes == p.h2d_bytes_per_step == p.d2h_bytes_per_step == (n - n_dev) * state
    with pytest.raises(cj.PlanError, match=r"below the \d+ bytes one chunk's update needs") as e:
        plan_schedule(layout, (), cb, working - 1, policy="optimizer_only")
    assert e.value.min_budget_bytes == working


@pytest.mark.parametrize("kw, words", [
    (dict(policy="belady"), "unknown policy 'belady'"),
    (dict(zero_stage=3), "needs ranks > 1"),
    (dict(ranks=2, zero_stage=4), "zero_stage must be 1, 2 or 3"),
    (dict(ranks=0), "ranks must be an int >= 1"),
    (dict(policy="fixed", resident=[0]), "takes none"),
    (dict(must_fit=False), "static baselines"),
    (dict(prefetch=0), "prefetch must be >= 1"),
    (dict(policy="optimizer_only", ranks=2), "plans one device"),
])
def test_plan_schedule_refuses_bad_options(setup, kw, words):
    layout, traces, cb, tide, flops = _micro_plan_inputs(setup)
    with pytest.raises(ValueError, match=words):
        plan_schedule(layout, traces, cb, 10**12, **kw)
    with pytest.raises(ValueError, match="needs the stage traces"):
        plan_schedule(layout, (), cb, 10**12)


def test_planning_modules_import_no_planner():
    """Data flows one way: the trace, the tide, memory kinds, the schedule data and the accounting
    import nothing from chunkjax.plan (the planner imports them)."""
    import ast
    import pathlib
    root = pathlib.Path(cj.__file__).parent
    for name in ("trace", "tide", "memory", "schedule", "predict", "errors", "eviction", "cost", "stages"):
        tree = ast.parse((root / f"{name}.py").read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "chunkjax.plan" not in mods, name
