"""Checkpoints of the storage tier (issue 8: "optimizer state in any placement including disk"):
a NearStorageOptimizer's on-disk AdamW state saved chunk by chunk in the chunkjax checkpoint
format, restored onto other storage directories, another chunk size, into memory (a
ChunkedStep), and a memory checkpoint restored onto storage.

AdamW without clipping is elementwise, so a resume on storage (any directory count or chunk
size) is checked bit for bit; storage <-> memory is checked bit for bit on the transferred state
and to float32 rounding on the continued losses (the gradients come from another program).
"""
import errno
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint import N, SPEC, build_setup, make_step, run

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax import portable
from chunkjax.storage.near import NearStorageOptimizer
from chunkjax.storage.restore import restore_storage_checkpoint


@pytest.fixture(scope="module")
def setup():
    return build_setup()


def grad_chunks(layout, params, step):
    """Fresh random gradients of the params tree (seeded by ``step``), packed by ``layout``
    (padding zero), as float32 numpy chunks."""
    rng = np.random.default_rng(9000 + step)
    g = jax.tree.map(lambda p: (0.1 * rng.standard_normal(np.shape(p))).astype(np.float32), params)
    return [np.asarray(x) for x in layout.pack(g, jnp.float32)]


def unpacked_state(layout, state):
    """{name: params-shaped tree} of a NearStorageOptimizer.read_state()."""
    return {n: layout.unpack([jnp.asarray(state[c][k]) for c in range(layout.n_chunks)])
            for k, n in enumerate(("master", "mu", "nu"))}


def same_bits_tree(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


def opt_for(layout, params, dirs, **kw):
    init = [np.asarray(x) for x in layout.pack(params, jnp.float32)]
    return NearStorageOptimizer(dirs, [layout.chunk_size] * layout.n_chunks, SPEC, init_params=init, fsync=False,
                                **kw)


@pytest.fixture(scope="module")
def storage_run(setup, tmp_path_factory):
    """1 storage directory, 2N steps of random gradients, checkpoint after step N; final state."""
    params, layout = setup[1], setup[4]
    root = tmp_path_factory.mktemp("storage_run")
    with opt_for(layout, params, [root / "dev0"]) as opt:
        for s in range(1, N + 1):
            opt.step(grad_chunks(layout, params, s))
        ck.save_storage_checkpoint(root / "ckpt", N, opt, layout, {"data_position": N, "rng": jax.random.key(3)})
        for s in range(N + 1, 2 * N + 1):
            last = opt.step(grad_chunks(layout, params, s))
        final = opt.read_state()
    return root / "ckpt", final, last


def test_storage_resume_on_other_directories_is_exact(setup, storage_run, tmp_path):
    params, layout = setup[1], setup[4]
    ckpt, final, last = storage_run
    meta = ck.read_meta(ckpt)
    assert meta["saved_from"] == {"step": "NearStorageOptimizer", "n_ranks": 1, "storage_dirs": 1}
    assert [cm["count"] for cm in meta["chunks"]] == [N] * layout.n_chunks
    opt, extra = restore_storage_checkpoint(ckpt, [tmp_path / "a", tmp_path / "b"], SPEC, layout, fsync=False)
    with opt:
        assert opt.committed_step == N and extra["data_position"] == N
        assert jax.random.key_data(extra["rng"]).tolist() == jax.random.key_data(jax.random.key(3)).tolist()
        for s in range(N + 1, 2 * N + 1):
            r = opt.step(grad_chunks(layout, params, s))
        got = opt.read_state()
    assert r.step == last.step == 2 * N
    for c in range(layout.n_chunks):
        for k in range(3):
            np.testing.assert_array_equal(got[c][k].view(np.uint32), final[c][k].view(np.uint32))
        np.testing.assert_array_equal(np.asarray(r.params[c]).view(np.uint16), np.asarray(last.params[c]).view(np.uint16))


def test_storage_restore_into_other_chunk_size_is_exact(setup, storage_run, tmp_path):
    params, layout = setup[1], setup[4]
    ckpt, final, _ = storage_run
    other = cj.build_layout(params, layout.chunk_size * 2)
    assert other.n_chunks != layout.n_chunks
    opt, _ = restore_storage_checkpoint(ckpt, [tmp_path / "x"], SPEC, other, fsync=False)
    with opt:
        for s in range(N + 1, 2 * N + 1):
            opt.step(grad_chunks(other, params, s))
        got = unpacked_state(other, opt.read_state())
    same_bits_tree(got, unpacked_state(layout, final))


def test_storage_checkpoint_into_memory_and_memory_onto_storage(setup, tmp_path):
    """Memory (ChunkedStep, host AdamW, fp32) -> storage: N more steps on storage agree with N
    more steps in memory; storage -> memory: the restored master and moments are the storage
    state bit for bit, with the step count."""
    params, batches, stages, layout = setup[1], setup[2], setup[3], setup[4]
    step = make_step(setup, [0, 1])  # chunks 0, 1 device AdamW (optax), the rest host AdamW
    state = step.init(params)
    state, l1 = run(step, state, batches[:N])
    ck.save_checkpoint(tmp_path / "mem", N, step, state, {"data_position": N})
    state, l2 = run(step, state, batches[N:])
    mem_final = ck.export_params(step, state)

    loss_grad = jax.jit(jax.value_and_grad(lambda p, b: cj.compose_loss(stages, p, b)))
    opt, extra = restore_storage_checkpoint(tmp_path / "mem", [tmp_path / "d0", tmp_path / "d1"], SPEC, layout,
                                               fsync=False)
    with opt:
        assert opt.committed_step == N and extra == {"data_position": N}
        losses = []
        for b in batches[N:]:
            master = unpacked_state(layout, opt.read_state())["master"]
            loss, g = loss_grad(master, b)
            losses.append(float(loss))
            opt.step([np.asarray(x) for x in layout.pack(g, jnp.float32)])
        np.testing.assert_allclose(losses, l2, rtol=1e-5)
        st = unpacked_state(layout, opt.read_state())
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), st["master"], mem_final)
        ck.save_storage_checkpoint(tmp_path / "back", 2 * N, opt, layout)
    # storage -> memory, into another placement (everything on the device, optax AdamW)
    dev_step = make_step(setup, list(range(layout.n_chunks)))
    restored, _ = ck.restore_checkpoint(tmp_path / "back", dev_step)
    same_bits_tree(ck.export_params(dev_step, restored), st["master"])
    port = [portable.optax_to_portable(o, layout.chunk_size) for o in restored.opt_state]  # (count, moments, rest)
    same_bits_tree(layout.unpack([jnp.asarray(p[1]["mu"]) for p in port]), st["mu"])
    same_bits_tree(layout.unpack([jnp.asarray(p[1]["nu"]) for p in port]), st["nu"])
    assert {int(p[0]) for p in port} == {2 * N}


def test_error_feedback_residuals_travel_with_the_checkpoint(setup, tmp_path):
    params, layout = setup[1], setup[4]
    kw = dict(compression="topk", topk_ratio=0.05, topk_scope="global", error_feedback=True)
    with opt_for(layout, params, [tmp_path / "u"], **kw) as opt:
        for s in range(1, N + 1):
            opt.step(grad_chunks(layout, params, s))
        ck.save_storage_checkpoint(tmp_path / "ck", N, opt, layout)
        saved_res = {c: np.asarray(r) for c, r in opt._residual.items()}
        for s in range(N + 1, 2 * N + 1):
            opt.step(grad_chunks(layout, params, s))
        final = opt.read_state()
    assert any(np.any(r) for r in saved_res.values())
    assert ck.read_meta(tmp_path / "ck")["ef_residual"] is True
    opt, _ = restore_storage_checkpoint(tmp_path / "ck", [tmp_path / "r"], SPEC, layout, fsync=False, **kw)
    with opt:
        for c, r in saved_res.items():
            np.testing.assert_array_equal(np.asarray(opt._residual[c]), r)
        for s in range(N + 1, 2 * N + 1):
            opt.step(grad_chunks(layout, params, s))
        got = opt.read_state()
    for c in range(layout.n_chunks):
        for k in range(3):
            np.testing.assert_array_equal(got[c][k].view(np.uint32), final[c][k].view(np.uint32))


def test_storage_checkpoint_refusals_and_write_failure(setup, storage_run, tmp_path, monkeypatch):
    params, layout = setup[1], setup[4]
    ckpt = storage_run[0]
    # directories holding a run are refused before anything is written
    opt, _ = restore_storage_checkpoint(ckpt, [tmp_path / "used"], SPEC, layout, fsync=False)
    with opt:
        before = sorted(os.listdir(tmp_path / "used"))
        with pytest.raises(ck.CheckpointError, match="already hold a storage-tier run"):
            restore_storage_checkpoint(ckpt, [tmp_path / "used"], SPEC, layout)
        assert sorted(os.listdir(tmp_path / "used")) == before
        # a layout that did not make the optimizer's chunks
        with pytest.raises(ck.CheckpointError, match="do not match the layout"):
            ck.save_storage_checkpoint(tmp_path / "c", N, opt, cj.build_layout(params, layout.chunk_size * 2))
        # a full disk while writing chunk 2: one-line error, nothing left, older checkpoint intact
        ck.save_storage_checkpoint(tmp_path / "c", N, opt, layout)
        real = ck.files.write_chunk

        def full(ckptr, path, arrays):
            if path.endswith("chunk_00002"):
                raise OSError(errno.ENOSPC, "No space left on device")
            real(ckptr, path, arrays)

        monkeypatch.setattr(ck.files, "write_chunk", full)
        opt.step(grad_chunks(layout, params, N + 1))
        with pytest.raises(ck.CheckpointWriteError, match="ENOSPC.*intact") as e:
            ck.save_storage_checkpoint(tmp_path / "c", N + 1, opt, layout)
        assert len(str(e.value).splitlines()) == 1
        assert sorted(os.listdir(tmp_path / "c")) == [f"step_{N:08d}"]
        monkeypatch.setattr(ck.files, "write_chunk", real)
        opt.step(grad_chunks(layout, params, N + 2))  # the optimizer is still usable
        assert opt.committed_step == N + 2
    # another optimizer's moments are refused
    bad = tmp_path / "sgd"
    shutil.copytree(ckpt, bad)
    mpath = bad / f"step_{N:08d}" / "meta.json"
    meta = json.loads(mpath.read_text())
    for cm in meta["chunks"]:
        cm["moments"] = ["trace"]
    mpath.write_text(json.dumps(meta))
    sums = ck.files.read_checksums(str(mpath.parent))  # re-sealed: an intact checkpoint of another optimizer
    sums[ck.META] = ck.files.file_checksum(str(mpath))
    ck.files.write_checksums(str(mpath.parent), sums)
    with pytest.raises(ck.CheckpointError, match=r"moments \['trace'\].*AdamW"):
        restore_storage_checkpoint(bad, [tmp_path / "n"], SPEC, layout)
    assert not os.path.exists(tmp_path / "n") or not os.listdir(tmp_path / "n")
