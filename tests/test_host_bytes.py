"""Host bytes per parameter at the fp32 minimum (issue 24, item 1; :mod:`chunkjax.host_forms`).

A host-updated chunk in the master-fetch form keeps no compute copy: its float32 master params
live in pinned host memory, the host kernel updates them in place and the step's fetches cast
them on the device. References: plain optax on the device (fp32 compute, tolerances as
tests/test_overlap.py) and, for bf16 compute, the copy-keeping path bit for bit.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import speculate, updaters
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from models import gpt

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 6


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 7, 3, B, T, STEPS)  # 2 blocks: shorter compiles, still 8 host chunks of 9


@pytest.fixture(scope="module")
def plan_setup():
    """For the planning tests (nothing compiled or run): the micro GPT with 3 blocks, abstract
    (``setup``'s tuple with no params or batches), its layout and float32 stage traces. With 3
    blocks the all-host plan holds two of its programs' host gradients at once, not every one."""
    cfg = gpt.get_config("micro", n_layers=3)
    params, stages = gpt.abstract_params(cfg), gpt.gpt_stages(cfg)
    ab = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, ab)
    layout = cj.build_layout(params, None, order, min_chunks=6)
    return cfg, None, None, stages, layout, cj.trace_stages(stages, layout, ab, jnp.float32)


@pytest.fixture
def speculate_always(monkeypatch):
    """Every host chunk's update starts before the norm is known (the GPU's case)."""
    monkeypatch.setattr(speculate.Speculation, "_known", lambda self: self.certain)


def _schedule(setup, spec, dtype=jnp.float32, master_fetch=True):
    """Chunk 0 resident (device update), the rest host-updated, three programs; every host chunk
    master-fetch (or none)."""
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, dtype, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops,
                          resident=[0], segments=(0, len(stages) + 1, len(roomy.moments) - 1))
    host = tuple(c for c, u in enumerate(sched.update_locations) if u == "host")
    assert len(host) >= 3
    return dataclasses.replace(sched, master_fetch=host if master_fetch else ())


_PROGRAMS: dict = {}


def _step(stages, layout, sched, **kw):
    """``make_chunked_step``, its programs (traced, jitted and compiled per batch shape) those of
    this module's earlier step of the same schedule and device-side options: the host optimizer
    does not enter them (as tests/test_overlap.py's ``_step``); built once, not per test."""
    step = cj.make_chunked_step(stages, layout, sched, **kw)
    key = (repr(sched), tuple(sorted((k, repr(v)) for k, v in kw.items() if k != "host_optimizer")))
    step.__dict__["_cache"] = _PROGRAMS.setdefault(key, step._cache)
    return step


_REFERENCES = {}


def _reference(cfg, params, batches, spec, micro_batches=1):
    """Plain optax on the device (fp32), as tests/test_overlap.py: computed once per (spec,
    micro-batches, number of batches) (every caller passes the module's setup params and a prefix
    of its batches; the unclipped run is both a reference and the source of the clip thresholds)."""
    key = (spec, micro_batches, len(batches))
    if key not in _REFERENCES:
        _REFERENCES[key] = micro_batch_reference(cfg, params, batches, spec.optax(), micro_batches, rows=B)
    return _REFERENCES[key]

def _train(step, params, batches, micro_batches=1):
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b if micro_batches > 1 else b[:B])
        losses.append(float(m["loss"]))
    step.wait(state)
    return state, np.asarray(losses)


def _assert_equal_to_optax(step, state, losses, ref):
    ref_p, ref_losses, _ = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def test_master_fetch_state_is_one_float32_buffer(setup):
    """A master-fetch chunk's params are its float32 master params in pinned host memory; the
    numpy master is a view of that buffer, no compute copy exists."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    step = _step(stages, layout, _schedule(setup, spec, jnp.bfloat16), host_optimizer=spec,
                 compute_dtype=jnp.bfloat16)
    state = step.init(params)
    for c in step.master_fetch_chunks:
        p, m = state.params[c], state.master[c]
        assert p.dtype == jnp.float32 and p.sharding.memory_kind == "pinned_host"
        assert isinstance(m, np.ndarray) and m.ctypes.data == p.addressable_data(0).unsafe_buffer_pointer()


@pytest.mark.parametrize("clip", [None, "fires"])
def test_master_fetch_equals_optax(setup, speculate_always, clip):
    """Every host chunk master-fetch, fp32 compute: equals optax, also with clipping that fires
    on some steps (speculated updates redone)."""
    cfg, params, batches, stages, layout, traces = setup
    max_norm = None
    if clip:
        _, _, free = _reference(cfg, params, batches, AdamW(3e-3, weight_decay=0.1))
        max_norm = float(np.sort(free)[-2])
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=max_norm)
    ref = _reference(cfg, params, batches, spec)
    step = _step(stages, layout, _schedule(setup, spec), host_optimizer=spec,
                 compute_dtype=jnp.float32)
    state, losses = _train(step, params, batches)
    _assert_equal_to_optax(step, state, losses, ref)


def test_master_fetch_with_micro_batches_equals_optax(setup, speculate_always):
    """Four micro-batches with clipping, every host chunk master-fetch: equals optax."""
    cfg, params, batches, stages, layout, traces = setup
    _, _, free = _reference(cfg, params, batches, AdamW(3e-3), micro_batches=4)
    spec = AdamW(3e-3, max_grad_norm=float(np.sort(free)[-2]))
    ref = _reference(cfg, params, batches, spec, micro_batches=4)
    step = _step(stages, layout, _schedule(setup, spec), host_optimizer=spec,
                 compute_dtype=jnp.float32, micro_batches=4)
    state, losses = _train(step, params, batches, micro_batches=4)
    _assert_equal_to_optax(step, state, losses, ref)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_master_fetch_bf16_is_bit_identical_to_the_copy(setup, speculate_always, clip):
    """bf16 compute: the device's cast of the fetched float32 master params gives the bits the
    host kernel writes into the copy, so losses and master params are bit-identical."""
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip)
    out = []
    for mf in (False, True):
        step = _step(stages, layout, _schedule(setup, spec, jnp.bfloat16, mf), host_optimizer=spec,
                     compute_dtype=jnp.bfloat16)
        assert bool(step.master_fetch_chunks) == mf
        state, losses = _train(step, params, batches[:4])
        out.append((losses, [np.asarray(x) for x in jax.tree.leaves(step.master_params(state))]))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_array_equal(a, b)


def _all_host(setup, dtype=jnp.bfloat16, host_budget=None, micro_batches=1):
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3)
    cb = cj.chunk_bytes(layout, dtype, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    s = plan_schedule(layout, traces, cb, 10**12, policy="all_host", flops_per_step=cfg.flops_per_token(T) * B * T,
                      host_budget_bytes=host_budget, micro_batches=micro_batches)
    return s, cb, layout


def test_host_budget_chooses_copies_then_master_fetch(plan_setup):
    """Copies while the host budget holds them; below that the step is first re-cut so fewer host
    gradients exist at once, then the chunks fetched least lose their copies (master-fetch: a
    fetch moves the float32 master params, twice the bytes, in the predicted H2D bytes and step
    time); a budget below the all-master-fetch need is refused in one line naming the host
    budget needed."""
    copies, cb, layout = _all_host(plan_setup)
    host = [c for c, u in enumerate(copies.update_locations) if u == "host"]
    assert copies.master_fetch == () and len(host) == layout.n_chunks
    p = copies.predicted
    assert p.host_bytes == len(host) * (cb.params + cb.state) + p.host_working_bytes
    assert p.host_model_bytes == len(host) * (cb.params + cb.state + cb.grad)  # every gradient moved counted
    assert 0 < p.host_working_bytes < len(host) * cb.grad  # two of the programs' gradients at once
    assert _all_host(plan_setup, host_budget=p.host_bytes)[0] == copies
    cut = _all_host(plan_setup, host_budget=p.host_bytes - 1)[0]  # re-cut: the gradients spread over the programs
    c = cut.predicted
    assert cut.master_fetch == () and cut.segments != copies.segments and len(cut.segments) <= 8
    assert c.host_working_bytes < p.host_working_bytes and c.host_bytes == p.host_bytes - (p.host_working_bytes
                                                                                        - c.host_working_bytes)
    assert len(_all_host(plan_setup, host_budget=c.host_bytes - 1)[0].master_fetch) == 1  # one copy fewer is enough
    least = _all_host(plan_setup, host_budget=c.host_bytes - len(host) * cb.params)[0]
    assert least.master_fetch == tuple(host) and least.segments == cut.segments
    q = least.predicted
    assert q.host_bytes == len(host) * cb.state + q.host_working_bytes == c.host_bytes - len(host) * cb.params
    assert q.fetch_bytes_per_step == 2 * c.fetch_bytes_per_step and q.n_fetches == c.n_fetches
    assert q.h2d_bytes_per_step - c.h2d_bytes_per_step == c.fetch_bytes_per_step
    assert q.time.step_s > c.time.step_s and q.peak_device_bytes > c.peak_device_bytes
    # the per-parameter figures: 12 of AdamW state + the working set, no compute copy
    per = layout.chunk_size * len(host)
    state_per_param = cb.state / layout.chunk_size  # float32 master + m + v (+ the optax count)
    assert 12 <= state_per_param < 12.01
    assert q.host_resident_bytes_per_param == pytest.approx(state_per_param + q.host_working_bytes / per)
    assert q.host_resident_bytes_per_param <= 12.5 + q.host_working_bytes / per
    assert p.host_resident_bytes_per_param == pytest.approx(state_per_param + 2 + p.host_working_bytes / per)
    # in between: the copies that fit go to the chunks fetched most
    k = 2
    mid = _all_host(plan_setup, host_budget=q.host_bytes + k * cb.params)[0]
    kept = [c for c in host if c not in mid.master_fetch]
    n_fetch = {c: sum(c in f for f in copies.fetch) for c in host}
    assert len(kept) == k and min(n_fetch[c] for c in kept) >= max(n_fetch[c] for c in mid.master_fetch)
    with pytest.raises(cj.PlanError) as e:
        _all_host(plan_setup, host_budget=q.host_bytes - 1)
    msg = str(e.value)
    assert "\n" not in msg and f"below the {q.host_bytes} bytes" in msg and "host_budget >=" in msg


def test_balanced_segments_spread_the_host_gradients():
    """The re-cut: forward and head one program, the backward cut at the quantiles of the host
    gradients' moments and once after the last of them."""
    from chunkjax.host_forms import host_balanced_segments
    from chunkjax.predict import grad_window_bytes
    done = [10, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 12 host gradients in moments 10..20
    segs = host_balanced_segments(40, 10, done, max_programs=8)
    assert segs[:2] == (0, 10) and segs[-1] == 21 and len(segs) == 8 and list(segs) == sorted(set(segs))
    assert grad_window_bytes(done, segs, 1) == 4  # two of six programs of two gradients each
    assert grad_window_bytes(done, (0, 10, 30), 1) == 12
    assert host_balanced_segments(40, 10, [5], max_programs=8) is None  # the head's only: nothing to cut


def test_micro_batches_join_the_working_set(plan_setup):
    """With micro-batches, each host chunk's float32 sum joins the host working set (its mean is
    written over it: chunkjax.accumulate.mean_in_place; tests/test_accumulate_memory.py)."""
    one, cb, layout = _all_host(plan_setup)
    four = _all_host(plan_setup, micro_batches=4)[0]
    n = layout.n_chunks
    assert four.predicted.host_working_bytes == one.predicted.host_working_bytes + n * cb.master


def _host_bytes_of_state(state, chunks) -> int:
    """Bytes of the buffers the state holds for ``chunks`` (params, master, optimizer state;
    each buffer once: a master-fetch chunk's master is a view of its params)."""
    seen, total = set(), 0
    for c in chunks:
        for a in [state.params[c], state.master[c]] + [x for _, x in speculate._arrays(state.opt_state[c])]:
            ptr = a.unsafe_buffer_pointer() if isinstance(a, jax.Array) else a.ctypes.data
            if ptr not in seen:
                seen.add(ptr)
                total += a.nbytes
    return total


def test_master_fetch_state_bytes_and_gradient_working_set(setup, monkeypatch):
    """Counted on the allocated state: 12 bytes per parameter of a master-fetch host chunk (float32
    master params, pinned, plus Adam m and v), against 14 with the copy; the host gradients alive
    at any hand-over stay within the planned working set."""
    cfg, params, batches, stages, layout, traces = setup
    s, cb, _ = _all_host(setup)
    cut = _all_host(setup, host_budget=s.predicted.host_bytes - 1)[0]  # re-cut, still copies
    least = _all_host(setup, host_budget=cut.predicted.host_bytes - layout.n_chunks * cb.params)[0]
    assert len(least.master_fetch) == layout.n_chunks
    spec = AdamW(3e-3)
    measured = {}
    hand_over = updaters.HostWork.hand_over
    for name, sched in (("copy", s), ("master_fetch", least)):
        step = _step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.bfloat16)
        state = step.init(params)
        host = [c for c, u in enumerate(sched.update_locations) if u == "host"]
        measured[name] = _host_bytes_of_state(state, host) / (len(host) * layout.chunk_size)
        mine, live = {p.unsafe_buffer_pointer() for p in state.params}, []  # (live_arrays makes new wrappers)

        def spy(work, fn, *args):
            hand_over(work, fn, *args)
            live.append(sum(a.nbytes for a in jax.live_arrays() if a.shape == (layout.chunk_size,)
                            and a.dtype == jnp.bfloat16 and a.sharding.memory_kind == "pinned_host"
                            and a.unsafe_buffer_pointer() not in mine))
        monkeypatch.setattr(updaters.HostWork, "hand_over", spy)
        for b in batches[:2]:
            state, _ = step(state, b[:B])
            step.wait(state)
        monkeypatch.undo()
        assert len(live) >= 4 and max(live) <= sched.predicted.host_working_bytes, (name, live)
    assert measured["master_fetch"] == 12.0 and measured["copy"] == 14.0
    assert measured["master_fetch"] <= 12.5 + least.predicted.host_working_bytes / (layout.n_chunks * layout.chunk_size)


def test_checkpoint_of_master_fetch_chunks_resumes_bit_for_bit(setup, tmp_path):
    """bf16 compute, half the host chunks master-fetch: a checkpoint saves their params as the
    cast of the master params; restored into a fresh step (or into the copy-keeping schedule) the
    run continues with the same losses and master params, bit for bit."""
    from chunkjax import checkpoint as ck
    cfg, params, batches, stages, layout, traces = setup
    spec = AdamW(3e-3, weight_decay=0.1)
    sched = _schedule(setup, spec, jnp.bfloat16)
    half = dataclasses.replace(sched, master_fetch=sched.master_fetch[::2])
    make = lambda s: _step(stages, layout, s, host_optimizer=spec,  # noqa: E731
                           compute_dtype=jnp.bfloat16)
    step = make(half)
    state, _ = _train(step, params, batches[:2])
    ck.save_checkpoint(tmp_path, 2, step, state, {"data_position": 2})
    state, want = _train_from(step, state, batches[2:4])
    for other in (half, dataclasses.replace(sched, master_fetch=())):
        fresh = make(other)
        restored, _ = ck.restore_checkpoint(tmp_path, fresh)
        for c in fresh.master_fetch_chunks:
            assert restored.params[c].dtype == jnp.float32
            assert restored.master[c].ctypes.data == restored.params[c].addressable_data(0).unsafe_buffer_pointer()
        restored, got = _train_from(fresh, restored, batches[2:4])
        np.testing.assert_array_equal(got, want)
        for a, b in zip(jax.tree.leaves(fresh.master_params(restored)), jax.tree.leaves(step.master_params(state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _train_from(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b[:B])
        losses.append(float(m["loss"]))
    step.wait(state)
    return state, np.asarray(losses)
