"""Issue 21, item 1 for the host-update thread: a stalled host update does not hang the step.

``step.wait(state)`` (and the next call) wait for the host thread at most the step's
``host_deadline_s``; past it, one line (:class:`chunkjax.updaters.HostDeadlineError`) says what
was stalled and where the last good state is. The thread is a daemon: an abandoned update cannot
keep the process alive.
"""
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.updaters import HOST_DEADLINE_MIN_S, HOST_DEADLINE_STEPS, HostDeadlineError, host_deadline_s
from models import gpt


def _host_step(host_deadline=None):
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng()  # numpy draws: no eager jax op to compile (the subprocess below starts cold)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), gpt.abstract_params(cfg))
    batch = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    layout = cj.build_layout(params, None, cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batch),
                             min_chunks=4)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct(batch.shape, jnp.int32), jnp.float32)
    spec = AdamW(1e-3)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, resident=[])  # every chunk host-updated
    assert set(sched.update_locations) == {"host"}
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                                host_deadline=host_deadline)
    return step, params, batch


def test_deadline_scales_with_the_predicted_step():
    assert host_deadline_s(None) == HOST_DEADLINE_MIN_S
    assert host_deadline_s(1e-3) == HOST_DEADLINE_MIN_S
    assert host_deadline_s(60.0) == pytest.approx(HOST_DEADLINE_STEPS * 60.0)
    step, _, _ = _host_step()
    assert step.host_deadline_s == host_deadline_s(step.schedule.predicted.time.step_s)


def test_stalled_host_update_raises_one_line_within_the_deadline():
    """A host update that never returns (here: one that sleeps for 60 s) makes ``wait`` raise
    after the 1 s deadline, not after the update, and the next call raises the same way."""
    step, params, batch = _host_step(host_deadline=1.0)
    state = step.init(params)
    state, m = step(state, batch)  # a working step first
    assert np.isfinite(float(m["loss"]))
    assert step.wait(state) is not None

    def stalled(*args):
        time.sleep(60)
        return 0.0

    object.__setattr__(step, "update_host_chunks", stalled)
    state, _ = step(state, batch)
    t0 = time.monotonic()
    with pytest.raises(HostDeadlineError, match=r"host-update thread did not finish .* within 1 s .*resume from it") as e:
        step.wait(state)
    assert time.monotonic() - t0 < 10
    assert "\n" not in str(e.value)
    with pytest.raises(HostDeadlineError):
        step(state, batch)


def test_an_abandoned_host_thread_does_not_keep_the_process_alive(tmp_path):
    """The process exits right after the deadline error although the update is still stuck."""
    script = textwrap.dedent("""
        import time, sys
        sys.path.insert(0, "tests")
        import test_host_deadline as t
        step, params, batch = t._host_step(host_deadline=0.5)
        state = step.init(params)
        object.__setattr__(step, "update_host_chunks", lambda *a: time.sleep(600))
        state, _ = step(state, batch)
        try:
            step.wait(state)
        except t.HostDeadlineError as e:
            print("DEADLINE", e, flush=True)
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert "DEADLINE" in out.stdout, out.stderr[-2000:]
    assert out.returncode == 0
    assert time.monotonic() - t0 < 200
