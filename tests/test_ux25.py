"""What a fresh user found in session 24's trial of ``chunkjax.offload`` / ``chunkjax.plan_offload``
(helper ``ux25``): figures printed without saying which is which, a budget keyword lost from the
report, a hint that cannot help, and a plan's summary that disagreed with the step's.

Each test checks the figure against its reference: the model's own parameter count, the fit path's
budget functions (``chunkjax.fit.min_budget`` / ``auto_budget``), the built step's report."""
import math

import jax
import jax.numpy as jnp
import pytest

import chunkjax as cj
from chunkjax.errors import format_bytes, format_step_seconds
from chunkjax.host_update import AdamW


def _tiny_nnx():
    """The fresh user's regression MLP (tests/test_fresh22.py's: an input layer, two residual blocks
    in an ``nnx.List`` and an output layer) as ``(make, loss_fn, one 8-row batch)``."""
    from flax import nnx

    from tests.test_fresh22 import _tiny_nnx as fresh22_model
    Net, loss_fn, batches = fresh22_model()
    return (lambda: Net(nnx.Rngs(0))), loss_fn, batches[0]


def _n_params(model) -> int:
    from flax import nnx
    return sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_model_data_is_given_with_and_without_the_chunks_padding():
    """The step's summary said "model data on device 0B of 4.023KiB" while the planner CLI said
    "model data 3.0 KiB" for one model, neither saying which is which. Right: both figures, labelled:
    the parameters' own (elements x 16 B: float32 compute params, master params, Adam's two
    moments) and the chunks' (whole chunks, their zero padding included)."""
    from chunkjax.fit_report import model_bytes_unpadded
    make, loss_fn, batch = _tiny_nnx()
    model = make()
    n = _n_params(model)
    step = cj.offload(model, AdamW(1e-3), loss_fn, batch, device_budget="min")
    lay, cb = step.problem.layout, step.problem.cb
    fixed = cb.params + cb.state - 16 * lay.chunk_size  # a chunk's optimizer scalars (Adam's step count)
    assert 0 < fixed <= 64 and lay.n_chunks * lay.chunk_size > n  # 2 chunks of 128 elements, partly padding
    padded = lay.n_chunks * (16 * lay.chunk_size + fixed)
    bare = model_bytes_unpadded(cb, lay)
    assert step.problem.model_chunk_bytes == padded and 16 * n <= bare <= 16 * n + lay.n_chunks * fixed < padded
    dev = step.schedule.predicted.device_model_bytes
    assert (f"model data on device {format_bytes(dev)} of {format_bytes(padded)} in chunks, with padding "
            f"({format_bytes(bare)} without)") in step.summary(), step.summary()
    p = cj.plan_offload(make(), AdamW(1e-3), loss_fn, batch)
    assert f"model data {format_bytes(bare)} ({format_bytes(padded)} in chunks, with padding)" in p.summary()


def test_a_budget_keyword_is_reported_as_requested_and_its_bytes_as_resolved():
    """``offload(device_budget="min")``'s report had ``device_budget_requested`` = the bytes "min"
    resolved to (equal to ``device_budget_bytes``): the keyword asked for was lost. Right: the
    request as given, the bytes it resolved to beside it (and labelled so in the summary)."""
    from chunkjax.fit import auto_budget, min_budget
    make, loss_fn, batch = _tiny_nnx()
    planned = cj.plan_offload(make(), AdamW(1e-3), loss_fn, batch, device_budget="min")
    least = min_budget(planned.problem)
    assert (planned.requested, planned.budget_bytes) == ("min", least)
    assert f"of budget {format_bytes(least)} (resolved from 'min')" in planned.summary()
    for asked, want in (("min", least), ("auto", auto_budget(planned.problem)), (least + 4096, least + 4096)):
        step = cj.offload(make(), AdamW(1e-3), loss_fn, batch, device_budget=asked)
        r = step.report.to_dict()
        assert (r["device_budget_requested"], r["device_budget_bytes"]) == (asked, want), (asked, r)
        label = f"of budget {format_bytes(want)}" + (f" (resolved from {asked!r})" if isinstance(asked, str) else ";")
        assert label in step.summary(), step.summary()


def test_a_budget_below_the_chunk_buffers_is_not_told_to_lower_the_batch():
    """A 1-byte device budget's error said "use device_budget >= 4.532KiB or lower the batch": no
    batch fits 1 byte, since the chunk buffers alone exceed it. Right: the budget that works (it
    plans), without the batch; a budget that the chunk buffers fit while activations do not (a
    large batch) keeps the batch hint."""
    from chunkjax import fit
    from chunkjax.tide import memory_tide
    make, loss_fn, batch = _tiny_nnx()
    with pytest.raises(cj.PlanError) as e:
        cj.offload(make(), AdamW(1e-3), loss_fn, batch, device_budget=1)
    msg = str(e.value)
    need = format_bytes(e.value.min_budget_bytes, up=True)
    assert "\n" not in msg and "batch" not in msg.replace("at any batch size", ""), msg
    assert msg.endswith(f"use device_budget >= {need}") and "chunk buffers alone" in msg, msg
    assert cj.plan_offload(make(), AdamW(1e-3), loss_fn, batch, device_budget=need).schedule is not None
    big = jax.tree.map(lambda a: jax.ShapeDtypeStruct((8192,) + a.shape[1:], a.dtype), batch)
    p = cj.plan_offload(make(), AdamW(1e-3), loss_fn, big)
    with pytest.raises(cj.PlanError) as e:
        fit.plan(p.problem, 1)
    act = memory_tide(p.problem.traces, p.problem.layout.chunk_size).peak_non_model_bytes
    model = e.value.min_budget_bytes - act
    assert act > 2 * model + p.problem.cb.params  # the activations dominate at this batch
    with pytest.raises(cj.PlanError) as e:
        fit.plan(p.problem, model + p.problem.cb.params)  # the buffers fit, the activations do not
    assert "or lower the batch" in str(e.value) and "chunk buffers alone" not in str(e.value), str(e.value)


def test_plan_summary_gives_the_bounded_step_the_built_step_reports():
    """``plan_offload(...).summary()`` of a clipped ``"rare"`` plan gave the planner's step (every
    host chunk speculating, for free) while the built step's ``describe`` gives it retimed with its
    speculation bound: two predictions for one plan. Right: the summary's step is the built step's
    (``predicted_time``, equal to ``step.report.predicted_time`` here, where the step's bound holds
    every host chunk), the planner's figure beside it, labelled; unclipped, the planner's alone."""
    make, loss_fn, batch = _tiny_nnx()
    spec = AdamW(1e-3, max_grad_norm=1.0)
    p = cj.plan_offload(make(), spec, loss_fn, batch, device_budget="min", clip_expect="rare")
    step = cj.offload(make(), spec, loss_fn, batch, device_budget="min", clip_expect="rare")
    planned = p.schedule.predicted.time.step_s
    assert p.schedule.to_dict() == step.schedule.to_dict()
    assert p.predicted_time.step_s == step.report.predicted_time.step_s > planned
    assert step.report.to_dict()["step_s_planned"] == planned
    n_host = sum(u == "host" for u in p.schedule.update_locations)
    assert n_host == 2 and step.report.speculation_bound["chunks"] >= n_host
    line = p.summary()
    sec = format_step_seconds
    assert (f"predicted step {sec(p.predicted_time.step_s)} with the default speculation bound "
            f"(16.000GiB backup pool: {n_host} of {n_host} host chunks; the planner's {sec(planned)} lets "
            "every host chunk speculate, for free)") in line, line
    plain = cj.plan_offload(make(), AdamW(1e-3), loss_fn, batch, device_budget="min")
    assert plain.predicted_time is plain.schedule.predicted.time and "speculation bound" not in plain.summary()
