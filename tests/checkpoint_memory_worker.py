"""Peak host-memory (RSS) growth of saving and restoring a checkpoint of a few GiB, measured in a
fresh process (tests/test_checkpoint_memory.py); not a test itself.

``python tests/checkpoint_memory_worker.py CKPT_DIR`` with ``JAX_PLATFORMS=cpu``: builds a
ChunkedStep over a GPT (d_model 1024, 3 blocks: 38M parameters, fp32 compute: 16 bytes per
parameter, 0.875 GiB in 7 chunks of 8M elements, 128 MiB each), the first half device-updated
(optax state in jax arrays, host memory on the CPU),
the rest host-updated (numpy master params and AdamW moments), then saves it (``save``), saves
it asynchronously with ``max_inflight_bytes`` of one chunk (``async``), drops it and restores
the first checkpoint (``restore``). The high-water mark is reset just before each measured call
(``/proc/self/clear_refs``); prints one JSON line: ``{"chunk_bytes": one chunk's params + master
+ moments, "state_bytes", "n_chunks", "save"/"async"/"restore": {"growth": peak RSS - RSS
before, "after": RSS after - RSS before, "seconds"}}``.
"""
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 8 << 20  # elements


def RESIDENT(n: int) -> list[int]:
    """The device-updated chunks (optax state in jax arrays): the first half; the rest host-updated."""
    return list(range(n // 2))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _status("VmRSS")


def build():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import chunkjax as cj
    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.plan import plan_schedule
    from chunkjax.schedule import Placement
    from models import gpt
    cfg = gpt.get_config("micro", d_model=1024, n_layers=3, n_heads=8)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s: rng.random(s.shape, np.float32) * 0.02, shapes)
    batch = jnp.zeros((1, 9), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batch)
    layout = cj.build_layout(params, CHUNK, order)
    spec = AdamW(1e-3)
    n = layout.n_chunks  # abstract traces (as tests/test_checkpoint.py: nothing compiled)
    probe = cj.make_chunked_step(stages, layout, Placement(("device",) * n, ("device",) * n), tx=spec.optax())
    traces = probe.traces(batch)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1, resident=RESIDENT(layout.n_chunks))
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32)
    state = step.init(params)
    del params
    return step, state


def _warm(ckpt: str, chunk_size: int) -> None:
    """Steady state: orbax's one-time set-up and the C allocator's free lists after writing one
    chunk, in this thread and in another (the asynchronous writer's malloc arena): glibc keeps up
    to about a chunk of freed buffers for reuse after a process's first save."""
    import threading

    import numpy as np

    from chunkjax import checkpoint as ck
    rng = np.random.default_rng(1)
    arrays = {k: rng.random(chunk_size, np.float32) for k in ("params", "master", "mu", "nu")}

    def write(name):
        w = ck.files.checkpointer()
        ck.files.write_chunk(w, os.path.join(ckpt, name), arrays)
        w.close()
    write("warm0")
    t = threading.Thread(target=write, args=("warm1",))
    t.start()
    t.join()


def _measure(fn) -> dict:
    before = _reset_peak()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    gc.collect()
    return {"growth": _status("VmHWM") - before, "after": _status("VmRSS") - before, "seconds": seconds}


def main(ckpt: str) -> None:
    from chunkjax import checkpoint as ck
    step, state = build()
    lay = step.layout
    chunk_bytes = 16 * lay.chunk_size
    out = {"chunk_bytes": chunk_bytes, "state_bytes": chunk_bytes * lay.n_chunks, "n_chunks": lay.n_chunks}
    _warm(ckpt, lay.chunk_size)
    out["save"] = _measure(lambda: ck.save_checkpoint(ckpt, 1, step, state, {}))
    out["async"] = _measure(lambda: ck.save_checkpoint_async(ckpt, 2, step, state, {},
                                                             max_inflight_bytes=chunk_bytes).wait())
    del state
    held = []
    out["restore"] = _measure(lambda: held.append(ck.restore_checkpoint(ckpt, step, 1)))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main(sys.argv[1])
