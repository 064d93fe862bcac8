"""One process of the 2-process ZeRO checkpoint test (tests/test_checkpoint_multiprocess.py); not
a test itself.

``python tests/checkpoint_multiprocess_worker.py PROCESS_ID N_PROCESSES PORT SEED CKPT_DIR OUT.npz``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu``: joins the
``jax.distributed`` job, trains the micro GPT with ZeRO stage 3 over the 8-device mesh of both
processes (the model and data of tests/zero_multiprocess_worker.py; the one step,
``chunkjax.make_chunked_step(..., mesh=data_mesh())``), saves a checkpoint after step 2 (every
process calls save_checkpoint), trains to step 4, then restores the checkpoint into a fresh state
(every process calls restore_checkpoint) and trains steps 3-4 again; then trains the 4 steps once
more with host-updated chunks (each process updates its own ranks' shards), saving and restoring
that state too. Process 0 writes the loss curves, the master params at step 2 and those after step
4 to OUT.npz. The
run is also tests/test_zero_multiprocess.py's (ZeRO-3 over 2 processes against one device): it
is launched once per pytest process (the ``zero3_two_process_run`` fixture in tests/conftest.py).
The same launch works on a cluster: set the coordinator address, process count and id per node
(or let ``jax.distributed.initialize()`` read them from SLURM) and drop the gloo line on GPUs.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main(pid: int, n_proc: int, port: int, seed: int, ckpt: str, out: str) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("zmw", os.path.join(HERE, "zero_multiprocess_worker.py"))
    zmw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zmw)
    cfg, params, batches, layout, step = zmw.joined(pid, n_proc, port, seed)
    import jax

    import chunkjax as cj
    from chunkjax import checkpoint as ck
    from chunkjax.topology import data_mesh
    from models import gpt
    n = len(jax.devices())
    state = step.init(params)
    losses = []
    for i, b in enumerate(batches):
        if i == 2:
            ck.save_checkpoint(ckpt, 2, step, state, {"data_position": 2})
            master2 = step.master_params(state)
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    final = step.master_params(state)  # collective: every process calls it
    state, extra = ck.restore_checkpoint(ckpt, step)
    resumed = []
    for b in batches[extra["data_position"]:]:
        state, m = step(state, b)
        resumed.append(float(m["loss"]))
    host_losses, host_final, host_restored = _host_updated_run(cj, ck, gpt.gpt_stages(cfg), layout, params, batches,
                                                               data_mesh(), ckpt + "_host")
    if pid == 0:
        leaves, final_leaves = jax.tree.leaves(master2), jax.tree.leaves(final)
        np.savez(out, losses=np.asarray(losses), resumed=np.asarray(resumed), n_devices=n,
                 host_losses=np.asarray(host_losses), host_restored=host_restored, **{f"host{i}": a for i, a in enumerate(host_final)},
                 n_processes=jax.process_count(), **{f"p{i}": a for i, a in enumerate(leaves)},
                 **{f"final{i}": a for i, a in enumerate(final_leaves)})
    jax.distributed.shutdown()


def _host_updated_run(cj, ck, stages, layout, params, batches, mesh, ckpt) -> tuple[list, list, bool]:
    """The same training with a schedule that keeps chunk 0 on the device and updates every other
    chunk on the host (AdamW kernel, clipping at 1.0 as the optax chain), each process updating
    the shards of its own devices: the losses, the final master params' leaves (gathered from
    both processes), and whether a checkpoint of the final state (every process saving, then
    restoring into a fresh state) holds the same master params bit for bit."""
    import jax
    import jax.numpy as jnp

    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.plan import plan_schedule
    spec = AdamW(2e-3, weight_decay=0.1, max_grad_norm=1.0)
    rows = batches[0].shape[0] // mesh.devices.size
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((rows,) + batches[0].shape[1:], jnp.int32),
                             jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    sched = plan_schedule(layout, traces, cb, 10**12, flops_per_step=1.0, resident=[0])
    assert set(sched.update_locations) == {"device", "host"}, sched.update_locations
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32, mesh=mesh,
                                zero_stage=3)
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    final = jax.tree.leaves(step.master_params(state))  # collective: every process calls it
    ck.save_checkpoint(ckpt, len(batches), step, state, {})
    back = jax.tree.leaves(step.master_params(ck.restore_checkpoint(ckpt, step)[0]))
    return losses, final, all(np.array_equal(a, b) for a, b in zip(final, back, strict=True))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4], a[5])
