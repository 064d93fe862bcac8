"""The initial state of a chunked step, bit for bit (issue 24, setup time): whatever order and
threads :meth:`chunkjax.ChunkedStep.init` places chunks with, every chunk's compute params, master
params and optimizer state are the definition's: the float32 chunk of the leaves (padding zero),
its compute-dtype cast (a master-fetch chunk: the float32 itself), zero moments, and for a storage
chunk the same master and moments read back from its file."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import host_update as hu
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.storage.updater import DiskState, StorageOptions
from models import gpt

SPEC = AdamW(1e-3, weight_decay=0.1)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("storage", [False, True])
def test_init_places_the_definitions_state_bit_for_bit(tmp_path, storage):
    cfg = gpt.get_config("micro", n_layers=4)
    abstract = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), abstract, batch)
    layout = cj.build_layout(abstract, 4096, order)
    traces = cj.trace_stages(stages, layout, batch, jnp.bfloat16)
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    kw = dict(flops_per_step=cfg.flops_per_token(16) * 32, resident=list(range(layout.n_chunks // 4)), split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    s = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=int((0.8 if storage else 0.9)
                                                                      * free.predicted.host_bytes),
                      storage_devices=int(storage), **kw)
    locs = set(s.update_locations)
    assert {"device", "host"} <= locs and s.master_fetch and ("storage" in locs) == storage, s.counts()
    rng = np.random.default_rng(7)
    leaves = [rng.standard_normal(sl.shape, np.float32) for sl in layout.slots]
    step = cj.make_chunked_step(stages, layout, s, host_optimizer=SPEC, compute_dtype=jnp.bfloat16,
                                storage=StorageOptions((str(tmp_path / "d0"),), fsync=False) if storage else None)
    state = step.init(leaves.__getitem__)
    mf = set(s.master_fetch)
    for c, u in enumerate(s.update_locations):
        want = np.asarray(layout.pack_chunk(c, leaves, jnp.float32))
        p = state.params[c]
        np.testing.assert_array_equal(_bits(p), _bits(want if c in mf else want.astype(jnp.bfloat16)), err_msg=f"{c}")
        if u == "storage":
            disk = state.master[c]
            assert isinstance(disk, DiskState) and state.opt_state[c] is None
            master, m, v = disk.read(c)
            moments = (m, v)
        else:
            master = state.master[c]
            st = state.opt_state[c]
            moments = ([getattr(st, f) for f in hu.moment_fields(st)] if u == "host" else
                       [x for x in jax.tree.leaves(st) if np.ndim(x) == 1])
            assert u == "host" or len(moments) == 2  # optax adamw: mu, nu
        np.testing.assert_array_equal(_bits(master), _bits(want), err_msg=f"chunk {c} ({u}) master")
        for x in moments:
            assert np.asarray(x).shape == (layout.chunk_size,) and not np.asarray(x).any(), (c, u)
    if storage:
        state.master[s.update_locations.index("storage")].close()


def test_first_pass_spreads_storage_chunks_among_host_chunks():
    """Every chunk once; storage chunks in id order (their workers take them so), none two in a
    row while host chunks remain to put between them; device chunks first."""
    from chunkjax.step_init import first_pass_order
    locs = ["device"] * 4 + ["storage"] * 6 + ["host"] * 9 + ["storage"] * 2
    order = first_pass_order(locs)
    assert sorted(order) == list(range(len(locs))) and order[:4] == [0, 1, 2, 3]
    disk = [c for c in order if locs[c] == "storage"]
    assert disk == sorted(disk)
    pos = [order.index(c) for c in disk]
    assert all(b - a >= 2 for a, b in zip(pos, pos[1:]))  # 8 storage among 9 host chunks: one between each
    assert first_pass_order(["device", "host"]) == [0, 1]
    assert sorted(first_pass_order(["storage", "device", "storage"])) == [0, 1, 2]
