"""The GPU runtime's pinned-host pool in the host accounting (:mod:`chunkjax.host_memory`).

Measured on the lent H200 (``experiments/results/host_growth_s10.json``): a 3B decoder whose plan
kept 15.9 GiB of chunks pinned between steps held a 32 GiB pinned pool (XLA's ``xla_gpu_host_bfc``
grows by regions that double), and the process 5.4 GiB beyond model data and pool: the run
needed 71.4 GiB where the plan said 37.7. The accounting now counts the pool as the runtime
grows it, the process as measured, and the planner re-plans with a lower host budget when the
pool's growth is what puts a plan over the machine.
"""
import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import chunkjax as cj
from chunkjax import fit, fit_host, host_memory
from chunkjax.host_memory import HostMemoryError, pinned_pool_bytes
from chunkjax.host_update import AdamW
from models import gpt

GiB = 2**30


def test_pool_grows_to_the_power_of_two_above_the_peak_capped_by_the_limit():
    assert pinned_pool_bytes(17 * GiB, "cpu", {}) == 17 * GiB  # ordinary memory on the CPU
    assert pinned_pool_bytes(14 * GiB, "gpu", {}) == 16 * GiB
    # above 90 % of a 16 GiB pool the pool fragments and grows its next region (PINNED_POOL_FRAGMENTATION)
    assert pinned_pool_bytes(15 * GiB, "gpu", {}) == 32 * GiB
    assert pinned_pool_bytes(16 * GiB, "gpu", {}) == 32 * GiB
    assert pinned_pool_bytes(16 * GiB + 1, "gpu", {}) == 32 * GiB  # the 3B run's case
    assert pinned_pool_bytes(37 * GiB, "gpu", {}) == 64 * GiB  # the default cap
    assert pinned_pool_bytes(37 * GiB, "gpu", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "40"}) == 40 * GiB
    assert pinned_pool_bytes(0, "gpu", {}) == 0
    pre = {"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "true", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "40"}
    assert pinned_pool_bytes(3 * GiB, "gpu", pre) == 40 * GiB  # preallocated: the whole cap from the start
    assert host_memory.pinned_host_limit_bytes("gpu", {"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "1"}) == 16 * GiB


def test_host_need_counts_the_pool_and_the_refusal_says_how_to_preallocate():
    need = host_memory.host_need(37 * GiB, 73 * GiB, 0, 5 * GiB, "gpu", {})
    assert need["pinned_pool_bytes"] == 64 * GiB and need["need_bytes"] == (64 + 73 + 5) * GiB
    with pytest.raises(HostMemoryError) as e:
        host_memory.check_host_need(need, "this plan", "gpu", available=122 * GiB)
    msg = str(e.value)
    assert "\n" not in msg and "a 64.0 GiB pinned pool" in msg
    # 37 GiB over the 90 % a plan may use of the pool (check_pinned_host) rounds up to 42 GiB: 42 + 73 + 5 =
    # 120 GiB fits the 122 available (was 39 GiB, a cap check_pinned_host then refused: 37 > 0.9 * 39)
    assert "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=42" in msg
    host_memory.check_pinned_host(37 * GiB, "gpu", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "42"})  # what it says fits
    assert e.value.need_bytes == 142 * GiB and e.value.available_bytes == 122 * GiB
    tight = host_memory.host_need(37 * GiB, 90 * GiB, 0, 5 * GiB, "gpu", {})
    with pytest.raises(HostMemoryError) as e:  # preallocating would not fit either: not offered
        host_memory.check_host_need(tight, "this plan", "gpu", available=122 * GiB)
    assert "PREALLOCATE" not in str(e.value)


def test_pool_with_offloaded_activations_counts_its_next_region():
    """Session 17 on the lent H200 (``/work/notes/gpu_s17/r/auto.log``): GPT3_6B, remat="auto",
    batch 32, 24 GiB device budget. The plan kept 12.74 GB of params, 2.36 GB of gradients and
    17.72 GB of offloaded activations pinned (30.6 GiB, 95 % of a 32 GiB pool) and 76.44 GB
    pageable; it accounted a 32 GiB pool, 120.5 GB in all against 133.3 GB available, and the kernel
    killed the worker in its first step (20.5 GB available after init, the pool's next region is
    32 GiB). The pool a peak above 90 % of it needs is the next power of two: the plan is refused."""
    pinned = int((12.74 + 2.36 + 17.72) * 1e9)
    pageable = int((25.48 + 50.96) * 1e9)
    assert pinned_pool_bytes(pinned, "gpu", {}) == 64 * GiB
    need = host_memory.host_need(pinned, pageable, 0, int(6.22e9), "gpu", {}, system=True)
    assert need["pinned_pool_bytes"] == 64 * GiB
    with pytest.raises(HostMemoryError):
        host_memory.check_host_need(need, "this plan", "gpu", available=int(133.29e9))
    # without the activations (remat="full") the 15.1 GB pinned stay in a 16 GiB pool
    assert pinned_pool_bytes(int((12.74 + 2.36) * 1e9), "gpu", {}) == 16 * GiB


@pytest.fixture(scope="module")
def problem():
    cfg = gpt.get_config("micro", n_layers=3)
    params = gpt.init_params(cfg, jax.random.key(3))
    p = fit.prepare(gpt.gpt_stages(cfg), params, jax.ShapeDtypeStruct((2, 17), jnp.int32),
                    host_optimizer=AdamW(1e-3), compute_dtype=jnp.float32, min_chunks=8, check_host=False,
                    host_budget=10**12)
    return dataclasses.replace(p, platform="gpu")  # host bytes as on a GPU node


def _smallest(p) -> int:
    with pytest.raises(cj.PlanError) as e:
        fit.plan(p, 1)
    return e.value.min_budget_bytes


def test_schedule_need_on_a_gpu_counts_pool_and_measured_process(problem):
    s = fit.plan(problem, _smallest(problem))
    need = fit_host.host_need(problem, s)
    assert need["pinned_host_bytes"] + need["pageable_bytes"] == s.predicted.host_bytes
    assert need["pinned_pool_bytes"] == pinned_pool_bytes(need["pinned_host_bytes"], "gpu")
    assert need["process_bytes"] == host_memory.GPU_PROCESS_HOST_BYTES + 2 * 4 * problem.layout.chunk_size
    run = need["pinned_pool_bytes"] + need["pageable_bytes"] + need["process_bytes"]
    assert need["system_bytes"] == int(host_memory.SYSTEM_HOST_SHARE * run) > 0  # the rest of the machine
    assert need["need_bytes"] == run + need["system_bytes"]


def test_fit_replans_with_a_lower_host_budget_when_the_pool_puts_it_over(problem, monkeypatch):
    budget = _smallest(problem) + 2 * problem.cb.params
    first = fit.plan(problem, budget)  # the fastest plan: some chunks' updates streamed, their state pinned
    need = fit_host.host_need(problem, first)
    assert need["pinned_pool_bytes"] > need["pinned_host_bytes"] and first.counts().get(
        "params_pinned_host/update_streamed", 0) > 0
    avail = need["need_bytes"] - 1  # the plan's own host bytes fit; its pool does not
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: avail)
    fitted = fit.fit_problem(problem, budget, check_compiled=False)
    got = fitted.report.host
    assert got["need_bytes"] <= avail and got["available_bytes"] == avail
    # what the machine gives the run shrank (fewer streamed chunks, or master-fetch host chunks)
    assert got["pinned_pool_bytes"] + got["pageable_bytes"] < need["pinned_pool_bytes"] + need["pageable_bytes"]
    assert fitted.problem.host_budget_bytes < problem.host_budget_bytes
    # nothing can fit: the first refusal, one line
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["process_bytes"])
    with pytest.raises(HostMemoryError) as e:
        fit.fit_problem(problem, budget, check_compiled=False)
    assert "\n" not in str(e.value) and e.value.need_bytes == need["need_bytes"]


def test_a_preallocated_pool_is_counted_once(monkeypatch):
    """With XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE the pool is taken when the backend starts: MemAvailable no
    longer counts it and the need counts it, so what a plan may need is MemAvailable plus the pool (the
    lent H200 refused the 8B full fine-tuning with 78.2 GiB 'available' beside a 43 GiB pool it held)."""
    pre = {"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "true", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "43"}
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 78 * GiB)
    assert host_memory.available_for_plan("gpu", pre) == (78 + 43) * GiB
    assert host_memory.available_for_plan("gpu", {}) == 78 * GiB
    assert host_memory.available_for_plan("cpu", pre) == 78 * GiB
    for k, v in pre.items():
        monkeypatch.setenv(k, v)

    class Lay:
        n_chunks, chunk_size = 146, 55 * 2**20

    class CB:
        def model_bytes(self, n):
            return int(109.8 * GiB)
    # 109.8 GiB of model data, 24 GiB on the device: 85.8 GiB on the host, 43 of them may be pinned
    host_memory.check_host_lower_bound(Lay(), CB(), "gpu", 1, 24 * GiB, available=(78 + 43) * GiB)
    with pytest.raises(HostMemoryError) as e:
        host_memory.check_host_lower_bound(Lay(), CB(), "gpu", 1, 24 * GiB, available=80 * GiB)
    assert e.value.need_bytes == int(85.8 * GiB) + host_memory.process_bytes(Lay(), "gpu")


def test_master_fetch_chosen_by_the_machines_measure(monkeypatch):
    """With a preallocated pool the machine's host bytes are the pool plus pageable bytes: a host
    budget the compute copies' pageable bytes exceed must turn host chunks master-fetch (float32
    masters pinned, in the pool already paid for), not keep the copies because their pinned plus
    pageable bytes look small (the 8B full fine-tuning kept copies at 14.6 B/param and ran out)."""
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "true")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "1")
    cfg = gpt.get_config("micro", n_layers=3)
    params = gpt.init_params(cfg, jax.random.key(3))
    p = fit.prepare(gpt.gpt_stages(cfg), params, jax.ShapeDtypeStruct((2, 17), jnp.int32),
                    host_optimizer=AdamW(1e-3), compute_dtype=jnp.bfloat16, min_chunks=8, check_host=False,
                    host_budget=10**12)
    p = dataclasses.replace(p, platform="gpu")
    budget = _smallest(p) + 4 * p.cb.params
    roomy = fit.plan(p, budget)
    assert not roomy.master_fetch  # an unbounded host keeps every copy (the faster fetch)
    need = fit_host.host_need(p, roomy)
    assert need["pinned_pool_bytes"] == GiB
    tight = dataclasses.replace(p, host_budget_bytes=need["pinned_pool_bytes"] + need["pageable_bytes"] - 1)
    s = fit.plan(tight, budget)
    got = fit_host.host_need(tight, s)
    assert s.master_fetch and got["pageable_bytes"] < need["pageable_bytes"]
    assert got["pinned_pool_bytes"] + got["pageable_bytes"] <= tight.host_budget_bytes
    assert s.predicted.peak_device_bytes <= budget


def test_pinned_bytes_over_the_runtime_limit_refused_naming_the_setting(problem, monkeypatch):
    """A host budget no placement can use because each one's pinned bytes exceed the runtime's
    pinned-pool cap was refused as 'below the 4611686018427387904 bytes ... use host_budget >=
    4294967296 GiB' (the measure's sentinel printed as bytes, on the H200 with a 44 GiB cap). Right:
    one line naming the limit and its setting, no sentinel."""
    budget = _smallest(problem) + problem.cb.params
    s = fit.plan(problem, budget)
    pinned = fit_host.host_need(problem, s)["pinned_host_bytes"]
    assert pinned > 0
    monkeypatch.setattr(fit_host, "pinned_host_limit_bytes", lambda platform: pinned // 4)
    with pytest.raises(cj.PlanError) as e:
        fit.plan(problem, budget)
    msg = str(e.value)
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in msg and str(2**62) not in msg and "\n" not in msg
    assert f"limit of {pinned // 4} bytes" in msg
    monkeypatch.setattr(fit_host, "pinned_host_limit_bytes", lambda platform: None)  # no cap: plans again
    assert fit.plan(problem, budget).predicted.peak_device_bytes <= budget


def test_speculation_backups_bounded_by_what_the_plan_leaves(problem, monkeypatch):
    """With clipping, host updates run speculatively and back up the state they overwrite; that
    pool was bounded by half of MemAvailable read after the state was allocated, beside a plan
    that had counted nothing for it (8B full fine-tuning on the H200: the backups took the last
    10 GiB). Right: the fit bounds it by a share of the host bytes its plan leaves, tells the
    step, and reports it."""
    budget = _smallest(problem) + 2 * problem.cb.params
    need = fit_host.host_need(problem, fit.plan(problem, budget))
    spare = 3 * problem.cb.state
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["need_bytes"] + spare)
    fitted = fit.fit_problem(problem, budget, check_compiled=False)
    h = fitted.report.host
    left = h["available_bytes"] - h["need_bytes"]
    assert 0 < h["speculation_bytes"] <= fit_host.SPECULATION_SHARE * left
    assert fitted.step.speculation_bytes == h["speculation_bytes"]
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["need_bytes"])
    tight = fit.fit_problem(problem, budget, check_compiled=False)
    assert tight.report.host["speculation_bytes"] == 0 == tight.step.speculation_bytes  # nothing left: no speculation
    # plenty of host memory: the bound is what the host-updated chunks can back up, not a share
    # of the machine (a 2.77M-param model's report once said 8.46e9 bytes)
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["need_bytes"] + 2**40)
    roomy = fit.fit_problem(problem, budget, check_compiled=False)
    n_host = roomy.report.schedule.update_locations.count("host")
    cb = problem.cb
    assert 0 < roomy.report.host["speculation_bytes"] == n_host * (cb.master + cb.opt + cb.grad)


def test_a_finer_cut_when_even_master_fetch_does_not_fit(monkeypatch):
    """Issue 24 item 1 on the H200: GPT3_15B at batch 8 needed its host chunks' float32 state (12
    B/param) plus the gradients of two programs of eight (6.35 GB, 60 of 176 host chunks), over
    the host. When every host chunk is master-fetch and the host still does not hold the plan,
    the planner cuts the backward finer (host_forms.FINER_PROGRAMS): only the working set shrinks,
    the state stays 12 B/param, and a budget below the finest cut's need is refused naming it."""
    from chunkjax import host_forms
    from chunkjax.plan import plan_schedule
    cfg = gpt.get_config("micro", n_layers=12)
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((2, 17), jnp.int32),
                    host_optimizer=AdamW(1e-3), compute_dtype=jnp.bfloat16, min_chunks=24, check_host=False,
                    host_budget=None)
    lay, cb = p.layout, p.cb

    def all_host(host_budget, must_fit=False):
        return plan_schedule(lay, p.traces, cb, 10**15, policy="all_host", host_budget_bytes=host_budget,
                             flops_per_step=p.flops_per_step, must_fit=must_fit)
    with monkeypatch.context() as m:  # the planner before: eight programs at most
        m.setattr(host_forms, "FINER_PROGRAMS", ())
        at8 = all_host(1)
    host = tuple(c for c, u in enumerate(at8.update_locations) if u == "host")
    assert at8.master_fetch == host and len(host) == lay.n_chunks and len(at8.segments) <= host_forms.MAX_PROGRAMS
    finest = all_host(1)  # nothing fits: the least working set any cut gives
    assert len(at8.segments) < len(finest.segments) <= max(host_forms.FINER_PROGRAMS)
    s = all_host(at8.predicted.host_bytes - 1, must_fit=True)  # fits with a finer cut (and some copies back)
    q, q8, qf = s.predicted, at8.predicted, finest.predicted
    assert len(at8.segments) < len(s.segments) <= len(finest.segments) and set(s.master_fetch) <= set(host)
    assert q.host_bytes <= q8.host_bytes - 1 and q.host_working_bytes < q8.host_working_bytes
    copies = len(host) - len(s.master_fetch)
    assert q.host_bytes - q.host_working_bytes == len(host) * cb.state + copies * cb.params
    assert finest.master_fetch == host and qf.host_working_bytes < q8.host_working_bytes
    assert qf.host_bytes - qf.host_working_bytes == q8.host_bytes - q8.host_working_bytes == len(host) * cb.state
    per = lay.chunk_size * len(host)  # 12 B/param of state + the stated working set
    assert qf.host_resident_bytes_per_param == pytest.approx(cb.state / lay.chunk_size + qf.host_working_bytes / per)
    assert qf.host_resident_bytes_per_param <= 12.5 + qf.host_working_bytes / per
    assert qf.peak_device_bytes == q8.peak_device_bytes  # the cut moves no device bytes
    need = finest.predicted.host_bytes
    with pytest.raises(cj.PlanError) as e:
        all_host(need - 1, must_fit=True)
    assert "\n" not in str(e.value) and f"below the {need} bytes" in str(e.value)


def test_the_bench_passes_the_environments_pinned_pool_cap_to_its_workers():
    """Session 12 ran ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=40
    python -m experiments.bench --largest ...``: the worker got the bench's default cap of 110 GiB,
    preallocated, and GPT3_15B was refused needing 176 GB. The environment's cap is the default."""
    from experiments import bench
    assert bench.default_host_limit_gb({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "38"}) == 38
    assert bench.default_host_limit_gb({}) == bench.DEFAULT_HOST_LIMIT_GB
    assert bench.default_host_limit_gb({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "x"}) == bench.DEFAULT_HOST_LIMIT_GB
    env = bench.worker_env(2**30, None, bench.default_host_limit_gb({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "38"}))
    assert env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "38"


def test_speculation_bound_with_rollback_by_inversion_holds_kept_gradients_alone(problem, monkeypatch):
    """Rollback by inversion keeps no backups, only the speculated chunks' gradients: its bound is
    the share of the spare host bytes itself (not the backups' part of it, which let 107 of 140
    GPT3_6B host chunks speculate in s23i), at most the host-updated chunks' gradients; the step
    gets it. Backups (rollback "backup") keep the old bound."""
    import dataclasses
    inv = dataclasses.replace(problem, rollback="invert")
    budget = _smallest(problem) + 2 * problem.cb.params
    need = fit_host.host_need(inv, fit.plan(inv, budget))
    spare = int(np.random.default_rng().integers(1, 3) * problem.cb.grad + problem.cb.grad // 3)
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["need_bytes"] + spare)
    f_inv = fit.fit_problem(inv, budget, check_compiled=False)
    f_bak = fit.fit_problem(problem, budget, check_compiled=False)
    left = f_inv.report.host["available_bytes"] - f_inv.report.host["need_bytes"]
    assert f_inv.report.host["speculation_bytes"] == int(fit_host.SPECULATION_SHARE * left)
    assert f_inv.step.speculation_bytes == f_inv.report.host["speculation_bytes"] and f_inv.step.rollback == "invert"
    cb = problem.cb
    left_b = f_bak.report.host["available_bytes"] - f_bak.report.host["need_bytes"]
    assert f_bak.report.host["speculation_bytes"] == int(
        fit_host.SPECULATION_SHARE * left_b * (cb.master + cb.opt) / (cb.master + cb.opt + cb.grad))
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: need["need_bytes"] + 2**40)
    roomy = fit.fit_problem(inv, budget, check_compiled=False)
    n_host = roomy.report.schedule.update_locations.count("host")
    assert 0 < roomy.report.host["speculation_bytes"] == n_host * cb.grad
