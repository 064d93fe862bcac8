"""One process of the 2-process ZeRO test (tests/test_zero_multiprocess.py); not a test itself.

Run as ``python tests/zero_multiprocess_worker.py PROCESS_ID N_PROCESSES PORT SEED STAGE OUT.npz``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=K JAX_PLATFORMS=cpu``: joins the
``jax.distributed`` job on localhost:PORT (CPU collectives through gloo), builds a ``data`` mesh
over the devices of every process, trains the micro GPT for :data:`STEPS` steps with ZeRO
``STAGE`` and (process 0) writes the losses and the final master params to OUT.npz.
The same launch works on a cluster: set the coordinator address, process count and id per node
(or let ``jax.distributed.initialize()`` read them from SLURM) and drop the gloo line on GPUs.
"""
import os
import sys

import numpy as np

STEPS = 4
B, T = 8, 16


def draw(seed: int):
    """(cfg, params, batches, tx): numpy draws, identical in every process for one seed."""
    import jax
    import optax

    from models import gpt
    rng = np.random.default_rng(seed)
    cfg = gpt.get_config("micro", n_layers=2)
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: (np.ones(a.shape, np.float32) if jax.tree_util.keystr(p).endswith("['scale']")
                      else rng.normal(0.0, 0.02, a.shape).astype(np.float32)), gpt.abstract_params(cfg))
    distinct = [rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(2)]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2e-3, weight_decay=0.1))
    return cfg, params, [distinct[i % 2] for i in range(STEPS)], tx


def main(pid: int, n_proc: int, port: int, seed: int, stage: int, out: str) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=n_proc, process_id=pid)
    from chunkjax import zero
    from models import gpt
    cfg, params, batches, tx = draw(seed)
    n = len(jax.devices())
    layout = zero.build_zero_layout(params, n, cfg.vocab_size * cfg.d_model)
    step = zero.make_zero_step(gpt.gpt_stages(cfg), layout, zero.data_mesh(), tx, stage=stage)
    state = step.init(params)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    final = step.master_params(state)  # collective: every process calls it
    if pid == 0:
        leaves = jax.tree.leaves(final)
        np.savez(out, losses=np.asarray(losses), n_devices=n, n_processes=jax.process_count(),
                 **{f"p{i}": a for i, a in enumerate(leaves)})
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), a[5])
