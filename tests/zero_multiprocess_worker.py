"""The model, data and optimizer of the 2-process ZeRO tests (tests/test_zero_multiprocess.py,
tests/test_checkpoint_multiprocess.py); not a test itself. The process that trains them is
tests/checkpoint_multiprocess_worker.py (a complete ``jax.distributed`` worker)."""
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


def make_step(cj, stages, layout, tx, mesh):
    """The one step over ``mesh`` (ZeRO stage 3, float32, every chunk on the device: the fixed
    rule's one program); the same in every process and in the single-process restore."""
    import jax.numpy as jnp
    placement = cj.Placement.uniform(layout.n_chunks, cj.DEVICE, cj.DEVICE)
    return cj.make_chunked_step(stages, layout, placement, tx, jnp.float32, mesh=mesh, zero_stage=3)


def joined(pid: int, n_proc: int, port: int, seed: int):
    """Join the localhost ``jax.distributed`` job (gloo CPU collectives) and build the shared
    model's step over every process's devices: ``(cfg, params, batches, layout, step)``."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=n_proc, process_id=pid)
    import chunkjax as cj
    from chunkjax.topology import build_zero_layout, data_mesh
    from models import gpt
    cfg, params, batches, tx = draw(seed)
    layout = build_zero_layout(params, len(jax.devices()), cfg.vocab_size * cfg.d_model)
    return cfg, params, batches, layout, make_step(cj, gpt.gpt_stages(cfg), layout, tx, data_mesh())
