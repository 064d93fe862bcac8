"""The disk as a placement of the one plan (issue 24, items 2-4): chunks whose master params and
optimizer state live on storage, updated by the near-storage workers inside the chunked step.

On the CPU memory kinds compile to nothing: these check numerics, the plan's decisions and the
faults; speed and placement are measured on the GPU (experiments/bench.py, docs/benchmarks.md).
"""
import contextlib
import dataclasses
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax.errors import PlanError, format_bytes
from chunkjax.host_update import AdamW
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.storage.tier import IO_THREADS
from chunkjax.plan import plan_schedule
from chunkjax.storage import DiskTier
from chunkjax.storage.files import StorageError, committed_step
from chunkjax.storage.updater import StorageOptions
from models import gpt

from _optax_reference import micro_batch_reference

B, T = 2, 16
STEPS = 20
SPEC = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)  # clipping fires: the norm is global


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.get_config("micro", n_layers=3)
    rng = np.random.default_rng(24)
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(24))  # one program, not an eager compile per op
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32) for _ in range(STEPS)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0])
    layout = cj.build_layout(params, cfg.vocab_size * cfg.d_model // 4, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct(batches[0].shape, jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    return cfg, params, batches, stages, layout, traces, cb


def _three_tier_schedule(setup, host_fraction: float = 0.6):
    """A tide plan with chunk 0 resident, the others offloaded, and a host budget of
    ``host_fraction`` of what they need with their compute copies: below what even every host
    chunk master-fetch needs (:mod:`chunkjax.host_forms`), so some move to disk: device, host
    and storage update locations at once."""
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T, resident=[0], split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    host = int(host_fraction * free.predicted.host_bytes)
    s = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=host, storage_devices=1, **kw)
    assert s.predicted.host_bytes <= host
    return s


def _reference(cfg, params, batches):
    """Plain optax (``SPEC.optax()``) on the device, fp32: final params and losses
    (tests/_optax_reference.py: the loss and gradient program compiled once per process)."""
    p, losses, _ = micro_batch_reference(cfg, params, batches, SPEC.optax())
    return p, losses


def test_device_host_and_storage_chunks_equal_optax(setup, tmp_path):
    """One step whose chunks update on the device, on the host and on storage at once, with
    clip_by_global_norm: 20 steps equal plain optax (fp32 compute: losses rtol 1e-5, master params
    to fp32 rounding, the tolerance of the host-update tests); the disk bytes per step are the
    plan's (padding aside)."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    assert set(sched.update_locations) == {"device", "host", "storage"}, sched.counts()
    n_disk = sched.predicted.storage_chunks
    assert 1 <= n_disk < layout.n_chunks - 1
    assert sched.predicted.disk_bytes_per_step == n_disk * 2 * 3 * layout.chunk_size * 4  # master, m, v each way
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                storage=StorageOptions((str(tmp_path / "d0"), str(tmp_path / "d1")), fsync=False))
    state = step.init(params)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    disk = state.master[sched.update_locations.index("storage")]
    assert disk.committed_step == STEPS
    moved = sum(disk.last.storage_link_bytes.values())
    assert moved == sched.predicted.disk_bytes_per_step  # the chunk size is a multiple of 1024: no padding
    ref_p, ref_losses = _reference(cfg, params, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = step.master_params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    disk.close()


def test_tiny_model_with_storage_is_planned_on_the_device(setup, tmp_path):
    """A model that fits needs no disk: every chunk on the device, and the plan says so in one line."""
    cfg, params, batches, stages, *_ = setup
    step, report, problem = cj.fit_step(stages, params, batches[0], host_optimizer=SPEC, device_budget="1GiB",
                                        host_budget="1GiB", storage=[str(tmp_path / "disk")])
    s = report.schedule
    assert set(s.update_locations) == {"device"} and s.predicted.storage_chunks == 0
    assert s.predicted.disk_bytes_per_step == 0 and s.predicted.time.storage_update_s == 0
    line = cj.fit.describe(report, problem)
    assert "\n" not in line and "storage not needed: " in line, line
    assert "(no host-resident chunks, " in line and "B/param" not in line, line  # ux21: was "0.0 B/param of ..."
    assert f"the plan's {format_bytes(s.predicted.host_bytes)} of host memory fits the host budget of 1.000GiB" \
        in line, line
    assert not os.path.exists(tmp_path / "disk") or not os.listdir(tmp_path / "disk")


def test_summary_gives_disk_chunks_their_own_figure(setup):
    """ux21: the plan's summary line said "0.0 B/param of host-resident chunks" when none were;
    storage chunks got no figure of their own. Right: the host-resident figure only when there are
    host or streamed chunks, and the storage chunks' count and bytes per parameter on disk (master
    params and AdamW m, v: 12 B, the chunk a multiple of 1024 elements: no padding)."""
    import types
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    n_disk = sched.predicted.storage_chunks
    report = cj.fit.FitReport(sched, 10**12, 10**12, 10**12, 0.9, None, (), {}, True, None, ())
    problem = types.SimpleNamespace(cb_rank=cb, layout=layout, n_ranks=1, zero_stage=0, platform="cpu",
                                    storage_dirs=1, host_budget_bytes=None, micro_batches=1)
    line = cj.fit.describe(report, problem)
    want = (f"({sched.predicted.host_resident_bytes_per_param:.1f} B/param of host-resident chunks, {n_disk} storage "
            "chunks at 12.0 B/param on disk, ")
    assert n_disk and "\n" not in line and want in line, line
    host_only = dataclasses.replace(sched, update_locations=tuple("host" if u == "storage" else u
                                                                  for u in sched.update_locations))
    line = cj.fit.describe(dataclasses.replace(report, schedule=host_only), problem)
    assert (f"B/param of host-resident chunks, {len(host_only.master_fetch)} without" in line
            and "storage chunks at" not in line), line


def test_host_budget_too_small_even_with_disk_is_one_line(setup):
    """Offloaded chunks go to disk until the host fits; a host budget below what the host keeps
    anyway (compute params, gradients, staging) or a disk too small for the chunks that must move
    is refused in one line naming the host budget needed."""
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T, storage_devices=1)
    with pytest.raises(PlanError) as e:
        plan_schedule(layout, traces, cb, 1, **kw, host_budget_bytes=10**12)
    floor = e.value.min_budget_bytes  # every chunk offloaded
    fits = plan_schedule(layout, traces, cb, floor, **kw, host_budget_bytes=10**12)
    assert fits.predicted.storage_chunks == 0 and fits.master_fetch == ()
    with pytest.raises(PlanError) as e:
        plan_schedule(layout, traces, cb, floor, host_budget_bytes=1000, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "host budget 1000 bytes" in msg and "storage directory" in msg, msg
    assert "use host_budget >=" in msg
    half = fits.predicted.host_bytes // 2  # below every host chunk master-fetch: some chunks on disk
    s = plan_schedule(layout, traces, cb, floor, host_budget_bytes=half, **kw)
    assert s.predicted.storage_chunks >= 2 and s.predicted.host_bytes <= half
    with pytest.raises(PlanError, match="the least is"):  # a disk that holds one chunk (two versions)
        plan_schedule(layout, traces, cb, floor, host_budget_bytes=half, disk_budget_bytes=2 * cb.state + 1, **kw)
    # the state once on disk (half the space) and the worker's IO_THREADS new files beside their committed ones
    once = (s.predicted.storage_chunks + IO_THREADS) * cb.state + 1
    one = plan_schedule(layout, traces, cb, floor, host_budget_bytes=half, disk_budget_bytes=once, disk_versions=1,
                        **kw)
    assert one.predicted.storage_chunks == s.predicted.storage_chunks
    with pytest.raises(ValueError, match="policy='tide'"):
        plan_schedule(layout, traces, cb, 10**12, policy="fixed", host_budget_bytes=10**9, **kw)


@pytest.mark.parametrize("dirs, disk_chunks, on_disk", [(1, 1, 0), (4, None, 24)])
def test_host_refusal_names_the_least_host_need(setup, dirs, disk_chunks, on_disk):
    """No plan fits the host budget: the error names the least host need among the plans tried,
    not the disk-fullest plan's. With a disk budget of one chunk file, moving that chunk costs its
    worker's staging buffers (3 chunk files) for the state of one chunk: the all-host plan needs
    less (the error used to name the one-storage-chunk plan's need). With 4
    directories and an unbounded disk the least is every chunk on disk. The number is the plans'
    own: a host budget of it plans (``predicted.host_bytes`` equal to it, the chunks per tier the
    message names), one byte less is refused; without storage directories the all-host plan's
    refusal names the same need where the least keeps nothing on disk."""
    import re
    from chunkjax.plan_disk import tiers_line
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T)
    with pytest.raises(PlanError) as e:
        plan_schedule(layout, traces, cb, 1, **kw, host_budget_bytes=10**12, storage_devices=1)
    floor = e.value.min_budget_bytes
    half = plan_schedule(layout, traces, cb, floor, host_budget_bytes=10**12, **kw).predicted.host_bytes // 2
    disk = dict(storage_devices=dirs, disk_budget_bytes=None if disk_chunks is None else 2 * disk_chunks * cb.state + 1)
    with pytest.raises(PlanError) as e:
        plan_schedule(layout, traces, cb, floor, host_budget_bytes=half, **disk, **kw)
    msg, need = str(e.value), e.value.host_need_bytes
    assert "\n" not in msg and f"host budget {half} bytes" in msg, msg
    assert re.search(r"the least is (\d+) bytes", msg).group(1) == str(need), msg
    assert "host_budget >=" in msg and "device_budget" in msg and "micro_batches" in msg and "storage directories" in msg
    least = plan_schedule(layout, traces, cb, floor, host_budget_bytes=need, **disk, **kw)
    assert least.predicted.host_bytes == need and least.predicted.storage_chunks == on_disk
    assert f"the plan of {tiers_line(least)}" in msg, msg
    with pytest.raises(PlanError):
        plan_schedule(layout, traces, cb, floor, host_budget_bytes=need - 1, **disk, **kw)
    if on_disk == 0:
        assert "does not lower it" in msg, msg
        with pytest.raises(PlanError) as e0:
            plan_schedule(layout, traces, cb, floor, host_budget_bytes=half, **kw)
        assert e0.value.host_need_bytes == need


def _state_files(dirs):
    return sorted(f for d in dirs for f in os.listdir(d) if f.endswith(".bin"))


def test_worker_stopped_or_killed_mid_step_then_resume(setup, tmp_path):
    """A worker stopped mid-step (SIGSTOP: no reply within the timeout) or killed (SIGKILL: died)
    fails the step's pending work with one line naming the worker and the last committed step;
    the files stay at that step. A checkpoint saved before, restored into new storage directories,
    continues bit-exactly as an uninterrupted run (the storage chunks' master params and moments
    come from their files)."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup, 0.5)
    disk_c = [c for c, u in enumerate(sched.update_locations) if u == "storage"]

    def make(d, timeout=60.0, keep=True):
        return cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                    storage=StorageOptions((str(d / "a"), str(d / "b")), timeout_s=timeout,
                                                           fsync=False, keep_previous=keep))

    # uninterrupted: 5 steps, a checkpoint after 3
    step = make(tmp_path / "u")
    state = step.init(params)
    for b in batches[:3]:
        state, _ = step(state, b)
    ck.save_checkpoint(tmp_path / "ckpt", 3, step, state)
    at3 = {c: state.master[c].read(c) for c in disk_c}
    for b in batches[3:5]:
        state, _ = step(state, b)
    want = jax.tree.map(np.asarray, step.master_params(state))
    state.master[disk_c[0]].close()

    # stopped worker: the step's pending work fails within the timeout, files stay at step 3
    dirs = [tmp_path / "s" / "a", tmp_path / "s" / "b"]
    step2 = make(tmp_path / "s", timeout=8.0)  # above a spawned worker's start on a busy machine
    st = step2.init(params)
    for b in batches[:3]:
        st, _ = step2(st, b)
    step2.wait(st)
    pid = st.master[disk_c[0]].opt.worker_pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        st, _ = step2(st, batches[3])
        with pytest.raises(StorageError) as e:
            step2.wait(st)
        assert time.monotonic() - t0 < 30
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped and killed by the step's failure
            os.kill(pid, signal.SIGCONT)
    msg = str(e.value)
    assert "\n" not in msg and f"worker 1 (pid {pid}" in msg and "last committed step 3" in msg, msg
    assert "is stopped" in msg and "restore your last checkpoint" in msg and "NearStorageOptimizer" not in msg, msg
    assert committed_step([str(d) for d in dirs]) == 3
    with DiskTier(dirs, [layout.chunk_size] * len(disk_c)) as tier:  # a resume: step 3, the step-4 files gone
        assert tier.committed_step == 3
        assert not any("step000000004" in f for f in _state_files(dirs))
        for k, c in enumerate(disk_c):
            for a, b in zip(tier.read_chunk(k), at3[c]):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))

    # killed worker: one line, "died"
    step3 = make(tmp_path / "k")
    st = step3.init(params)
    st, _ = step3(st, batches[0])
    step3.wait(st)
    pid = st.master[disk_c[0]].opt.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    st, _ = step3(st, batches[1])
    with pytest.raises(StorageError) as e:
        step3.wait(st)
    msg = str(e.value)
    assert "\n" not in msg and "worker 0" in msg and "died" in msg and "last committed step 1" in msg, msg

    # resume: the checkpoint restored into fresh directories, two more steps: bit-exact (with the
    # state once on disk: each chunk's old file deleted once its new one is written)
    step4 = make(tmp_path / "r", keep=False)
    st, _ = ck.restore_checkpoint(tmp_path / "ckpt", step4)
    for c in disk_c:
        for a, b in zip(st.master[c].read(c), at3[c]):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert st.master[disk_c[0]].committed_step == 3
    for b in batches[3:5]:
        st, _ = step4(st, b)
    got = jax.tree.map(np.asarray, step4.master_params(st))  # waits for the last update
    assert len(_state_files([tmp_path / "r" / "a", tmp_path / "r" / "b"])) == len(disk_c)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    st.master[disk_c[0]].close()


def test_failed_init_stops_the_storage_workers_it_started(setup, tmp_path):
    """A ``step.init`` that fails after its storage chunks' workers started (here: the caller's
    ``leaf_init`` raises once they run) stops them before it raises: no state holds them, so
    nothing else would until a garbage collection (session 25)."""
    import multiprocessing
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                storage=StorageOptions((str(tmp_path / "s"),), fsync=False))
    leaves, seen = jax.tree_util.tree_leaves(params), []

    def leaf_init(i):
        seen.extend(p.pid for p in multiprocessing.active_children() if p.name.startswith("near_storage_"))
        if seen:
            raise RuntimeError("leaf_init failed")
        return leaves[i]

    with pytest.raises(RuntimeError, match="leaf_init failed"):
        step.init(leaf_init)
    assert seen, "no storage worker started during the init"
    assert [p.pid for p in multiprocessing.active_children() if p.pid in seen] == []


def test_full_disk_fails_the_step_in_one_line(setup, tmp_path, monkeypatch):
    """A full disk (ENOSPC from the worker's writes: a tiny file-size limit in the worker) fails
    the step with one line naming the directory; the files stay at the last committed step."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    from chunkjax.storage import near
    real = near.NearStorageOptimizer.__init__

    def with_fault(self, *a, **kw):  # the tier's own fault hook: worker 0's file-size limit from step 2
        real(self, *a, _fault=dict(worker=0, fsize_limit_at_step=2, fsize_limit=4096), **kw)

    monkeypatch.setattr(near.NearStorageOptimizer, "__init__", with_fault)
    d = tmp_path / "full"
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                storage=StorageOptions((str(d),), fsync=False))
    st = step.init(params)
    st, _ = step(st, batches[0])
    step.wait(st)
    st, _ = step(st, batches[1])
    with pytest.raises(StorageError) as e:
        step.wait(st)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg and "full" in msg and "last committed step 1" in msg, msg
    # what happened once, the advice of the API called (a ChunkedStep: restore a checkpoint)
    assert "while writing chunk" in msg and "for step 2" in msg and msg.count("committed step") == 1, msg
    assert "preparing" not in msg and "NearStorageOptimizer" not in msg and "restore your last checkpoint" in msg
    assert committed_step([str(d)]) == 1
    # the step object is dead: a checkpoint of it raises the same line and writes nothing
    with pytest.raises(StorageError, match="restore your last checkpoint"):
        ck.save_checkpoint(tmp_path / "ckpt", 2, step, st)
    assert not (tmp_path / "ckpt").exists()  # not even an empty directory (a fresh user's session-18 report)
    st.master[sched.update_locations.index("storage")].close()


def test_storage_options_and_step_checks(setup, tmp_path):
    """Bad storage input is refused in one line before any file or process."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    with pytest.raises(ValueError, match="no storage directories"):
        cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, storage=[str(f)])
    with pytest.raises(ValueError, match="AdamW"):
        cj.make_chunked_step(stages, layout, sched, host_optimizer=cj.host_update.Lion(1e-3),
                             storage=[str(tmp_path / "d")])
    s = dataclasses.replace(sched)
    assert s.to_dict()["predicted"]["disk_bytes_per_step"] == sched.predicted.disk_bytes_per_step
    assert cj.Schedule.from_dict(s.to_dict()) == s


def test_disk_overlap_step_time_by_hand():
    """The disk tier's cost model (docs/storage.md): one storage device at 1 GB/s each way, three
    chunk files of 0.5 GB, 3 staging buffers, forward 1 s and backward 3 s (the norm at 4 s).
    After the norm: reads of chunks 0 and 1 in [0, 1] s (read-ahead), kernels at 4 s, write 0
    [4, 4.5], read 2 [4.5, 5], write 1 [5, 5.5]: the last params are back at 5 s, 1 s exposed,
    the last write runs on into the next step. Norm-free early path (gradients at 2, 3, 4 s):
    write 0 [2, 2.5], read 2 [2.5, 3], write 1 [3, 3.5], kernel 2 at 4 s: nothing exposed.
    Four such files on one device (8 s of disk a step) are disk-bound: the step is 8 s."""
    from chunkjax.cost import Rates, disk_step_times, predict_pipelined_step
    r = Rates(matmul_flops_per_s=1e12, disk_read_bytes_per_s=1e9, disk_write_bytes_per_s=1e9)
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, host_ready=(), rates=r,
              storage=[(1 / 3, 0), (2 / 3, 0), (1.0, 0)], disk_file_bytes=5 * 10**8, staging_buffers=3)
    late = predict_pipelined_step(3e12, **kw)
    assert (late.forward_s, late.backward_s) == (1.0, 3.0)
    assert late.storage_update_s == pytest.approx(3.0) and late.storage_exposed_s == pytest.approx(1.0)
    assert late.storage_hidden_s == pytest.approx(2.0) and late.step_s == pytest.approx(5.0)
    early = predict_pipelined_step(3e12, storage_early=True, **kw)
    assert early.storage_exposed_s == pytest.approx(0.0) and early.step_s == pytest.approx(4.0)
    assert early.storage_hidden_s == pytest.approx(3.0)
    busy, exposed = disk_step_times([[4.0] * 4], file_bytes=10**9, staging_buffers=3, kernel_s=0.0,
                                    backward_end=4.0, rates=r)
    assert (busy, exposed) == (pytest.approx(8.0), pytest.approx(4.0))  # step 4 + 4 = 8 s = the disk's work
    # two devices share the work: 4 s of disk each, all behind this step and the next one's compute
    assert disk_step_times([[4.0] * 2] * 2, file_bytes=10**9, staging_buffers=3, kernel_s=0.0, backward_end=4.0,
                           rates=r) == (pytest.approx(4.0), pytest.approx(0.0))
    d = late.to_dict()
    assert d["storage_exposed_s"] == pytest.approx(1.0) and d["step_s"] == pytest.approx(5.0)


def test_near_storage_begin_finish_in_gradient_order(tmp_path):
    """The workers' step in two phases: ``begin`` (reads start, no gradient or norm yet) and
    ``finish`` with the gradients in any order, as pairs that come one by one; a non-finite norm
    skips the step unwritten, ``abandon`` drops a begun step, a norm-free step takes its scalars
    with the header. Every path gives the same bits as ``step``. The read-ahead fills the staging
    buffers up to their bound before the step's first message."""
    from chunkjax.storage.near import NearStorageOptimizer
    from chunkjax.storage.pool import SKIP_STEP
    rng = np.random.default_rng(0)
    sizes = [4096] * 5
    init = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    grads = [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(3)]
    spec = AdamW(1e-2, weight_decay=0.1)

    def run(d, phased):
        kw = dict(init_params=init, fsync=False, timeout_s=60.0, param_dtype="float32")
        with NearStorageOptimizer([str(d / "a"), str(d / "b")], sizes, spec, **kw) as opt:
            for g in grads:
                norm = float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float32)) for x in g)))
                if not phased:
                    opt.step(g, norm=norm)
                    continue
                order = [4, 2, 0, 3, 1]
                opt.begin(order)
                assert opt.finish({c: g[c] for c in range(5)}, norm=float("inf")).skipped  # nothing changes
                opt.begin(order)
                opt.abandon()
                opt.begin(order, norm_free=True)  # no clipping: scalars with the header
                opt.finish(((c, g[c]) for c in reversed(order)), norm=None)
            assert opt.committed_step == 3
            return opt.read_state()

    want, got = run(tmp_path / "s", False), run(tmp_path / "p", True)
    for c in want:
        for a, b in zip(want[c], got[c]):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    with NearStorageOptimizer([str(tmp_path / "s" / "a"), str(tmp_path / "s" / "b")], sizes, spec,
                              fsync=False, timeout_s=60.0) as opt:  # a begun norm-free step ended unwritten
        opt.begin(norm_free=True)
        r = opt.finish(iter([(0, grads[0][0]), SKIP_STEP]), norm=None)
        assert r.skipped and opt.committed_step == 3
        with pytest.raises(ValueError, match="every chunk once"):
            opt.begin([0, 1])
        # read-ahead: before any gradient or norm, each worker fills all but one of its 3 staging
        # buffers (worker 0 holds chunks 0, 2, 4; worker 1 chunks 1, 3): 2 chunk files each, no more
        opt.begin()
        time.sleep(3.0)  # the reads of 4 files of 48 KiB
        r = opt.finish(dict(enumerate(grads[0])), norm=1.0)
        assert r.read_ahead_bytes == 4 * 3 * 4096 * 4 and opt.committed_step == 4


def test_early_storage_updates_equal_the_after_norm_path(setup, tmp_path):
    """A norm-free update (AdamW without clipping, one micro-batch, no skip) sends each storage
    chunk's gradient as the program completing it ends, before the global norm is known: master
    params and moments bit-identical to the after-norm path over 3 steps."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    spec = AdamW(3e-3, weight_decay=0.1)
    disk_c = [c for c, u in enumerate(sched.update_locations) if u == "storage"]

    def run(d, early):
        step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.float32,
                                    storage=StorageOptions((str(d / "a"), str(d / "b")), fsync=False,
                                                           early_updates=early))
        st = step.init(params)
        for b in batches[:3]:
            st, _ = step(st, b)
        got = jax.tree.map(np.asarray, step.master_params(st))
        disk = st.master[disk_c[0]]
        out = (got, {c: disk.read(c) for c in disk_c}, disk.sent_before_norm, disk.committed_step)
        disk.close()
        return out

    a, b = run(tmp_path / "e", True), run(tmp_path / "l", False)
    assert a[2] == len(disk_c) and b[2] == 0 and a[3] == b[3] == 3
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
    for c in disk_c:
        for x, y in zip(a[1][c], b[1][c]):
            np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


def test_storage_chunks_with_micro_batches_equal_optax(setup, tmp_path):
    """With micro-batches the workers read their chunks' state during the accumulation (the
    step's norm comes after every micro-batch): 4 steps of 2 micro-batches with clipping equal
    optax on the whole batch (the 20-step test's tolerances), and the staging buffers held
    state when the scalars came, at most their bound (2 chunk files per worker)."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32, micro_batches=2,
                                storage=StorageOptions((str(tmp_path / "a"), str(tmp_path / "b")), fsync=False))
    st = step.init(params)
    losses = []
    for b in batches[:4]:
        st, m = step(st, b)
        losses.append(float(m["loss"]))
    got = step.master_params(st)
    disk = st.master[sched.update_locations.index("storage")]
    assert disk.committed_step == 4 and len(disk.history) == 4 and disk.sent_before_norm == 0
    file = 3 * layout.chunk_size * 4
    assert all(0 < r.read_ahead_bytes <= 2 * 2 * file for r in disk.history)
    ref_p, ref_losses = _reference(cfg, params, batches[:4])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    disk.close()


def test_disk_placement_moves_the_fewest_chunks_under_a_stepped_host_measure(setup):
    """The host measure of a GPU run falls by steps (the runtime's pinned pool, a power of two,
    halves as chunks leave the host): the first estimate of how many chunks go to disk then
    overshot (8B full fine-tuning at 24 GiB: 45 of 131 offloaded chunks on disk with 23 GB of
    the host budget unused). Right: the fewest chunks whose measure fits: one chunk fewer on disk
    does not fit."""
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T, resident=[0], split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    unit = free.predicted.host_bytes

    def stepped(s):  # a pool-like jump: 8x the bytes while more than one offloaded chunk stays on the host
        on_host = sum(u == "host" for u in s.update_locations)
        return s.predicted.host_bytes * (8 if on_host > 1 else 1)

    budget = int(0.9 * unit)
    s = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=budget, storage_devices=1,
                      host_bytes_of=stepped, **kw)
    assert stepped(s) <= budget
    n = s.predicted.storage_chunks
    assert 1 <= n
    on_host = sum(u == "host" for u in s.update_locations)
    assert on_host == 1, s.counts()  # the jump allows one host chunk: every other offloaded chunk on disk, no more


def test_job_with_storage_samples_and_exports_as_without(tmp_path):
    """``python -m experiments.train --init-from <folder> --storage DIR``: the job's own reading of
    the master params (the sample before and after, the Hugging Face export) crashed on storage
    chunks (their master is in a file: ``TypeError ... numpy.ndarray`` in ``layout.unpack``). Right:
    the run samples and exports, and the export equals the same run's without the disk tier (fp32
    tolerance: the near-storage worker runs the host kernel on the same inputs). Its report.json
    has the disk bytes per step, the plan's and the last step's read and written. The job stops its
    near-storage workers before it returns (with the garbage collector off: nothing else would stop
    them before a later collection; session 25, a worker alive in a later test of the xdist worker)."""
    import gc
    import json
    import multiprocessing
    import shutil

    from experiments import train
    from models import hf
    src = tmp_path / "ck"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama3"), src)
    words = "the sea of troubles arms fortune slings and arrows outrageous mind to be or not question".split()
    rng = np.random.default_rng(5)
    (tmp_path / "t.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(40)))
    runs = {}
    for name, extra in (("disk", ["--storage", str(tmp_path / "store"), "--host-budget", "200KiB"]), ("host", [])):
        out = tmp_path / name
        gc.disable()
        try:
            rc = train.main(["--init-from", str(src), "--data", str(tmp_path / "t.txt"), "--steps", "3", "--batch",
                             "2", "--seq", "32", "--eval-every", "3", "--eval-batches", "1", "--sample-tokens", "4",
                             "--lr", "3e-3", "--warmup", "0", "--no-progress", "--out-dir", str(out),
                             "--checkpoint-every", "0", "--compute-dtype", "float32"] + extra)
            alive = [p.pid for p in multiprocessing.active_children() if p.name.startswith("near_storage_")]
        finally:
            gc.enable()
        assert rc == 0
        assert alive == [], f"near-storage workers {alive} alive after the {name} job returned"
        (run,) = out.iterdir()
        rep = json.loads((run / "report.json").read_text())
        runs[name] = (run, rep)
    disk_rep = runs["disk"][1]
    assert disk_rep["placement_counts"].get("params_pinned_host/update_storage", 0) >= 1, disk_rep["placement_counts"]
    assert runs["host"][1]["placement_counts"].get("params_pinned_host/update_storage", 0) == 0
    assert disk_rep["sample_before"] and disk_rep["sample"]
    # report.json's disk bytes (ux20: it had none): the plan's, every storage chunk's file (float32 master,
    # m, v, each padded to 4096 bytes) read once and written once; and the last step's reads and writes
    n_disk = disk_rep["placement_counts"]["params_pinned_host/update_storage"]
    file_bytes = 3 * -(-disk_rep["chunk_size"] * 4 // 4096) * 4096
    assert disk_rep["storage_chunks"] == n_disk
    assert disk_rep["disk_bytes_per_step_accounted"] == 2 * n_disk * file_bytes == \
        disk_rep["fit"]["disk_bytes_per_step_predicted"]
    assert disk_rep["disk_read_bytes_per_step_measured"] == disk_rep["disk_written_bytes_per_step_measured"] \
        == n_disk * file_bytes
    assert disk_rep["disk_bytes_per_step_measured"] == disk_rep["disk_bytes_per_step_accounted"]
    host_rep = runs["host"][1]
    assert host_rep["storage_chunks"] == 0 and host_rep["disk_bytes_per_step_accounted"] == 0
    assert host_rep["disk_bytes_per_step_measured"] is None and host_rep["disk_written_bytes_per_step_measured"] is None
    a, b = hf.open_hf_checkpoint(runs["disk"][0] / "hf"), hf.open_hf_checkpoint(runs["host"][0] / "hf")
    assert sorted(a.entries) == sorted(b.entries)
    for n in a.entries:
        np.testing.assert_allclose(a.tensor(n).astype(np.float32), b.tensor(n).astype(np.float32), rtol=1e-5, atol=1e-6)


def test_hung_worker_is_named_at_a_tiny_host_deadline(setup, tmp_path, monkeypatch):
    """A worker that hangs mid-step (alive, not stopped: the tier's sleep hook) is named (index,
    pid, directory) in the step's host deadline error, and the step's later calls fail with its
    storage error (the host deadline set tiny after the first step); no host-update thread of the
    step is left running after them (session 25: one idled on forever)."""
    cfg, params, batches, stages, layout, traces, cb = setup
    sched = _three_tier_schedule(setup)
    from chunkjax.storage import near
    from chunkjax.updaters import HostDeadlineError
    from chunkjax import host_work
    before = set(host_work.live_threads())  # idle threads of steps other tests of this process left unjoined
    real = near.NearStorageOptimizer.__init__
    marker = tmp_path / "hung"

    def with_fault(self, *a, **kw):  # worker 0 sleeps after its first chunk of step 2
        real(self, *a, _fault=dict(worker=0, step=2, after_chunks=1, marker=str(marker), sleep_s=3600), **kw)

    monkeypatch.setattr(near.NearStorageOptimizer, "__init__", with_fault)
    d = tmp_path / "h"
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                storage=StorageOptions((str(d),), fsync=False))
    st = step.init(params)
    st, _ = step(st, batches[0])
    step.wait(st)
    object.__setattr__(step, "host_deadline", 0.2)  # tiny: the hung worker cannot answer within it
    pid = st.master[sched.update_locations.index("storage")].opt.worker_pids[0]
    st, _ = step(st, batches[1])
    with pytest.raises(HostDeadlineError) as e:
        step.wait(st)
    msg = str(e.value)
    assert "\n" not in msg and f"near-storage worker 0 (pid {pid}, {d})" in msg and "has not answered" in msg, msg
    with pytest.raises(StorageError, match=f"worker 0 \\(pid {pid}.*restore your last checkpoint"):
        st.master[sched.update_locations.index("storage")].wait()
    assert committed_step([str(d)]) == 1
    left = set(host_work.live_threads()) - before  # the abandoned host thread ends once its wait failed
    for t in left:
        t.join(10)
    assert not [t for t in left if t.is_alive()], "the step's host-update thread outlived its deadline error"


def test_close_names_disk_work_that_never_ends_and_kills_its_workers(tmp_path):
    """DiskState.close waits for the last step's disk work at most the tier's ``timeout_s``
    (StorageOptions.timeout_s): work that never ends (here a step begun whose gradients never
    come: the worker waits in its step) is named in one RuntimeWarning line with what to do,
    its worker is killed (the conftest checks that none is left) and the directory stays at the
    last committed step. Before: close waited forever."""
    import concurrent.futures
    import threading
    import warnings

    from chunkjax.storage.near import NearStorageOptimizer
    from chunkjax.storage.updater import DiskState
    d = tmp_path / "w"
    opt = NearStorageOptimizer([str(d)], [64], AdamW(1e-3), init_params=[np.zeros(64, np.float32)], fsync=False,
                               timeout_s=60.0)
    opt.timeout_s = 0.5  # the bound of close's wait (after the worker's start)
    pids = opt.worker_pids
    opt.begin()  # the worker reads ahead and waits for gradients that never come
    disk = DiskState(opt, [0])
    disk.tail = concurrent.futures.Future()  # the step's disk work: never ends
    caught = []

    def close():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            disk.close()
        caught.extend(w)

    t0 = time.monotonic()
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(60)
    if closer.is_alive():
        for p in opt.workers:
            p.kill()
        pytest.fail("DiskState.close still waits for disk work that never ends after 60 s")
    assert time.monotonic() - t0 < 30
    assert [w.category for w in caught] == [RuntimeWarning], caught
    msg = str(caught[0].message)
    assert "\n" not in msg and "DiskState.close" in msg and "timeout_s=0.5 s" in msg and f"pids {pids}" in msg, msg
    assert "last committed step 0" in msg and "NearStorageOptimizer" in msg, msg  # where a resume starts, how
    assert not any(p.is_alive() for p in opt.workers)
    assert committed_step([str(d)]) == 0


_UNGUARDED = """
import numpy as np
from chunkjax.host_update import AdamW
from chunkjax.storage.near import NearStorageOptimizer
opt = NearStorageOptimizer([{d!r}], [64], AdamW(1e-3), init_params=[np.zeros(64, np.float32)], fsync=False)
"""
_ORPHAN = """
import os, signal
import numpy as np
from chunkjax.host_update import AdamW
from chunkjax.storage.near import NearStorageOptimizer
if __name__ == "__main__":
    opt = NearStorageOptimizer([{d!r}], [64], AdamW(1e-3), init_params=[np.zeros(64, np.float32)], fsync=False)
    opt.begin()  # the worker waits for this step's gradients when the trainer dies
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text.format(d=str(tmp_path / name.replace(".py", "_dir"))))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    import subprocess
    import sys
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)


def test_script_without_main_guard_and_orphaned_worker(tmp_path):
    """A script that starts the disk tier at import (no ``if __name__ == "__main__":``) fails in
    one line saying to add the guard, without Python's bootstrapping RuntimeError; a worker whose
    trainer was killed mid-step exits without a traceback."""
    r = _script(tmp_path, "unguarded.py", _UNGUARDED)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert 'put the training code under if __name__ == "__main__":' in last, r.stderr[-2000:]
    assert "RuntimeError" not in r.stderr and "bootstrapping" not in r.stderr, r.stderr[-2000:]
    r = _script(tmp_path, "orphan.py", _ORPHAN)
    assert r.returncode == -signal.SIGKILL
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr[-2000:]


def test_storage_inputs_refused_in_the_callers_terms(setup, tmp_path):
    """The front door's inputs with storage, each refused in one line before any file or process:
    an optax tx (the disk tier updates on the host), an uncreatable directory (not a budget
    error), an empty directory name, an example batch of 0 rows."""
    cfg, params, batches, stages, *_ = setup
    fit = lambda batch=batches[0], **kw: cj.fit_step(stages, params, batch, device_budget="1GiB", **kw)  # noqa: E731
    cases = [(dict(tx=optax.adamw(1e-3), host_budget="1GiB", storage=[str(tmp_path / "a")]),
              "the disk tier updates on the host: pass a host optimizer such as chunkjax.host_update.AdamW"),
             (dict(host_optimizer=SPEC, host_budget="1GiB", storage=["/proc/x"]), "'/proc/x' cannot be created"),
             (dict(host_optimizer=SPEC, host_budget="1GiB", storage=[""]), "is empty: give a directory path"),
             (dict(host_optimizer=SPEC, host_budget="1GiB", storage=[str(tmp_path / "b")],
                   batch=jnp.zeros((0, T + 1), jnp.int32)), "the example batch has 0 rows")]
    for kw, want in cases:
        with pytest.raises(ValueError) as e:
            fit(**kw)
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_plan_counts_one_worker_per_storage_directory(setup, tmp_path):
    """The runtime starts one near-storage worker per storage directory, whatever filesystem
    holds it; the plan counted the distinct filesystems (issue 24 host accounting). Two
    directories on one filesystem: the plan's workers, their staging buffers and their process
    bytes are two workers', and the step it builds starts exactly that many."""
    from chunkjax import fit
    from chunkjax.host_memory import schedule_host_need, storage_host_bytes, storage_process_bytes
    from chunkjax.predict import STORAGE_STAGING_BUFFERS, disk_file_bytes
    cfg, params, batches, stages, layout, traces, cb = setup
    kw = dict(host_optimizer=SPEC, compute_dtype=jnp.float32, chunk_size=layout.chunk_size, check_host=False)
    free = fit.plan(fit.prepare(stages, params, batches[0], host_budget=None, **kw), 10**12, resident=[0], split=False)
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]  # one filesystem
    problem = fit.prepare(stages, params, batches[0], host_budget=int(0.6 * free.predicted.host_bytes),
                          storage=StorageOptions(tuple(dirs), fsync=False), **kw)
    assert (problem.storage_devices, len(problem.storage.dirs), problem.storage_dirs) == (1, 2, 2)
    s = fit.plan(problem, 10**12, resident=[0], split=False)
    p = s.predicted
    assert p.storage_chunks >= 1 and p.storage_workers == 2
    assert p.storage_host_bytes == storage_host_bytes(disk_file_bytes(cb), 2, STORAGE_STAGING_BUFFERS)
    need = schedule_host_need(s, cb, layout=layout, platform="cpu")
    one = schedule_host_need(dataclasses.replace(s, predicted=dataclasses.replace(p, storage_workers=1)), cb,
                             layout=layout, platform="cpu")
    assert need["process_bytes"] - one["process_bytes"] == storage_process_bytes(2, cb.grad) - storage_process_bytes(
        1, cb.grad) > 0
    step = fit.build_step(problem, s)
    state = step.init(params)
    disk = state.master[s.update_locations.index("storage")]
    assert len(disk.opt.workers) == p.storage_workers  # what the runtime started
    disk.close()
