"""The speculation policy across a checkpoint (:mod:`chunkjax.speculate`): ``"after_common"``
speculates on a step only when clipping did not fire on the step before. The checkpoint carries
that outcome (meta.json ``"speculation"``), so the first step after a restore decides as the
uninterrupted run's did: with rollback by inversion (float32-exact to about an ulp, not bit-exact)
a resumed run used to wait where the uninterrupted one speculated, and the two runs' states
differed in their last bits. A checkpoint without the entry (an older one) still restores; its
first step waits, as a process's first step does."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax import speculate
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule

from _micro_setup import micro_gpt_setup
from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 6


@pytest.fixture(scope="module")
def setup():
    return micro_gpt_setup(2, 7, 5, B, T, STEPS)


@pytest.fixture
def speculate_always(monkeypatch):
    """Every host chunk's update starts before the norm is known (the GPU's case)."""
    monkeypatch.setattr(speculate.Speculation, "_known", lambda self: self.certain)


#: A threshold the norm passes on steps 1, 2 and 5 of this set-up (margins of 3 % and more)
CLIP = 1.9


def _clip_and_resume_point(setup):
    """:data:`CLIP` and a step ``k`` (1-based, ``k >= 2``) such that clipping does not fire on step
    ``k`` and fires on step ``k + 1`` (the uninterrupted run speculates on ``k + 1`` and rolls back
    by inversion), from plain optax on the same batches."""
    cfg, params, batches, *_ = setup
    norms = micro_batch_reference(cfg, params, [b[:B] for b in batches],
                                  AdamW(3e-3, weight_decay=0.1, max_grad_norm=CLIP).optax(), 1, rows=B)[2]
    fired = norms >= CLIP
    k = next((k for k in range(2, STEPS) if not fired[k - 1] and fired[k]), None)
    assert k is not None and np.all(np.abs(norms / CLIP - 1) > 0.02), norms
    return CLIP, k, fired


@pytest.fixture(scope="module")
def engine(setup):
    """``(clip, k, fired, step)``: :func:`_clip_and_resume_point` and the step with that threshold,
    built and compiled once for both tests (each starts from ``step.init``; a step keeps no state)."""
    clip, k, fired = _clip_and_resume_point(setup)
    return clip, k, fired, _step(setup, AdamW(3e-3, weight_decay=0.1, max_grad_norm=clip))


def _step(setup, spec):
    cfg, params, batches, stages, layout, traces = setup
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    assert "host" in sched.update_locations
    return cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                                rollback="invert")


def _run(step, state, batches):
    """(state, losses, per step whether it speculated)."""
    losses, spec = [], []
    for b in batches:
        state, m = step(state, b[:B])
        losses.append(float(m["loss"]))
        step.wait(state)
        spec.append(state.pending.speculation.speculating)
    return state, losses, spec


def _bits(step, state):
    """Every chunk's portable arrays (params, master, moments) and step count."""
    out = []
    for c in range(step.layout.n_chunks):
        arrays, meta = step.checkpoint_chunk(state, c, copy=True)
        out.append(({k: np.asarray(v).copy() for k, v in arrays.items()}, meta["count"]))
    return out


def _assert_same_bits(a, b):
    for (xa, ca), (xb, cb) in zip(a, b):
        assert ca == cb and sorted(xa) == sorted(xb)
        for k in xa:
            np.testing.assert_array_equal(xa[k], xb[k], err_msg=k)


def test_resume_speculates_as_the_uninterrupted_run(setup, engine, speculate_always, tmp_path):
    cfg, params, batches, *_ = setup
    clip, k, fired, step = engine
    full, losses, spec = _run(step, step.init(params), batches)
    assert spec[k] and not spec[0], (spec, list(fired))  # the uninterrupted run speculates on step k + 1
    want = _bits(step, full)

    part, l1, s1 = _run(step, step.init(params), batches[:k])
    ck.save_checkpoint(tmp_path, k, step, part)
    meta = ck.read_meta(tmp_path, k)
    assert meta["speculation"] == {"fired": bool(fired[k - 1])} == {"fired": False}
    del part
    state, _ = ck.restore_checkpoint(tmp_path, step)
    assert state.speculation == speculate.Resumed(False)
    ck.save_checkpoint(tmp_path / "again", k, step, state)  # a restored state saves what it carries
    assert ck.read_meta(tmp_path / "again", k)["speculation"] == {"fired": False}
    state, l2, s2 = _run(step, state, batches[k:])
    assert s1 + s2 == spec and l1 + l2 == losses  # the same decisions, the same losses bit for bit
    _assert_same_bits(_bits(step, state), want)


def test_checkpoint_without_the_policy_input_still_restores(setup, engine, speculate_always, tmp_path, monkeypatch):
    """An older checkpoint (no "speculation" entry in meta.json) restores and trains; its first
    step waits for the norm, as a process's first step does."""
    cfg, params, batches, *_ = setup
    clip, k, _, step = engine
    part, _, _ = _run(step, step.init(params), batches[:k])
    with monkeypatch.context() as m:  # saved as chunkjax did before the entry existed
        m.setattr(type(step), "checkpoint_state_meta", lambda self, state: {})
        ck.save_checkpoint(tmp_path, k, step, part)
    assert "speculation" not in ck.read_meta(tmp_path, k)
    state, _ = ck.restore_checkpoint(tmp_path, step)
    assert state.speculation is None
    state, losses, spec = _run(step, state, batches[k:k + 2])
    assert spec[0] is False and all(np.isfinite(losses))
