"""The host-memory ledger and the host state made resident at init (issue 24).

GPT3_15B host-only on the H200 was killed by the kernel's OOM killer in its first step: its host
chunks' Adam m and v (``np.zeros``: pages the kernel supplies only when first written) entered the
RSS there, not at init. These tests read ``RssAnon`` (``/proc/self/status``): the optimizer state
is resident right after ``step.init``, and the RSS a small model's run grows by from before its
step is built to after its first steps stays within the plan's accounted host bytes plus the
process allowance the plan states (``process_bytes``).
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import updaters as upd
from chunkjax.host_ledger import HostLedger, release_free_heap, rss_parts
from chunkjax.host_memory import HostMemoryError, PINNED_PARTS, schedule_host_parts
from chunkjax.host_update import AdamW
from chunkjax.topology import SingleDevice
from models import gpt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or rss_parts() is None,
                                reason="reads /proc/self/status (Linux)")

#: Elements per chunk: each float32 moment (40 MB) is above glibc's largest mmap threshold (32 MiB),
#: so ``np.zeros`` maps fresh pages that are resident only once written.
CHUNK = 10 * 2**20


def test_ledger_marks_phases_and_reports_json():
    lines = []
    led = HostLedger(echo=lines.append)
    release_free_heap()  # an earlier test's freed heap pages would be reused without growing the RSS
    led.mark("a")
    x = np.ones(CHUNK, np.float32)  # 40 MB written: resident
    led.mark("b")
    led.account({"optimizer_state": 8 * CHUNK, "process": 2**30})
    g = led.growth("a", "b")
    assert g["anon_bytes"] >= 0.9 * x.nbytes
    assert len(lines) == 3 and lines[0].startswith("[host-ledger] a: anon") and "plan accounts" in lines[2]
    assert " GB" not in "".join(lines) and lines[2].startswith(
        f"[host-ledger] plan accounts {(8 * CHUNK + 2**30) / 2**30:.2f} GiB of host: "), lines  # GiB, as budgets (ux20)
    d = json.loads(json.dumps(led.to_dict()))
    assert [p["phase"] for p in d["phases"]] == ["a", "b"] and d["accounted"]["process"] == 2**30
    assert led.growth("a", "missing") is None
    assert release_free_heap() is None or release_free_heap() >= 0


def test_host_updater_init_makes_the_optimizer_state_resident():
    init = upd.host_updater(SingleDevice(), AdamW(1e-3), CHUNK, jnp.bfloat16).init
    buf = np.full(CHUNK, 0.5, np.float32)
    release_free_heap()  # as above: the state's pages must be new ones
    before = rss_parts()["anon_bytes"]
    master, st = init(buf, 0)
    grown = rss_parts()["anon_bytes"] - before
    assert st.m.nbytes + st.v.nbytes == 8 * CHUNK
    assert grown >= 0.95 * 8 * CHUNK, f"RssAnon grew by {grown} bytes at init, the state is {8 * CHUNK}"
    assert not st.m.any() and not st.v.any() and master is buf


def test_host_updater_init_refuses_a_state_the_host_cannot_hold():
    # a reserve above MemAvailable: the plan's post-init need does not fit beside the state
    init = upd.host_updater(SingleDevice(), AdamW(1e-3), 1024, jnp.bfloat16, reserve_bytes=2**60).init
    with pytest.raises(HostMemoryError, match="host chunk 7's optimizer state") as e:
        init(np.zeros(1024, np.float32), 7)
    assert "\n" not in str(e.value) and e.value.available_bytes > 0


@pytest.fixture(scope="module")
def run():
    """A ~3.5M-parameter GPT with every chunk's state on the host, two steps, its ledger."""
    cfg = gpt.get_config("micro", d_model=512, n_layers=1, n_heads=8)
    params = jax.tree.map(np.asarray, gpt.init_params(cfg, jax.random.key(0)))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    led = HostLedger()
    release_free_heap()
    led.mark("before")
    step, report, problem = cj.fit_step(gpt.gpt_stages(cfg), params, batch, host_optimizer=AdamW(1e-3),
                                        device_budget="60MiB", chunk_size=CHUNK // 8)
    parts = schedule_host_parts(report.schedule, problem.cb, platform="cpu")
    led.account(dict(parts, process=report.host["process_bytes"]))
    release_free_heap()  # what building freed goes back to the kernel: init's growth is not hidden by reuse
    led.mark("built")
    state = step.init(params)
    led.mark("init")
    losses = []
    for i in range(2):
        state, m = step(state, batch)
        step.wait(state)
        losses.append(float(m["loss"]))
        led.mark(f"step {i + 1}")
    return report, problem, parts, led, losses


def test_parts_sum_to_the_host_need(run):
    report, _, parts, _, _ = run
    h = report.host
    assert sum(parts[k] for k in PINNED_PARTS) == h["pinned_host_bytes"]
    assert sum(v for k, v in parts.items() if k not in PINNED_PARTS and k != "device_on_host") == h["pageable_bytes"]
    assert parts["device_on_host"] == h["device_on_host_bytes"]
    assert report.schedule.update_locations.count("host") >= 2 and parts["optimizer_state"] > 0


def test_state_is_resident_at_init_and_rss_within_the_plan(run):
    report, problem, parts, led, losses = run
    assert np.isfinite(losses).all()
    at_init = led.growth("built", "init")["anon_bytes"]
    # at init: compute params, master params and the (written) optimizer state of every offloaded chunk
    placed = parts["pinned_params"] + parts["pinned_masters"] + parts["streamed_state"] + parts["host_masters"]
    assert at_init >= parts["optimizer_state"] + 0.9 * placed, (at_init, parts)
    # from before the step was built to after two steps: the plan's model data and device bytes plus the
    # process allowance the plan states (compiler, runtime, two float32 chunks of initialisation)
    run_growth = led.growth("before", "step 2")["resident_bytes"]
    accounted = report.host["need_bytes"]
    assert run_growth <= accounted, (run_growth, led.to_dict())


def _reset_peak_rss() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0: ``clear_refs`` 5), as the
    benchmark's fresh worker process starts; skip where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS here ({e}); the bench worker runs in a fresh process")


def test_bench_worker_prints_the_plan_before_the_first_step(capsys):
    """The benchmark's chunkjax worker: the plan's host parts on stderr after compiling, before the
    init and the first step (a run the OOM killer ends has shown them), the ledger in its record."""
    import types

    from _shared_data import two_block_micro
    from experiments import bench_chunkjax
    _reset_peak_rss()  # VmHWM is the process's: an earlier test in this worker may have set it higher
    args = types.SimpleNamespace(worker="chunkjax", model="micro", batch=2, seq=32, steps=1, seed=0,
                                 budget_bytes=2**30, compile_only=False, zero_h2d_path=None, host_limit_gb=110,
                                 run_id="t")
    with two_block_micro():  # the order of the worker's phases does not depend on the depth: smaller programs
        rec = bench_chunkjax.run_chunkjax(args)
    assert rec["feasible"], rec.get("error")
    # the global gradient norm of the warm-up and the timed step (the step's own, checked against
    # plain JAX's in test_bench), recorded beside the losses
    assert len(rec["grad_norms"]) == len(rec["losses"]) == 2 and all(0 < g < float("inf") for g in rec["grad_norms"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[host-ledger]")]
    first = lambda what: next(i for i, l in enumerate(err) if l.startswith(f"[host-ledger] {what}"))  # noqa: E731
    assert first("plan accounts") < first("init") < first("step 1"), err
    led = rec["host_ledger"]
    assert {"start", "plan", "compile", "init", "step 1", "step 2"} <= {p["phase"] for p in led["phases"]}
    assert led["accounted"]["total_bytes"] == rec["host_bytes_accounted"] + led["accounted"]["process_allowance"] \
        + led["accounted"]["device_on_host"] + led["accounted"]["pinned_pool_rounding"]
    # the peak RSS (VmHWM, mapped libraries included) within what the process held when it planned plus the need
    assert rec["host_rss_peak_bytes_measured"] <= led["accounted"]["predicted_peak_bytes"], led


def test_bench_driver_keeps_a_killed_workers_ledger(tmp_path, capsys):
    from experiments import bench
    lines = ["[host-ledger] plan accounts 118.54 GB of host: optimizer_state 76.0",
             "[host-ledger] step 1: anon 61.26 GB, shmem 40.25 GB, peak 101.5 GB, MemAvailable 0.20 GB (271.0 s)"]

    def runner(argv, env, timeout, log_path=None):
        if "--probe" in argv:
            return {"rc": 0, "json": {"matmul_tflops": 10.0}, "stderr_tail": []}
        return {"rc": -9, "json": None, "stderr_tail": lines + ["Killed"], "ledger": lines}

    argv = ["--largest", "--systems", "chunkjax", "--largest-models", "micro", "--largest-seq", "16",
            "--run-id", "K", "--results-dir", str(tmp_path)]
    assert bench.main(argv, runner=runner) == 0
    tried = json.loads((tmp_path / "bench_K.json").read_text())["largest"]["chunkjax"]["tried"]["micro"]
    assert not tried["ok"] and tried["host_ledger"] == lines
    assert "[bench] chunkjax: [host-ledger] step 1: anon 61.26 GB" in capsys.readouterr().out


def test_transfer_window_waits_for_the_oldest_beyond_its_depth():
    """memory.TransferWindow: at most ``depth`` placed chunks pending; the ones it waited for are
    the oldest, the array comes back unchanged, and a depth below 1 is refused."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from chunkjax.memory import TransferWindow

    waited = []
    real = jax.block_until_ready

    def spy(x):
        waited.append([id(a) for a in x])
        return real(x)

    w = TransferWindow(depth=2)
    xs = [jnp.full((4,), float(i)) for i in range(5)]
    jax_block = jax.block_until_ready
    try:
        jax.block_until_ready = spy
        outs = [w.add(x) for x in xs]
        w.add(np.zeros(3))  # not a jax array: nothing pending for it
    finally:
        jax.block_until_ready = jax_block
    assert all(o is x for o, x in zip(outs, xs))
    assert waited == [[id(xs[0])], [id(xs[1])], [id(xs[2])]]
    assert len(w._pending) == 2
    with pytest.raises(ValueError, match="at least 1"):
        TransferWindow(depth=0)


def test_init_reserve_counts_only_the_pinned_pools_growth_still_possible(monkeypatch):
    """On a GPU the host gradients' working set is pinned: once the pool holds (nearly) its cap,
    the guard reserves only what the pool can still grow, so a plan whose pool already holds the
    working set is not refused (GPT3_15B, session 15), and one that still needs the growth is."""
    from chunkjax import host_memory as hm

    gib = 2**30
    env = {hm.PINNED_HOST_LIMIT_ENV: "40"}

    class Sched:
        class predicted:
            host_working_bytes = int(7.6 * gib)
            peak_device_bytes = 3 * gib

    r = hm.init_reserve_bytes(Sched, "gpu", env)
    assert r.bytes_now(shmem_bytes=40 * gib) == hm.INIT_MIN_FREE_BYTES  # the pool is at its cap
    assert r.bytes_now(shmem_bytes=35 * gib) == 5 * gib + hm.INIT_MIN_FREE_BYTES  # 5 GiB of growth left
    assert r.bytes_now(shmem_bytes=gib) == int(7.6 * gib) + hm.INIT_MIN_FREE_BYTES  # the whole working set
    cpu = hm.init_reserve_bytes(Sched, "cpu")
    assert cpu.bytes_now(shmem_bytes=40 * gib) == int(10.6 * gib) + hm.INIT_MIN_FREE_BYTES  # pageable: always
    # the guard reads it when it checks: 8 GiB available, 0.4 GiB to place
    monkeypatch.setattr(hm, "host_memory_available_bytes", lambda: 8 * gib)
    monkeypatch.setattr(hm, "_rss_shmem_bytes", lambda: 40 * gib)
    hm.check_materialise(int(0.4 * gib), r, "host chunk 313's optimizer state")
    monkeypatch.setattr(hm, "_rss_shmem_bytes", lambda: 20 * gib)
    with pytest.raises(hm.HostMemoryError, match="host chunk 313"):
        hm.check_materialise(int(0.4 * gib), r, "host chunk 313's optimizer state")


def test_init_guard_needs_what_the_plan_needs(monkeypatch):
    """The init's guard counts the need as the plan does (:func:`host_need`): on a GPU the rest of
    the system grows by ``SYSTEM_HOST_SHARE`` of the run beside it, so what is placed and what the
    first step still takes come with that share (the guard used to leave it out and let through
    an init the plan's own accounting refuses); on the CPU there is no share."""
    from chunkjax import host_memory as hm

    gib = 2**30
    env = {hm.PINNED_HOST_LIMIT_ENV: "40"}

    class Sched:
        class predicted:
            host_working_bytes = 8 * gib
            peak_device_bytes = 3 * gib

    r = hm.init_reserve_bytes(Sched, "gpu", env)
    run = gib + 8 * gib  # one chunk placed now, the whole working set still to come (the pool has 1 GiB)
    plan_need = hm.host_need(0, run, 0, 0, "gpu", env, system=True)
    assert plan_need["system_bytes"] == int(hm.SYSTEM_HOST_SHARE * run) > 0
    assert r.need_bytes(gib, shmem_bytes=gib) == plan_need["need_bytes"] + hm.INIT_MIN_FREE_BYTES
    cpu = hm.init_reserve_bytes(Sched, "cpu")
    assert cpu.need_bytes(gib, shmem_bytes=gib) == gib + 11 * gib + hm.INIT_MIN_FREE_BYTES  # no share on the CPU
    # available: all of it but half the system's share: the plan would refuse, so the guard does
    monkeypatch.setattr(hm, "host_memory_available_bytes",
                        lambda: run + hm.INIT_MIN_FREE_BYTES + plan_need["system_bytes"] // 2)
    monkeypatch.setattr(hm, "_rss_shmem_bytes", lambda: gib)
    with pytest.raises(hm.HostMemoryError, match="the first step and the rest of the system"):
        hm.check_materialise(gib, r, "host chunk 7's optimizer state")
    monkeypatch.setattr(hm, "host_memory_available_bytes",
                        lambda: plan_need["need_bytes"] + hm.INIT_MIN_FREE_BYTES)
    hm.check_materialise(gib, r, "host chunk 7's optimizer state")  # exactly the plan's need: placed
