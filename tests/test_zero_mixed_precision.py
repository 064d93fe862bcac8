"""ZeRO (the one step over a ``data`` mesh, 8 forced CPU devices) with gradient accumulation over
micro-batches, fp16-style dynamic loss scaling and the skip policy (issue 8, part 2): an overflowed step changes
no state on any rank (device and host-updated shards), and accumulated, scaled steps train like
single-device optax on the whole batch, with global-norm clipping over every rank's shard.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.step import make_chunked_step
from chunkjax.topology import build_zero_layout, data_mesh
from models import gpt

N, MB, T = 8, 2, 16
B = N * MB  # each micro-batch splits over the 8 ranks
SPEC = AdamW(2e-3, weight_decay=0.05, max_grad_norm=0.05)  # small: clipping is active at every step


def _state_numpy(step, state):
    """Copies of every chunk's master params and optimizer state (host shards and device arrays)."""
    step.wait(state)
    out = []
    for m, o in zip(state.master, state.opt_state):
        leaves = jax.tree.leaves((m, o), is_leaf=lambda x: hasattr(x, "m") and hasattr(x, "v"))
        flat = []
        for x in leaves:
            if hasattr(x, "m") and hasattr(x, "v"):  # a host AdamW state of one rank
                flat += [np.array(x.m), np.array(x.v), np.array(x.count)]
            else:
                flat.append(np.array(x))
        out.append(flat)
    return out


@pytest.fixture(scope="module")
def setup():
    """What both ZeRO stages share: params, batches, layout, traces, the schedule and the
    single-device optax reference (none of them depends on the stage)."""
    assert jax.device_count() >= N, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng()
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))  # one program
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32) for _ in range(2)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    layout = build_zero_layout(params, N, cj.build_layout(params, None, order, min_chunks=4).chunk_size, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((B // MB, T + 1), jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1.0, resident=[0])  # device + host chunks
    assert set(sched.update_locations) == {"device", "host"}

    # single-device optax on the whole batch
    tx = SPEC.optax()

    @jax.jit
    def ref(p, o, b):
        l, g = jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, b, jnp.float32))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, l, optax.global_norm(g)

    p, o, want, want_norm = params, tx.init(params), [], []
    for b in batches:
        p, o, l, gn = ref(p, o, b)
        want.append(float(l))
        want_norm.append(float(gn))
    assert min(want_norm) > SPEC.max_grad_norm  # clipping acts
    return params, batches, stages, layout, sched, (p, want, want_norm)


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_zero_micro_batches_loss_scaling_and_skip(zero_stage, setup):
    params, batches, stages, layout, sched, (p, want, want_norm) = setup
    step = make_chunked_step(stages, layout, sched, mesh=data_mesh(), zero_stage=zero_stage, host_optimizer=SPEC,
                                    compute_dtype=jnp.float32, micro_batches=MB, loss_scaling=True)
    state = step.init(params)

    # an overflowed step (infinite loss scale): skipped, nothing changes on any rank
    before = _state_numpy(step, state)
    state, m = step(state, batches[0], loss_scale=float("inf"))
    assert bool(m["skipped"])
    after = _state_numpy(step, state)
    for a, b in zip(before, after, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)

    # then scaled (2^12, exact in float32), accumulated steps: single-device optax on the whole batch
    got, got_norm = [], []
    for b in batches:
        state, m = step(state, b, loss_scale=2.0 ** 12)
        assert not bool(m["skipped"])
        got.append(float(m["loss"]))
        got_norm.append(float(m["grad_norm"]))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    # the unscaled global norm over every rank's shard of the accumulated (mean) gradient: Adam
    # is nearly scale-invariant, so this is what shows the accumulation and the unscaling right
    np.testing.assert_allclose(got_norm, want_norm, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), jax.tree.leaves(p)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-4  # as tests/test_zero_schedule.py

    with pytest.raises(ValueError, match="ranks x 2 micro-batches"):
        step(state, batches[0][:8], loss_scale=1.0)
