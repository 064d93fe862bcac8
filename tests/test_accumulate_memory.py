"""Host bytes of gradient accumulation (issue 24 item 1): what the micro-batch sums allocate is
what the plan counts. On the CPU memory kinds compile to nothing: these check bytes and values."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import accumulate
from chunkjax.tide import memory_tide
from chunkjax import predict as pr
from chunkjax.host_memory import schedule_host_need
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.storage.updater import StorageOptions
from models import gpt

B, T = 4, 16
SPEC = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)


class _Whole:
    whole = staticmethod(np.asarray)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_host_sums_write_the_mean_over_the_sum(dtype, monkeypatch):
    """HostSums: the mean is bit-equal to float32 sums of the micro-batches' gradients times
    float32(1/n) rounded to the compute dtype, and lives in the sum's own float32 buffer (one
    per chunk, across blocks: a chunk larger than one block)."""
    monkeypatch.setattr(accumulate, "MEAN_BLOCK", 1000)
    n, size, rng = 3, 4567, np.random.default_rng(0)
    grads = [{c: (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 4, size)).astype(dtype) for c in range(2)}
             for _ in range(n)]
    sums = accumulate.HostSums(n, dtype, _Whole())
    futures = [sums.add(i, dict(g)) for i, g in enumerate(grads)][-1]
    sums.close()
    for c, f in futures.items():
        mean, sq = f.result()
        ref = sum(g[c].astype(np.float32) for g in grads)  # float32 adds in micro-batch order
        want = (ref * np.float32(1.0 / n)).astype(dtype)
        assert mean.dtype == np.dtype(dtype) and mean.shape == (size,)
        np.testing.assert_array_equal(mean.view(np.uint8), want.view(np.uint8))
        base = mean.base if mean.base is not None else mean
        while base.base is not None:
            base = base.base
        assert base.nbytes == 4 * size  # the mean costs no bytes beyond its float32 sum
        np.testing.assert_allclose(sq, np.sum(np.square(want.astype(np.float64))), rtol=1e-5)


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.get_config("micro", n_layers=3)
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(24))  # one program, not one per op
    batch = jnp.asarray(np.random.default_rng(24).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batch[:B // 2])
    layout = cj.build_layout(params, cfg.vocab_size * cfg.d_model // 4, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((B // 2, T + 1), jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    return cfg, params, batch, stages, layout, traces, cb


def _plan(setup, mb, **kw):
    cfg, params, batch, stages, layout, traces, cb = setup
    return plan_schedule(layout, traces, cb, 10**12, flops_per_step=cfg.flops_per_token(T) * B * T, resident=[0],
                         split=False, micro_batches=mb, **kw)


def test_device_sums_join_the_device_plan(setup):
    """Device-updated chunks' float32 sums are on the device through every micro-batch: the
    same placement's device bytes rise by one float32 chunk per device-updated chunk at every
    moment."""
    cb = setup[-1]
    one, two = _plan(setup, 1), _plan(setup, 2)
    assert one.update_locations == two.update_locations and one.fetch == two.fetch
    n_dev = two.update_locations.count("device")
    assert n_dev >= 1
    assert [b - a for a, b in zip(one.predicted.device_bytes_per_moment, two.predicted.device_bytes_per_moment)] \
        == [n_dev * cb.master] * len(one.predicted.device_bytes_per_moment)


def test_plan_counts_the_sums_the_step_allocates(setup, tmp_path, monkeypatch):
    """One step of 2 micro-batches with device, host and storage chunks: the float32 sums the
    step allocates in host memory (HostSums and mean_gradients, through add_into) are, byte for
    byte, the plan's: ``host_working_bytes`` beyond the host gradients' window, the pageable
    part of the host need beyond the same schedule's without micro-batches."""
    cfg, params, batch, stages, layout, traces, cb = setup
    free = _plan(setup, 2)
    s = _plan(setup, 2, host_budget_bytes=int(0.6 * free.predicted.host_bytes), storage_devices=1)
    locs = s.update_locations
    assert {"device", "host", "storage"} <= set(locs)
    sums = sum(u in ("host", "streamed", "storage") for u in locs) * cb.master
    done = pr.grad_done_moments(traces, memory_tide(traces, layout.chunk_size))
    window = pr.grad_window_bytes([done.get(c, len(s.moments) - 1) for c, u in enumerate(locs) if u == "host"],
                                  s.segments, cb.grad)
    assert s.predicted.host_working_bytes == window + sums
    kw = dict(layout=layout)
    assert (schedule_host_need(s, cb, micro_batches=2, **kw)["pageable_bytes"]
            - schedule_host_need(s, cb, micro_batches=1, **kw)["pageable_bytes"]) == sums

    made = []
    real = accumulate.add_into

    def counting(total, g, weight=None):
        if total is None:
            made.append(4 * np.size(g))
        return real(total, g, weight)

    monkeypatch.setattr(accumulate, "add_into", counting)
    step = cj.make_chunked_step(stages, layout, s, host_optimizer=SPEC, compute_dtype=jnp.float32, micro_batches=2,
                                storage=StorageOptions((str(tmp_path / "a"),), fsync=False))
    st = step.init(params)
    st, m = step(st, batch)
    step.wait(st)
    assert np.isfinite(float(m["loss"]))
    assert sum(made) == sums
    st.master[locs.index("storage")].close()


def test_compiled_check_counts_device_sums_with_micro_batches():
    """The compiled check (fit.compiled_peak) adds each device-updated chunk's float32 gradient
    sum, held through every program of the micro-batches, to the largest program's peak: a
    micro-batch plan that fits without them would run out of device memory."""
    import types
    from chunkjax import fit
    rng = np.random.default_rng()
    size, n_dev, prog_peak = int(rng.integers(1000, 5000)), int(rng.integers(2, 6)), int(rng.integers(10**6, 10**7))
    cb = pr.ChunkBytes(params=2 * size, grad=2 * size, master=4 * size, opt=8 * size)
    locs = ["device"] * n_dev + ["host"] * 3
    kinds = ["device"] * n_dev + ["pinned_host"] * 3
    prog = {"peak_device_bytes": prog_peak, "argument": 1, "output": 1, "temp": 1, "alias": 0}
    step = types.SimpleNamespace(compiled_memory_programs=lambda mb: [prog], held_beside_programs=lambda mb: [0])
    out = {}
    for m in (1, 2):
        problem = types.SimpleNamespace(batch=jax.ShapeDtypeStruct((4, T + 1), jnp.int32), micro_batches=m,
                                        cb_rank=cb, layout=types.SimpleNamespace(chunk_size=size))
        out[m] = fit.compiled_peak(problem, step, types.SimpleNamespace(update_locations=locs, param_kinds=kinds))
    assert out[1]["resident_state_bytes"] == n_dev * cb.state
    assert out[2]["resident_state_bytes"] - out[1]["resident_state_bytes"] == n_dev * cb.master
    assert out[2]["peak_bytes"] >= prog_peak + n_dev * (cb.state + cb.master)
