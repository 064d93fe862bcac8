"""Checkpoints of ZeRO states and restore into another layout (issue 8, item 1).

A ZeRO-3 run over 8 forced CPU devices and a single-device ChunkedStep run (another chunk size)
train the micro GPT (2 blocks) with clip + AdamW in float32 from the same fresh random params on
fresh random batches (seed printed on failure); each saves after step N and goes on to 2N.

* resuming the ZeRO run on the same 8 devices repeats its losses and master params bit for bit:
  every restored value is the saved one (the per-rank moments of the rest-of-model leaf come
  back as rank 0's, but they never reach an update, chunkjax.optim);
* restoring 8 -> 4 devices, 8 -> one device (ChunkedStep, another chunk size) and 1 -> 8 devices
  (another chunk size) continues within float32 rounding of the uninterrupted run: the state is
  the same, only the summation order of the gradients (over ranks, over chunk boundaries)
  changes, which the single-device and ZeRO references already differ by (LOSS_RTOL);
* another chunk size restores every leaf's params, master params and moments bit for bit;
* another parameter tree or optimizer is refused with one line.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax.schedule import Placement
from chunkjax.topology import build_zero_layout, data_mesh
from models import gpt

B, T = 8, 16
N = 2  # save after N steps, compare steps N+1..2N
#: float32 rounding of a different gradient summation order (8 ranks vs 4 vs one device, other
#: chunk boundaries) through N Adam steps: observed at most 1.6e-7 (1-2 float32 ulps of a loss
#: near 6; seeds 213642609, 984027068, 667762931, 253183644), also between the two uninterrupted
#: references (ZeRO on 8 devices, one device); 2e-6 leaves a tenfold margin.
LOSS_RTOL = 2e-6


def _tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2e-3, weight_decay=0.1))


def _params(cfg, rng):
    """gpt.init_params' shapes drawn with numpy (normal 0.02, LayerNorm scales 1)."""
    def draw(path, a):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return np.ones(a.shape, np.float32)
        return rng.normal(0.0, 0.02, a.shape).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, gpt.abstract_params(cfg))


def _run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def _leafwise(step, state) -> dict:
    """{(leaf path, array name): float32/compute numpy} of every leaf's params, master and
    moments, from the state's portable per-chunk form (any topology and update location)."""
    out = {}
    for c in range(step.layout.n_chunks):
        arrays, cm = step.checkpoint_chunk(state, c, copy=False)
        out[("count", c)] = cm["count"]
        for i, p in step.layout.chunk_pieces(c):  # a leaf spanning chunks: its pieces joined
            s = step.layout.slots[i]
            for name, a in arrays.items():
                flat = out.setdefault((s.path, name), np.zeros((s.size,), a.dtype))
                flat[p.leaf_offset:p.leaf_offset + p.size] = a[p.offset:p.offset + p.size]
    return out


def _assert_same_leaves(a: dict, b: dict):
    leaves = lambda d: {k: v for k, v in d.items() if k[0] != "count"}  # noqa: E731
    assert leaves(a).keys() == leaves(b).keys()
    for k, v in leaves(a).items():
        np.testing.assert_array_equal(v, b[k], err_msg=str(k))
    assert {v for k, v in a.items() if k[0] == "count"} == {v for k, v in b.items() if k[0] == "count"} == {N}


@pytest.fixture(scope="module")
def setup():
    assert len(jax.devices()) >= 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    cfg = gpt.get_config("micro", n_layers=2)
    params = _params(cfg, rng)
    # two distinct batches, cycled: step N+1 sees step 1's batch again, so its loss must be lower
    distinct = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32) for _ in range(N)]
    batches = [distinct[i % N] for i in range(2 * N)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    lay8 = build_zero_layout(params, 8, cfg.vocab_size * cfg.d_model, order)  # 6 chunks of 32768
    lay1 = cj.build_layout(params, 45000, order)  # not a multiple of 8 ranks: leaves packed otherwise
    assert lay8.chunk_size == 32768 and lay1.chunk_size == 45000 and lay1.n_chunks != lay8.n_chunks
    return dict(seed=seed, cfg=cfg, params=params, batches=batches, stages=stages, order=order, lay8=lay8, lay1=lay1)


def _zero_step(setup, n_dev, layout=None, stage=3, state_kind=cj.DEVICE, stages=None, tx=None):
    """The one step over ``n_dev`` devices, every chunk's params on the device, state in
    ``state_kind`` (fixed fetch rule, one program)."""
    lay = layout or setup["lay8"]
    return cj.make_chunked_step(stages or setup["stages"], lay, Placement.uniform(lay.n_chunks, cj.DEVICE, state_kind),
                                tx or _tx(), jnp.float32, mesh=data_mesh(jax.devices()[:n_dev]), zero_stage=stage)


def _single_step(setup):
    n = setup["lay1"].n_chunks
    return cj.make_chunked_step(setup["stages"], setup["lay1"], Placement.uniform(n, cj.DEVICE, cj.DEVICE), _tx(),
                                compute_dtype=jnp.float32)


@pytest.fixture(scope="module")
def zero_run(setup, tmp_path_factory):
    """ZeRO-3 on 8 devices: 2N steps, checkpoint after step N."""
    step = _zero_step(setup, 8)
    d = tmp_path_factory.mktemp("zero8")
    state, l1 = _run(step, step.init(setup["params"]), setup["batches"][:N])
    ck.save_checkpoint(d, N, step, state, {"data_position": N})
    state, l2 = _run(step, state, setup["batches"][N:])
    return step, d, state, l1 + l2


@pytest.fixture(scope="module")
def single_run(setup, tmp_path_factory):
    """The single-device ChunkedStep (chunk size 45000): 2N steps, checkpoint after step N."""
    step = _single_step(setup)
    d = tmp_path_factory.mktemp("single")
    state, l1 = _run(step, step.init(setup["params"]), setup["batches"][:N])
    ck.save_checkpoint(d, N, step, state, {"data_position": N})
    state, l2 = _run(step, state, setup["batches"][N:])
    return step, d, state, l1 + l2


def test_zero_resume_is_exact(setup, zero_run):
    """Save on 8 devices at step N, restore, continue: the uninterrupted run's losses and final
    master params, bit for bit."""
    step, d, ref_state, ref_losses = zero_run
    meta = ck.read_meta(d)
    assert meta["saved_from"] == {"step": "ChunkedStep", "n_ranks": 8, "zero_stage": 3}
    assert meta["layout"]["chunk_size"] == 32768 and [c["count"] for c in meta["chunks"]] == [N] * 6
    state, extra = ck.restore_checkpoint(d, step)
    assert extra == {"data_position": N}
    assert {s.data.shape for s in state.master[0].addressable_shards} == {(32768 // 8,)}
    state, losses = _run(step, state, setup["batches"][N:])
    assert losses == ref_losses[N:], f"seed {setup['seed']}"
    got, ref = step.master_params(state), step.master_params(ref_state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {setup['seed']}")
    assert ref_losses[N] < ref_losses[0]


def test_zero_restore_on_4_devices(setup, zero_run):
    """8 -> 4 devices (ZeRO-2, the same layout re-sharded): continues within float32 rounding."""
    _, d, _, ref_losses = zero_run
    step = _zero_step(setup, 4, stage=2)
    state, _ = ck.restore_checkpoint(d, step)
    assert {s.data.shape for s in state.master[0].addressable_shards} == {(32768 // 4,)}
    assert {len(a.addressable_shards) for a in jax.tree.leaves(state.opt_state)} == {4}
    _, losses = _run(step, state, setup["batches"][N:])
    np.testing.assert_allclose(losses, ref_losses[N:], rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")


def test_zero_restore_into_single_device(setup, zero_run, single_run):
    """8 devices (chunks of 32768) -> one device (ChunkedStep, chunks of 45000): leaves remapped,
    continues within float32 rounding of the ZeRO run; the references agree to the same bound."""
    _, d, _, ref_losses = zero_run
    step, _, _, single_losses = single_run
    np.testing.assert_allclose(single_losses, ref_losses, rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")
    state, _ = ck.restore_checkpoint(d, step)
    assert len(state.master) == setup["lay1"].n_chunks
    _, losses = _run(step, state, setup["batches"][N:])
    np.testing.assert_allclose(losses, ref_losses[N:], rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")


def test_single_device_restore_into_zero(setup, zero_run, single_run):
    """One device (chunks of 45000) -> ZeRO-3 on 8 devices (chunks of 32768): continues within
    float32 rounding of the single-device run."""
    step = zero_run[0]
    _, d, _, single_losses = single_run
    state, extra = ck.restore_checkpoint(d, step)
    assert extra == {"data_position": N}
    _, losses = _run(step, state, setup["batches"][N:])
    np.testing.assert_allclose(losses, single_losses[N:], rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")


def test_other_chunk_size_keeps_every_value(setup, zero_run, single_run, tmp_path):
    """The ZeRO checkpoint restored into another chunk size (70016 = 547 * 128, state in pinned
    host memory) holds every leaf's params, master params and Adam moments bit for bit; saved
    from there and restored into one device, still bit for bit (nothing trained here)."""
    _, d, _, _ = zero_run
    ref_step = _zero_step(setup, 8)
    ref = _leafwise(ref_step, ck.restore_checkpoint(d, ref_step)[0])
    lay = build_zero_layout(setup["params"], 8, 70000, setup["order"])
    assert lay.chunk_size == 70016 and lay.n_chunks != setup["lay8"].n_chunks
    step = _zero_step(setup, 8, lay, state_kind=cj.PINNED_HOST)
    state, _ = ck.restore_checkpoint(d, step)
    assert {a.sharding.memory_kind for a in state.master + tuple(jax.tree.leaves(state.opt_state))} == {cj.PINNED_HOST}
    _assert_same_leaves(_leafwise(step, state), ref)
    ck.save_checkpoint(tmp_path, N, step, state, {})
    single = single_run[0]
    _assert_same_leaves(_leafwise(single, ck.restore_checkpoint(tmp_path, single)[0]), ref)
    np.testing.assert_array_equal(ck.export_checkpoint_params(tmp_path, setup["lay8"])["wte"],
                                  ref[("wte", "master")].reshape(setup["params"]["wte"].shape))


def test_spanning_layout_and_old_format_keep_every_value(setup, zero_run, tmp_path):
    """Leaves larger than a chunk (issue 22 item 3): the ZeRO checkpoint (6 chunks of 32768, every
    leaf whole) restored into chunks of 10240, where wte (32768) and the MLP kernels (16384) span
    chunks, holds every value bit for bit and trains on (ZeRO-3, 8 devices) to the uninterrupted
    run's losses; saved from there it restores into the original layout bit for bit. A checkpoint written before pieces (format version 2, a leaf at one
    [chunk, offset]) still restores, bit for bit."""
    import json
    import shutil
    _, d, _, ref_losses = zero_run
    ref_step = _zero_step(setup, 8)
    ref = _leafwise(ref_step, ck.restore_checkpoint(d, ref_step)[0])
    lay = build_zero_layout(setup["params"], 8, 10240, setup["order"])
    assert max(len(s.pieces) for s in lay.slots) == 4
    step = _zero_step(setup, 8, lay)
    state, _ = ck.restore_checkpoint(d, step)
    _assert_same_leaves(_leafwise(step, state), ref)
    ck.save_checkpoint(tmp_path / "span", N, step, state, {})
    _, losses = _run(step, state, setup["batches"][N:])
    np.testing.assert_allclose(losses, ref_losses[N:], rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")
    assert any(len(s[1]) > 1 for s in ck.read_meta(tmp_path / "span")["layout"]["slots"])
    _assert_same_leaves(_leafwise(ref_step, ck.restore_checkpoint(tmp_path / "span", ref_step)[0]), ref)
    np.testing.assert_array_equal(ck.export_checkpoint_params(tmp_path / "span", setup["lay8"])["wte"],
                                  ref[("wte", "master")].reshape(setup["params"]["wte"].shape))
    # the same checkpoint as version 2 wrote it: slots [path, chunk, offset, shape, dtype]
    src, dst = ck.files.step_dir(d, N), ck.files.step_dir(tmp_path / "v2", N)
    shutil.copytree(src, dst)
    with open(f"{dst}/meta.json") as f:
        meta = json.load(f)
    meta["version"] = 2
    meta["layout"]["slots"] = [[path, pieces[0][0], pieces[0][1], shape, dt]
                               for path, pieces, shape, dt in meta["layout"]["slots"]]
    with open(f"{dst}/meta.json", "w") as f:
        json.dump(meta, f)
    sums = ck.files.read_checksums(dst)
    sums[ck.META] = ck.files.file_checksum(f"{dst}/meta.json")
    ck.files.write_checksums(dst, sums)
    assert ck.read_meta(tmp_path / "v2")["layout"] == ck.read_meta(d)["layout"]
    for st in (ref_step, step):  # the saved layout itself, and remapped into spanning chunks
        _assert_same_leaves(_leafwise(st, ck.restore_checkpoint(tmp_path / "v2", st)[0]), ref)


@pytest.mark.parametrize("change", ["n_layers", "vocab"])
def test_other_tree_refused(setup, zero_run, change):
    """Another parameter tree (a leaf missing, a leaf of another shape) is refused with one line
    naming the leaf, before anything is read."""
    _, d, _, _ = zero_run
    cfg = gpt.get_config("micro", **({"n_layers": 3} if change == "n_layers" else {"n_layers": 2, "vocab_size": 256}))
    params = gpt.abstract_params(cfg)
    step = _zero_step(setup, 8, build_zero_layout(params, 8, 32768), stages=gpt.gpt_stages(cfg))
    with pytest.raises(ck.CheckpointError) as e:
        ck.restore_checkpoint(d, step)
    msg = str(e.value)
    assert "\n" not in msg and "another parameter tree" in msg, msg
    if change == "n_layers":
        assert "h_2/" in msg and "not in the checkpoint" in msg, msg
    else:
        assert "leaf wte is (512, 64) float32 in the checkpoint but (256, 64) float32" in msg, msg


def test_other_optimizer_refused(setup, zero_run, single_run):
    """AdamW moments cannot become Lion state, with or without remapping: a clear error before
    any array is read."""
    for d in (zero_run[1], single_run[1]):
        step = _zero_step(setup, 8, tx=optax.lion(1e-4))
        with pytest.raises(ck.CheckpointError, match=r"moments \['mu', 'nu'\] do not match .*\['mu'\]"):
            ck.restore_checkpoint(d, step)


def test_remap_refuses_differing_step_counts(setup, zero_run, single_run, tmp_path):
    """Chunks saved with different optimizer step counts cannot be remapped into another layout
    (a new chunk would mix them): one line; the saved layout itself still restores them."""
    import json
    import shutil
    src = ck.files.step_dir(zero_run[1], N)
    dst = ck.files.step_dir(tmp_path, N)
    shutil.copytree(src, dst)
    with open(f"{dst}/meta.json") as f:
        meta = json.load(f)
    meta["chunks"][1]["count"] = N + 1
    with open(f"{dst}/meta.json", "w") as f:
        json.dump(meta, f)
    sums = ck.files.read_checksums(dst)  # re-sealed: an intact checkpoint with differing counts
    sums[ck.META] = ck.files.file_checksum(f"{dst}/meta.json")
    ck.files.write_checksums(dst, sums)
    with pytest.raises(ck.CheckpointError) as e:
        ck.restore_checkpoint(tmp_path, single_run[0])
    msg = str(e.value)
    assert "\n" not in msg and f"different optimizer step counts [{N}, {N + 1}]" in msg, msg
    st, _ = ck.restore_checkpoint(tmp_path, zero_run[0])
    assert [zero_run[0].checkpoint_chunk(st, c, copy=False)[1]["count"] for c in (0, 1, 2)] == [N, N + 1, N]


def test_remap_host_memory_bounded(setup, zero_run, single_run):
    """Restoring 8 devices (6 chunks of 32768) into one device (chunks of 45000) allocates
    (numpy, traced) at most two saved chunks plus two new ones beyond the restored state: never
    the whole checkpoint."""
    import tracemalloc
    d = zero_run[1]
    step = single_run[0]
    saved_chunk = 4 * 32768 * 4  # params, master, mu, nu (fp32)
    new_chunk = 4 * setup["lay1"].chunk_size * 4
    total = 6 * saved_chunk
    ck.restore_checkpoint(d, step)  # warm orbax
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        st, _ = ck.restore_checkpoint(d, step)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(st.master) == setup["lay1"].n_chunks
    # measured: peak - held 1.1 MB against a bound of 2.5 MB and a checkpoint of 3.1 MB
    assert peak - max(held, base) < 2 * saved_chunk + 2 * new_chunk < total, (peak, held, base)


def test_zero_scheduled_step_roundtrip(setup, zero_run, tmp_path):
    """The ZeRO checkpoint restored into a scheduled ZeRO step on 8 devices (chunks 0, 1 updated
    on the device through optax, the rest per rank by the host AdamW kernel): every value bit for
    bit, and training continues within float32 rounding; saved from there after N more steps and
    restored into the all-device ZeRO step, bit for bit again."""
    from chunkjax.host_update import AdamW, HostAdamState
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.plan import plan_schedule
    zstep, d, _, ref_losses = zero_run
    lay, spec = setup["lay8"], AdamW(2e-3, weight_decay=0.1, max_grad_norm=1.0)
    ab = jax.ShapeDtypeStruct((B // 8, T + 1), jnp.int32)  # one rank's rows
    traces = cj.trace_stages(setup["stages"], lay, ab, jnp.float32)
    cb = cj.chunk_bytes(lay, jnp.float32, state_bytes_per_chunk(spec.optax(), lay.chunk_size))
    sched = plan_schedule(lay, traces, cb, 10**12, flops_per_step=1.0, resident=[0, 1])
    assert set(sched.update_locations) == {"device", "host"}
    step = cj.make_chunked_step(setup["stages"], lay, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                                mesh=data_mesh(jax.devices()[:8]), zero_stage=3)
    ref = _leafwise(zstep, ck.restore_checkpoint(d, zstep)[0])
    state, _ = ck.restore_checkpoint(d, step)
    assert isinstance(state.opt_state[2][0], HostAdamState) and len(state.opt_state[2]) == 8
    assert {m.shape for m in state.master[2]} == {(lay.chunk_size // 8,)}
    step.wait(state)
    got = {k: v for k, v in _leafwise(step, state).items()}
    _assert_same_leaves(got, ref)
    state, losses = _run(step, state, setup["batches"][N:])
    step.wait(state)
    np.testing.assert_allclose(losses, ref_losses[N:], rtol=LOSS_RTOL, err_msg=f"seed {setup['seed']}")
    ck.save_checkpoint(tmp_path, 2 * N, step, state, {})
    assert ck.read_meta(tmp_path)["saved_from"] == {"step": "ChunkedStep", "n_ranks": 8, "zero_stage": 3}
    after = _leafwise(step, state)
    back = _leafwise(zstep, ck.restore_checkpoint(tmp_path, zstep)[0])
    assert after.keys() == back.keys()
    for k, v in after.items():
        np.testing.assert_array_equal(v, back[k], err_msg=str(k))

