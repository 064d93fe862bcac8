"""What planning computes once (:mod:`chunkjax.plan_memo`, :func:`chunkjax.trace._temp_bytes`)
gives what computing it again gives: the memoised prediction equals :func:`chunkjax.predict.predict`,
a plan made twice is the same schedule, and a model traced twice has the same stage traces, the
second time with nothing compiled. A four-stage model of small matrices (shapes only: nothing is
allocated but the abstract traces)."""
import jax
import jax.monitoring
import jax.numpy as jnp
import optax
import pytest

import chunkjax as cj
from chunkjax import predict as pr
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.plan_memo import predictor
from chunkjax.stages import Stage
from chunkjax.tide import memory_tide

D, B = 32, 4


def _stages():
    block = lambda p, x, b: x + jnp.tanh(x @ p[next(iter(p))])  # noqa: E731
    return (Stage("in", ("w_in",), lambda p, x, b: jnp.tanh(b @ p["w_in"])),
            Stage("h_0", ("h_0",), block), Stage("h_1", ("h_1",), block),
            Stage("out", ("w_out",), lambda p, x, b: jnp.mean((x @ p["w_out"]) ** 2)))


@pytest.fixture(scope="module")
def problem():
    params = {k: jax.ShapeDtypeStruct((D, D), jnp.float32) for k in ("w_in", "h_0", "h_1", "w_out")}
    stages = _stages()
    batch = jax.ShapeDtypeStruct((B, D), jnp.float32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batch)
    layout = cj.build_layout(params, D * D, order)
    traces = cj.trace_stages(stages, layout, batch, jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(optax.adamw(1e-3), layout.chunk_size))
    return stages, layout, batch, traces, cb


def test_traced_again_compiles_nothing_and_agrees(problem):
    stages, layout, batch, traces, _ = problem
    compiles = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        again = cj.trace_stages(_stages(), layout, batch, jnp.float32)  # new stage functions, same programs
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert again == traces
    assert compiles == []


@pytest.mark.parametrize("kw", [{}, {"streamed_early": True}, {"micro_batches": 2}], ids=["late", "early", "mb2"])
def test_plan_made_twice_is_the_same_schedule(problem, kw):
    _, layout, _, traces, cb = problem
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1e9, **kw).predicted.peak_device_bytes
    for budget in (roomy, roomy * 3 // 4, roomy // 2):
        try:
            first = plan_schedule(layout, traces, cb, budget, flops_per_step=1e9, **kw)
        except cj.PlanError:
            continue
        assert plan_schedule(layout, traces, cb, budget, flops_per_step=1e9, **kw) == first


def test_memoised_prediction_is_predict(problem):
    _, layout, _, traces, cb = problem
    tide = memory_tide(traces, layout.chunk_size)
    s = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1e9, resident=[0])
    args = (layout.chunk_size, traces, tide, cb, s.param_kinds, s.update_locations, s.fetch, s.segments,
            list(s.predicted.device_bytes_per_moment))
    memo = predictor()
    for w in (2, 3):
        kw = dict(flops_per_step=1e9, window=w, master_fetch=[2, 1])
        first = memo(*args, **kw)
        assert first == pr.predict(*args, **kw)
        assert memo(*args[:-1], tuple(args[-1]), **dict(kw, master_fetch=(1, 2))) is first  # the same call again
